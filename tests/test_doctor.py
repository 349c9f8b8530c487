"""crossbow-doctor (crossbow_tf/doctor.py) on this CPU: every check's verdict line and the exit codes
(0 nothing failed, 1 a check failed, 2 bad arguments), a broken reduction caught, and why no GPU is
visible, as a pure function of the facts. Nothing here runs on a GPU (tests/test_gpu.py does, with
-m gpu)."""
import os
import stat
import subprocess
import sys

import pytest

from crossbow_tf import doctor
from crossbow_tf.doctor import FAILED, OK, SKIPPED, GpuFacts, gpu_verdict
from crossbow_tf.engine import conv_forms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_doctor(*args, env=None):
    # CUDA_VISIBLE_DEVICES is emptied by conftest.py and inherited: the doctor sees the CPU only.
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run([sys.executable, "-m", "crossbow_tf.doctor", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def verdict_lines(stdout):
    """{check: its line} of the doctor's output (each line starts with the check's name)."""
    return {line.split()[0]: line for line in stdout.splitlines() if line.split() and line.split()[0] in doctor.CHECKS}


def test_every_check_has_its_verdict_line_and_nothing_fails_on_this_cpu():
    result = run_doctor("--logical-cpu", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = verdict_lines(result.stdout)
    assert list(lines) == list(doctor.CHECKS)            # every check, once, in order
    skipped = {"gpu", "nccl"}                             # no GPU here: hidden by CUDA_VISIBLE_DEVICES
    for check, line in lines.items():
        status = line[len(check):].split()[0].rstrip(":")
        assert status == (SKIPPED if check in skipped else OK), line
    assert "hides every GPU" in lines["gpu"] and "needs 2 GPUs" in lines["nccl"]
    assert "2 x CPU (logical)" in lines["devices"]
    assert "one_device and hierarchical_copy gave the exact sum on each of 2 devices" in lines["all-reduce"]
    for policy in doctor.PRECISIONS:
        assert "two fused SMA steps of 4 learners on 2 device(s), z the same on each" in lines[policy]
    assert "local multi-worker trials run in a private network namespace with only loopback (as root, with ip " \
           "netns)" in lines["workers"]
    assert result.stdout.splitlines()[-1].startswith("crossbow-doctor: 11 check(s), nothing failed, 2 skipped")


def test_the_workers_check_says_what_a_tf_config_naming_other_hosts_exposes(monkeypatch):
    from crossbow_tf.compare import netns
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2223"]}, '
                                    '"task": {"type": "worker", "index": 0}}')
    monkeypatch.setattr(netns, "PrivateLoopback", _Refused)   # as an ordinary user: a user namespace
    verdict = doctor.CHECKS["workers"](None)
    assert verdict.status == OK and "(in a user namespace)" in verdict.detail, verdict
    assert ("this shell's TF_CONFIG names other hosts (10.0.0.1, 10.0.0.2): each worker's server accepts "
            "unauthenticated connections on its port (2222, 2223) of every interface") in verdict.detail, verdict
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:2222", "localhost:2223"]}}')
    assert "other hosts" not in doctor.CHECKS["workers"](None).detail


def test_without_any_private_namespace_the_workers_check_warns_or_fails_when_required(monkeypatch):
    from crossbow_tf.compare import netns
    monkeypatch.setattr(netns, "PrivateLoopback", _Refused)
    monkeypatch.setattr(netns, "UserLoopback", _UserRefused)
    monkeypatch.delenv("CROSSBOW_PRIVATE_WORKERS", raising=False)
    verdict = doctor.CHECKS["workers"](None)
    assert verdict.status == OK and verdict.detail.startswith(
        "the workers' TensorFlow servers will be reachable on every interface of this machine while the trial runs, "
        "without authentication (no private network namespace here: ip netns add cbn1x1-lo: Operation not "
        "permitted; a user namespace: unshare: Operation not permitted); allow user namespaces"), verdict
    monkeypatch.setenv("CROSSBOW_PRIVATE_WORKERS", "require")
    verdict = doctor.CHECKS["workers"](None)
    assert verdict.status == FAILED and verdict.detail.startswith(
        "every local multi-worker trial would be refused: CROSSBOW_PRIVATE_WORKERS=require: the workers' TensorFlow "
        "servers will be reachable"), verdict


class _Refused:
    def __init__(self):
        from crossbow_tf.compare import netns
        raise netns.NetworkError("ip netns add cbn1x1-lo: Operation not permitted")


def test_without_onednn_the_convolutions_take_the_portable_form_and_nothing_fails():
    # TensorFlow's own CPU kernels compute no gradient of a grouped convolution (issue 30, item 4): the
    # doctor names the form the learners' convolutions take instead and why, and fails nothing (issue 43).
    result = run_doctor("--only", "conv-forms", "mixed_bfloat16", env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = verdict_lines(result.stdout)
    line = lines["conv-forms"]
    assert line.startswith("conv-forms      ok (float32 per-learner (grouped does not: Fused conv implementation does "
                           "not support grouped convolutions for now.); bfloat16 per-learner (grouped does not: "), line
    assert line.endswith("each against float64 per learner on 2 device(s), oneDNN off, "
                         f"{conv_forms.cpu_summary()})")
    assert lines["mixed_bfloat16"].startswith("mixed_bfloat16  ok (two fused SMA steps")


def test_where_no_form_computes_a_dtype_its_policy_is_skipped_not_failed(monkeypatch, cpu_devices):
    for form in conv_forms.FORMS:
        monkeypatch.setitem(conv_forms._probed, ("CPU", "bfloat16", form, False), f"no {form} kernel")
    ctx = doctor.Context(cpu_devices[:2], "CPU", [])
    verdict = doctor.check_conv_forms(ctx)
    assert verdict.status == doctor.OK and "bfloat16 none, so convolutional models refuse its policy (" in verdict.detail
    verdict = doctor.CHECKS["mixed_bfloat16"](ctx)
    assert verdict.status == doctor.SKIPPED
    assert verdict.detail.startswith("convolutional models refuse mixed_bfloat16 here: no form of the learners' "
                                     "convolution computes bfloat16 gradients on this CPU")
    for form in conv_forms.FORMS:
        monkeypatch.setitem(conv_forms._probed, ("CPU", "float32", form, False), f"no {form} kernel")
    assert doctor.check_conv_forms(ctx).status == doctor.FAILED


def test_tensorflow_that_does_not_import_is_failed_not_a_traceback(tmp_path):
    broken = tmp_path / "tensorflow"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("libcudart.so.12: cannot open shared object file")\n')
    result = run_doctor(env={"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.splitlines() == [
        "tensorflow      FAILED: TensorFlow does not import: ImportError: libcudart.so.12: cannot open shared "
        "object file; reinstall in a fresh environment: pip install 'crossbow_tf[gpu]' (or [cpu] on a machine "
        "without GPUs)"]


@pytest.mark.parametrize("args, named", [
    (["--logical-cpu", "0"], "--logical-cpu"),
    (["--logical-cpu", "two"], "--logical-cpu"),
    (["--only", "xla", "cuda"], "'cuda'"),
    (["--gpus", "2"], "--gpus"),
])
def test_a_bad_argument_is_one_line_and_exit_2(args, named):
    result = run_doctor(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and named in result.stderr
    assert result.stderr.startswith("crossbow-doctor: error:")


# ---------------------------------------------------------------------------------------------
# In this process (conftest.py's 4 logical CPU devices).

def test_a_reduction_that_drops_a_device_is_failed_and_exit_1(monkeypatch, capsys):
    assert doctor.main(["--logical-cpu", "4", "--only", "all-reduce"]) == 0
    assert "all-reduce      ok (one_device and hierarchical_copy gave the exact sum on each of 4 devices" \
        in capsys.readouterr().out
    import crossbow_tf.distribute.reduce as reduce_lib
    reduce_sum = reduce_lib.all_reduce_sum

    def drops_the_last_device(cross_device_ops, per_device):   # TensorFlow's hierarchical copy on odd counts
        short = reduce_sum(None, per_device)
        short[-1] = [t * 0 for t in short[-1]]
        return reduce_sum(cross_device_ops, short)
    monkeypatch.setattr(reduce_lib, "all_reduce_sum", drops_the_last_device)
    assert doctor.main(["--logical-cpu", "4", "--only", "devices", "all-reduce"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("devices         ok (4 x CPU (logical)")
    assert out[1].startswith("all-reduce      FAILED: one_device over 4 devices: expected 15 on every device, "
                             "got /device:CPU:0: 7, ")
    assert out[-1].startswith("crossbow-doctor: 2 check(s), 1 FAILED (all-reduce), 0 skipped")


def test_a_check_that_raises_is_failed_with_its_error(monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("no kernel registered\nsecond line")
    monkeypatch.setitem(doctor.CHECKS, "xla", broken)
    assert doctor.main(["--logical-cpu", "4", "--only", "xla", "tensorflow"]) == 1
    lines = verdict_lines(capsys.readouterr().out)
    assert lines["xla"] == ("xla             FAILED: the check itself failed: RuntimeError: no kernel registered; "
                            "report this output")
    assert lines["tensorflow"].startswith("tensorflow      ok (TensorFlow ")


def test_a_precision_step_that_leaves_devices_apart_is_failed(monkeypatch, cpu_devices):
    # The check compares every device's z after the step's all-reduce: a device left out shows.
    import crossbow_tf.engine.core as core
    reduce_sum = core.all_reduce_sum
    monkeypatch.setattr(core, "all_reduce_sum", lambda ops, per_device: [
        [t * 0 if d == len(per_device) - 1 else t for t in tensors]
        for d, tensors in enumerate(reduce_sum(ops, per_device))])
    ctx = doctor.Context(cpu_devices[:2], "CPU", [])
    verdict = doctor.CHECKS["float32"](ctx)
    assert verdict.status == FAILED and "z differs between /device:CPU:0 and /device:CPU:1" in verdict.detail


def test_xla_without_ptxas_is_failed_with_where_xla_looked_and_what_to_do(cpu_devices, monkeypatch):
    import tensorflow as tf

    def no_ptxas(fn, jit_compile=False, **kwargs):   # what XLA raises on a GPU when it finds no ptxas
        def compiled(*args):
            raise tf.errors.InternalError(None, None, "Couldn't find a suitable version of ptxas. The following "
                                          "locations were considered: /usr/local/cuda/bin/ptxas\nmore")
        return compiled if jit_compile else fn
    monkeypatch.setattr(tf, "function", no_ptxas)
    monkeypatch.setattr(doctor, "_xla_tools_line", lambda: ("ptxas: not found, libdevice: /cuda/libdevice.10.bc",
                                                            (None, "/cuda/libdevice.10.bc")))
    verdict = doctor.CHECKS["xla"](doctor.Context(cpu_devices[:2], "GPU", [(8, 0), (8, 0)]))
    assert verdict == doctor.Verdict(FAILED, (
        "XLA on /device:CPU:0: InternalError: Couldn't find a suitable version of ptxas. The following locations "
        "were considered: /usr/local/cuda/bin/ptxas; ptxas: not found, libdevice: /cuda/libdevice.10.bc; set "
        "XLA_FLAGS=--xla_gpu_cuda_data_dir=/path/to/cuda (the folder with bin/ptxas and "
        "nvvm/libdevice/libdevice.10.bc), or pip install nvidia-cuda-nvcc-cu12; until then runs fall back to the "
        "update without XLA (one line at the first step); jit_update: false skips the attempt"))


def test_mixed_precision_is_skipped_below_the_compute_capability_it_needs(cpu_devices, monkeypatch):
    monkeypatch.setattr(doctor, "precision_step", lambda *args, **kwargs: "ran")   # any run would be FAILED
    pascal = doctor.Context(cpu_devices[:2], "GPU", [(6, 1), (6, 1)])
    turing = doctor.Context(cpu_devices[:2], "GPU", [(7, 5), (7, 5)])
    assert doctor.CHECKS["mixed_float16"](pascal) == doctor.Verdict(
        SKIPPED, "mixed_float16 needs compute capability 7.0 for its speed; these GPUs have 6.1: train in float32")
    assert doctor.CHECKS["mixed_bfloat16"](turing).detail.startswith("mixed_bfloat16 needs compute capability 8.0")
    # Where the GPUs have it, and for float32 always, the step runs.
    assert doctor.CHECKS["mixed_float16"](turing).status == doctor.CHECKS["float32"](pascal).status == FAILED


# ---------------------------------------------------------------------------------------------
# Why no GPU, from given facts.

SMI = ("GPU 0: NVIDIA A100-SXM4-80GB", "GPU 1: NVIDIA A100-SXM4-80GB")


@pytest.mark.parametrize("facts, status, words", [
    (GpuFacts(("NVIDIA A100-SXM4-80GB (compute capability 8.0)",) * 2, None, False, True, SMI, "12.5", "9"),
     OK, ["2 x GPU: NVIDIA A100-SXM4-80GB (compute capability 8.0)", "CUDA 12.5, cuDNN 9"]),
    (GpuFacts((), "", False, True, SMI, "12.5", "9"), SKIPPED, ["CUDA_VISIBLE_DEVICES='' hides every GPU",
                                                               "nvidia-smi lists 2", "unset it"]),
    (GpuFacts((), "-1", True, False, None), SKIPPED, ["CUDA_VISIBLE_DEVICES='-1' hides every GPU"]),
    (GpuFacts((), "0", True, False, SMI), FAILED, ["TensorFlow sees none", "tensorflow-cpu",
                                                  "pip uninstall tensorflow-cpu"]),
    (GpuFacts((), None, False, False, SMI), FAILED, ["built without CUDA", "crossbow_tf[gpu]"]),
    (GpuFacts((), None, False, True, SMI, "12.5", "9"), FAILED, ["CUDA libraries did not load",
                                                                "CUDA 12.5, cuDNN 9", "--verbose"]),
    (GpuFacts((), None, True, False, None), SKIPPED, ["nvidia-smi is not on PATH", "tensorflow-cpu",
                                                     "training runs on the CPU"]),
    (GpuFacts((), None, False, True, ()), SKIPPED, ["nvidia-smi lists none"]),
    (GpuFacts((), "2,3", False, True, SMI, "12.5", "9"), FAILED, ["CUDA_VISIBLE_DEVICES='2,3' names GPU 2",
                                                                 "nvidia-smi lists 2 (ids 0-1)"]),
    (GpuFacts(("NVIDIA A100-SXM4-80GB (compute capability 8.0)",), None, False, True, SMI + ("GPU 2: Tesla K10",),
              "12.5", "9"), OK, ["1 x GPU", "nvidia-smi lists 3", "minimum compute capability"]),
], ids=["seen", "hidden-empty", "hidden-minus-one", "cpu-wheel", "no-cuda-build", "libraries-missing",
        "no-gpu-cpu-wheel", "no-gpu", "ids-beyond-the-gpus", "some-ignored"])
def test_why_no_gpu(facts, status, words):
    verdict = gpu_verdict(facts)
    assert verdict.status == status and all(w in verdict.detail for w in words), verdict


def test_ptxas_and_libdevice_are_found_where_xla_looks(tmp_path):
    def tool(root, *parts):
        path = tmp_path.joinpath(root, *parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return str(path)
    assert doctor.cuda_data_dir("--xla_gpu_autotune_level=2 --xla_gpu_cuda_data_dir=/opt/cu") == "/opt/cu"
    assert doctor.cuda_data_dir("--xla_gpu_autotune_level=2") is None and doctor.cuda_data_dir(None) is None
    tensorflow_dir = str(tmp_path / "site-packages" / "tensorflow")
    roots = doctor.cuda_roots(None, tensorflow_dir, "12.5.1")
    wheel = str(tmp_path / "site-packages" / "nvidia" / "cuda_nvcc")
    assert wheel in roots and str(tmp_path / "site-packages" / "nvidia" / "cu13") in doctor.cuda_roots(
        None, tensorflow_dir, "13.0")
    assert doctor.cuda_roots(str(tmp_path / "cuda"), tensorflow_dir, "12.5.1")[1:] == roots
    roots = [r for r in roots if r.startswith(str(tmp_path))]   # not this machine's /usr/local/cuda
    assert doctor.find_cuda_tools(None, roots, "") == (None, None)
    in_wheel = (tool(wheel, "bin", "ptxas"), tool(wheel, "nvvm", "libdevice", "libdevice.10.bc"))
    assert doctor.find_cuda_tools(None, roots, "") == in_wheel
    on_path = tool("path", "ptxas")                       # the PATH comes before the candidate roots
    assert doctor.find_cuda_tools(None, roots, str(tmp_path / "path"))[0] == on_path
    data_dir = str(tmp_path / "cuda")                     # and --xla_gpu_cuda_data_dir before both
    given = (tool("cuda", "bin", "ptxas"), tool("cuda", "nvvm", "libdevice", "libdevice.10.bc"))
    assert doctor.find_cuda_tools(data_dir, [data_dir] + roots, str(tmp_path / "path")) == given


class _UserRefused:
    def __init__(self):
        from crossbow_tf.compare import netns
        raise netns.NetworkError("a user namespace: unshare: Operation not permitted")
