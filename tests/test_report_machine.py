"""The study report's words about the machine come from its machine.json and its runs (issue 27):
the committed CPU study reads as a CPU study, the same files on an 8-GPU machine.json as a GPU one."""
import json
import os
import shutil

import pytest

from crossbow_tf.compare import reproduce, study_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY = os.path.join(ROOT, "docs", "results", "lenet_fashion_mnist_cpu")
# What the report once said on whatever machine it ran.
ONE_MACHINES_WORDS = ("AMD CPU", "2,000 images/s", "630", "this loaded", "2-core")


def test_hardware_comes_from_machine_json_else_from_what_the_runs_saw():
    cpu = study_report.hardware({"cpu": "AMD EPYC", "cpu_count": 2, "load_average": [6.46, 7.0, 5.3]},
                                [{"environment": {"physical_gpus": 0}}])
    assert (cpu.gpus, cpu.devices) == (0, "this CPU")
    assert cpu.described() == "AMD EPYC, 2 CPU cores"
    assert cpu.load_words() == ", load average 6.46 when the study started"
    gpu = study_report.hardware({"cpu": "Xeon", "cpu_count": 64, "gpus": ["A100"] * 8}, [])
    assert (gpu.gpus, gpu.gpu_names, gpu.devices) == (8, ("A100",), "these 8 GPUs")
    assert gpu.described() == "8 x GPU (A100), 64 CPU cores"
    # An older machine.json names no GPUs: the runs' TensorFlow said how many it saw.
    seen = study_report.hardware({"cpu": "Xeon", "cpu_count": 8}, [{"environment": {"physical_gpus": 4}}, {}])
    assert (seen.gpus, seen.devices) == (4, "these 4 GPUs")


def test_the_committed_cpu_study_reads_as_run_on_its_cpu():
    with open(os.path.join(STUDY, "report.md")) as f:
        report = f.read()
    assert "- machine: AMD EPYC, 2 CPU cores, no GPU," in report and "load average 6.46 when the study started" in report
    assert "## Half 2: hardware efficiency (this CPU)" in report
    assert "not reproduced on this CPU; GPU claim not testable here" in report
    assert "(this study: one CPU device, so plain Keras)" in report
    assert [w for w in ONE_MACHINES_WORDS if w in report] == []


def test_the_verdict_names_the_machine_it_was_measured_on():
    from test_reproduce import _stats, plan, sweep
    spec, cells = plan(sweep(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]}),
                             sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]})))
    bench = {(16, 64): dict(sma=500.0, keras_global=1000.0)}
    stats = {("ssgd", 32): _stats(2, 0.6, tta=10.0), ("sma", 32): _stats(2, 0.6, tta=20.0),
             ("ssgd", 64): _stats(4, 0.6, tta=40.0), ("sma", 64): _stats(2, 0.6, tta=30.0)}
    words = {}
    for name, machine in (("cpu", study_report.Hardware("AMD EPYC", 2, load=6.46)),
                          ("gpu", study_report.Hardware("Xeon", 64, gpus=8, gpu_names=("H100",)))):
        rows, _ = study_report.verdict(spec, cells, stats, bench, machine)
        words[name] = {claim.split()[0]: (v, reason) for claim, v, _, reason in rows}
    assert words["cpu"]["k"][0] == "not reproduced on this CPU; GPU claim not testable here"
    assert words["cpu"]["k"][1].endswith("leaves idle, and there is no GPU here")
    assert words["cpu"]["TTA"][0].startswith("reproduced on this CPU")   # S-SGD 40 s / SMA 30 s = 1.33
    assert "training time on AMD EPYC, 2 CPU cores)" in words["cpu"]["TTA"][1]
    assert words["gpu"]["k"][0] == "not reproduced on these 8 GPUs"
    assert words["gpu"]["k"][1].endswith("one small batch leaves idle")
    assert words["gpu"]["TTA"][0].startswith("reproduced on these 8 GPUs")
    assert "training time on 8 x GPU (H100), 64 CPU cores)" in words["gpu"]["TTA"][1]


@pytest.fixture(scope="module")
def gpu_report(tmp_path_factory):
    """The committed study's report rebuilt from its own runs, bench and BatchNorm run, under a
    machine.json of an 8-GPU machine."""
    out = tmp_path_factory.mktemp("gpu") / "study"
    for part in ("runs", "bench"):
        shutil.copytree(os.path.join(STUDY, part), out / part)
    for name in ("machine.json", ".crossbow_report"):
        shutil.copy(os.path.join(STUDY, name), out / name)
    machine = json.loads((out / "machine.json").read_text())
    machine.update(cpu="Intel Xeon Platinum 8480+", cpu_count=112, gpus=["NVIDIA H100 80GB HBM3"] * 8,
                   load_average=[0.4, 0.3, 0.2])
    (out / "machine.json").write_text(json.dumps(machine))
    config = os.path.join(ROOT, "configs", "lenet_fashion_mnist_cpu.yaml")
    assert reproduce.main(["--config", config, "--out", str(out), "--resume", "--phases", "report"]) == 0
    return (out / "report.md").read_text()


def test_the_same_study_on_an_8_gpu_machine_json_reads_as_run_on_its_gpus(gpu_report):
    report = gpu_report
    assert "- machine: Intel Xeon Platinum 8480+, 112 CPU cores, 8 GPU(s) (NVIDIA H100 80GB HBM3)," in report
    assert "## Half 2: hardware efficiency (these 8 GPUs)" in report
    assert "| k learners of b cost about one model at k*b | not reproduced on these 8 GPUs |" in report
    assert "not reproduced at G=2048 on these 8 GPUs; no projection" in report
    assert "on these 8 GPUs, per series and point" in report
    assert [w for w in ONE_MACHINES_WORDS + ("this CPU", "AMD", "no GPU", "GPU claim not testable") if w in report] == []
    # The numbers are the study's own, whatever the machine: the verdict's ratios are unchanged.
    with open(os.path.join(STUDY, "report.md")) as f:
        committed = f.read()
    ratios = "b=16 G=128: 0.72x, b=16 G=512: 0.62x, b=16 G=2048: 0.50x, b=64 G=512: 0.81x, b=64 G=2048: 0.71x"
    assert ratios in report and ratios in committed
