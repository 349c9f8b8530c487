"""Several workers on 127.0.0.1, each a process with its own TensorFlow server (TF_CONFIG).

The workers are separate processes started here; each splits its CPU into logical devices. Their
runs are compared with one process holding all the learners, and the cluster's failures (a worker
that dies, hangs or never starts) must stop the others with one clear error within the timeout.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import forking
from crossbow_tf.distribute.cluster import local_tf_configs
from forking import forked_runs  # noqa: F401  (a fixture)

# The workers are forked from a server that imported TensorFlow once (tests/forking.py).
pytestmark = pytest.mark.usefixtures("forked_runs")

WORKER_SCRIPT = os.path.join(os.path.dirname(__file__), "multiworker_worker.py")
TIMEOUT = 12   # the worker timeout of these tests (default 60 s)
# Process start-up on this 2-core machine (TensorFlow's import, data, model, first trace) can take
# 20 s when other work shares the cores; waits are bounded by this plus the timeout.
START_UP = 40


def cluster_configs(n):
    """TF_CONFIG texts of N workers on 127.0.0.1, and their ports."""
    configs = local_tf_configs(n)
    return configs, [int(json.loads(c)["cluster"]["worker"][i].rsplit(":", 1)[1]) for i, c in enumerate(configs)]


_PRIVATE = {}


@pytest.fixture(scope="module", autouse=True)
def private_network():
    """One network namespace with only loopback for every worker this module starts (issue 52: their
    TensorFlow servers bind every interface), as the harness keeps its trials' workers."""
    from crossbow_tf.compare import netns
    with contextlib.ExitStack() as stack:
        _PRIVATE["prefix"] = netns.private_loopback(stack).prefix(0)
        yield
        _PRIVATE.clear()


def start(args, tf_config_text=None, cwd=None, python=forking.PYTHON):
    """`python ARGS` as a worker of TF_CONFIG_TEXT (None: on its own), a worker in the module's private
    namespace. PYTHON: forked (see tests/forking.py), or sys.executable where the test stops the
    worker's own process (SIGSTOP would stop the stand-in, not the worker)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    prefix = []
    if tf_config_text is not None:
        env["TF_CONFIG"] = tf_config_text
        prefix = _PRIVATE["prefix"]
    return subprocess.Popen([*prefix, python, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd)


def finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"process did not finish within {timeout} s; stderr: {err[-2000:]}")
    return proc.returncode, out, err


def load(path):
    with np.load(path) as f:
        return [f[name] for name in f.files if name not in ("losses", "collectives", "local_collectives")], f["losses"]


def test_one_cross_worker_all_reduce_per_iteration(trained):
    for name in ("worker0", "worker1", "single"):
        with np.load(trained / f"{name}.engine.npz") as f:
            assert int(f["collectives"]) == (0 if name == "single" else 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 workers x 2 logical devices x 2 learners, and one process with 2 devices x 4 learners (the
    same 8 learners in the same order, and half the devices to trace and compile for), each
    through the engine as the trainer feeds it (each worker reads only its own rows of every
    iteration; 5 iterations) and then through Keras's fit (every worker reads whole iterations; 5 steps).
    Through the engine also with rules that synchronise every third iteration (at iteration 2):
    decoupled SMA and DiLoCo's local SGD; and SMA with Adam for the learners and noise matching, also
    resumed by fresh engines from a checkpoint of iteration 3 (Adam without noise matching runs in the
    single process only, as the noise-matching test's counterpart); and under mixed_float16 with SGD
    and with Adam, one learner of the second worker overflowing in iteration 1."""
    out = tmp_path_factory.mktemp("multiworker")
    configs, _ = cluster_configs(2)
    common = ["--devices", "2", "--timeout", str(TIMEOUT), "--iterations", "5",
              "--rules", "sma", "sma_h3", "diloco_h3", "sma_adam_nm", "sma_f16", "sma_adam_f16"]
    procs = [start([WORKER_SCRIPT, "both", str(out / f"worker{i}"), "--learners", "2", *common,
                    "--resume", "sma_adam_nm"], configs[i]) for i in range(2)]
    procs.append(start([WORKER_SCRIPT, "both", str(out / "single"), "--learners", "4", *common, "sma_adam"]))
    # A guard against a hang, not a timing: about a minute on a quiet machine, minutes beside the
    # rest of the suite (every engine of every process traces and compiles its steps).
    for proc in procs:
        code, _, err = finish(proc, timeout=480)
        assert code == 0, err[-3000:]
    return out


@pytest.mark.parametrize("rule", ["sma_h3", "diloco_h3"])
def test_a_period_needs_one_cross_worker_all_reduce_per_synchronisation_and_none_between(trained, rule):
    """The synchronising step holds exactly one cross-worker all-reduce and the local step none; the
    workers' z stays the same bits, equal to one process holding all the learners."""
    for name in ("worker0", "worker1", "single"):
        with np.load(trained / f"{name}.engine_{rule}.npz") as f:
            assert int(f["collectives"]) == (0 if name == "single" else 1)
            assert int(f["local_collectives"]) == 0
    worker0, losses0 = load(trained / f"worker0.engine_{rule}.npz")
    worker1, losses1 = load(trained / f"worker1.engine_{rule}.npz")
    single, single_losses = load(trained / f"single.engine_{rule}.npz")
    for a, b in zip(worker0, worker1):
        assert np.array_equal(a, b)
    for a, c in zip(worker0, single):
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-5)
    initial, _ = load(trained / f"single.engine_{rule}.initial.npz")
    assert max(float(np.max(np.abs(a - c))) for a, c in zip(single, initial)) > 1e-4
    # At a synchronisation the loss is the whole iteration's, the same on both workers; between
    # them each worker reports its own learners' loss.
    np.testing.assert_array_equal(losses0[2], losses1[2])
    np.testing.assert_allclose(losses0[2], single_losses[2], rtol=1e-5)
    assert not np.array_equal(losses0[[0, 1, 3, 4]], losses1[[0, 1, 3, 4]])


@pytest.mark.parametrize("path", ["engine", "keras"])
def test_two_workers_equal_one_process_with_the_same_learners(trained, path):
    worker0, losses0 = load(trained / f"worker0.{path}.npz")
    worker1, losses1 = load(trained / f"worker1.{path}.npz")
    single, single_losses = load(trained / f"single.{path}.npz")
    assert len(worker0) == len(single) == 5   # small_cnn's 4 weights and its Dropout seed state
    for a, b in zip(worker0, worker1):
        assert np.array_equal(a, b)            # z is the same bits on both workers
    for a, c in zip(worker0, single):
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-5)
    # z moved in those iterations (SMA's first correction is zero, later ones are not).
    initial, _ = load(trained / f"single.{path}.initial.npz")
    assert max(float(np.max(np.abs(a - c))) for a, c in zip(single, initial)) > 1e-4
    np.testing.assert_allclose(losses0, single_losses, rtol=1e-5)
    np.testing.assert_array_equal(losses0, losses1)


def largest_difference(arrays, others):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(arrays, others))


def cluster_and_single(trained, name):
    """NAME's (z and state, losses) and learners from both workers, and from the single process:
    worker 1's learners follow worker 0's, the order of the single process's."""
    z = [load(trained / f"{who}.{name}.npz") for who in ("worker0", "worker1", "single")]
    learners = [load(trained / f"{who}.{name}.learners.npz")[0] for who in ("worker0", "worker1", "single")]
    return z, learners[0] + learners[1], learners[2]


def test_adam_learners_on_two_workers_equal_one_process_with_the_same_learners(trained):
    """Adam's step for the learners with noise matching, whose statistics travel in the same one
    all-reduce per iteration: z, the learners and the running means as in one process."""
    rule = "sma_adam_nm"
    ((z0, losses0), (z1, losses1), (single, single_losses)), learners, single_learners = \
        cluster_and_single(trained, f"engine_{rule}")
    for name in ("worker0", "worker1", "single"):
        with np.load(trained / f"{name}.engine_{rule}.npz") as f:
            assert int(f["collectives"]) == (0 if name == "single" else 1)
    for a, b in zip(z0, z1):
        assert np.array_equal(a, b)
    for a, c in zip(z0, single):
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-5)
    assert len(learners) == len(single_learners) == 8 * 4   # 8 learners x small_cnn's 4 weights
    for a, c in zip(learners, single_learners):
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(losses0, losses1)
    np.testing.assert_allclose(losses0, single_losses, rtol=1e-5)
    initial, _ = load(trained / f"single.engine_{rule}.initial.npz")
    assert largest_difference(single[:4], initial) > 1e-3
    noise = [load(trained / f"{who}.engine_{rule}.noise.npz")[0] for who in ("worker0", "worker1", "single")]
    for a, b, c in zip(*noise):
        assert np.array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-12)
    # The teeth: noise matching moved z well beyond the tolerance, from where Adam alone took it.
    plain, _ = load(trained / "single.engine_sma_adam.npz")
    plain_learners, _ = load(trained / "single.engine_sma_adam.learners.npz")
    assert largest_difference(z0[:4], plain[:4]) > 1e-3
    assert largest_difference(learners, plain_learners) > 1e-3


def test_adam_learners_with_noise_matching_resume_on_two_workers_where_the_run_goes_on(trained):
    """Fresh engines (a resumed cluster's) restored from the chief's checkpoint of iteration 3: the
    running means reach both workers, and z and every learner end as without the stop, bit for bit."""
    rule = "engine_sma_adam_nm"
    saved, _ = load(trained / f"worker0.{rule}.stopped.noise.npz")
    assert min(float(np.max(a)) for a in saved) > 0
    for name in ("worker0", "worker1"):
        restored, _ = load(trained / f"{name}.{rule}.restored.noise.npz")
        assert all(a.tobytes() == b.tobytes() for a, b in zip(restored, saved)), name
        for part in ("", ".learners"):
            resumed, _ = load(trained / f"{name}.{rule}.resumed{part}.npz")
            reference, _ = load(trained / f"{name}.{rule}{part}.npz")
            assert len(resumed) == len(reference) and len(resumed) >= 5
            assert all(a.tobytes() == b.tobytes() for a, b in zip(resumed, reference)), name + part


@pytest.mark.parametrize("rule", ["sma_f16", "sma_adam_f16"])
def test_mixed_float16_on_two_workers_skips_one_workers_overflow_everywhere(trained, rule):
    """Only a learner of the second worker overflows in iteration 1; its flag travels in the
    iteration's one all-reduce, so the first worker skips the iteration too (its scale halves
    though its own gradients were finite), and z and every learner end as in one process."""
    ((z0, losses0), (z1, losses1), (single, _)), learners, single_learners = \
        cluster_and_single(trained, f"engine_{rule}")
    for name in ("worker0", "worker1", "single"):
        with np.load(trained / f"{name}.engine_{rule}.npz") as f:
            assert int(f["collectives"]) == (0 if name == "single" else 1)
        scale, _ = load(trained / f"{name}.engine_{rule}.scale.npz")
        # 2**15 halved by iteration 1's overflow, then 3 good iterations.
        assert [float(scale[0]), int(scale[1])] == [2.0 ** 14, 3], name
    assert len(z0) == len(z1) == len(single) == 5
    for a, b in zip(z0, z1, strict=True):
        assert np.array_equal(a, b)
    for a, c in zip(z0, single, strict=True):
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-4)
    assert len(learners) == len(single_learners) == 8 * 4   # 8 learners x small_cnn's 4 weights
    for a, c in zip(learners, single_learners, strict=True):
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(losses0, losses1)
    initial, _ = load(trained / f"single.engine_{rule}.initial.npz")
    assert largest_difference(single[:4], initial) > 1e-3


def run_args(*extra):
    return ["-m", "crossbow_tf.run", "--worker-timeout", str(TIMEOUT), *extra]


def small_config(path, n_train=640, **overrides):
    """The default experiment's settings, but the worker script's small CNN on N_TRAIN real digits
    (160 to test), 2 devices, learners of 8: what the cluster tests check (who writes, who prints,
    how a lost worker is reported, stops, resumes and roll-backs) does not depend on the model's
    width or the data's size, and every process of them pays for its model's tracing and compiling."""
    from test_checkpoint import tiny_mnist
    data_dir = tiny_mnist(path.parent / f"{path.stem}-mnist", n_train=n_train)
    settings = dict(name="multiworker-small", model=f"{WORKER_SCRIPT}:small_cnn",
                    data={"name": "mnist", "data_dir": data_dir}, devices={"logical_cpu": 2},
                    learners_per_device=2, batch_size=8, learning_rate={"base": 0.02}, epochs=1, seed=0)
    settings.update(overrides)
    path.write_text(json.dumps(settings))   # JSON is YAML
    return str(path)


def test_command_line_on_two_workers_only_the_chief_writes(tmp_path):
    # The tuner tries m = 1 and 2 only (each m is one more model traced and compiled per worker):
    # enough for each worker to measure and for both to agree on one m.
    config = small_config(tmp_path / "run.yaml", learners_per_device="auto",
                          autotune={"max_learners_per_device": 2, "measure_iterations": 3})
    configs, _ = cluster_configs(2)
    dirs = [tmp_path / "w0", tmp_path / "w1"]
    procs = []
    for i, d in enumerate(dirs):
        d.mkdir()
        procs.append(start(run_args("--config", config, "--epochs", "1", "--results", "run.json"), configs[i], cwd=d))
    (code0, out0, err0), (code1, out1, err1) = [finish(p, timeout=240) for p in procs]
    assert code0 == 0 and code1 == 0, err0[-2000:] + err1[-2000:]
    # learners_per_device: auto is measured on each worker, then the smallest m is used by both.
    agreed = [line for line in out0.splitlines() if line.startswith("learners per device agreed")]
    assert len(agreed) == 1
    results = json.loads((dirs[0] / "run.json").read_text())
    assert not (dirs[1] / "run.json").exists()
    m = results["autotune"]["chosen"]
    assert f"m={m}" in agreed[0]
    assert results["num_learners"] == 2 * 2 * m and results["workers"] == 2
    assert f"k={4 * m} learners (2 workers x 2 device(s) x {m})" in out0
    # The other worker prints nothing on stdout; its lines go to stderr with its prefix.
    assert out1 == ""
    # Each worker says once what its server exposes (issue 52): on loopback it still binds every interface.
    for i, err in enumerate((err0, err1)):
        exposed = [line for line in err.splitlines() if "TensorFlow's server listens on port" in line]
        assert len(exposed) == 1, err[-2000:]
        port = json.loads(configs[i])["cluster"]["worker"][i].rsplit(":", 1)[1]
        assert f"listens on port {port} of every interface of this machine and accepts unauthenticated" in exposed[0]
        assert "its cluster is on this machine only, but the server binds every interface" in exposed[0]
    assert f"[worker 1] learners per device agreed by the 2 workers: m={m}" in err1
    epoch_lines = [line for line in err1.splitlines() if line.startswith("[worker 1] epoch   1/1")]
    assert len(epoch_lines) == 1
    # Evaluated once, on the chief: the other worker reports the chief's figures.
    accuracy = f"test accuracy {results['evaluations'][0]['accuracy']:.4f}"
    assert accuracy in epoch_lines[0] and accuracy in out0


def wait_for_line(proc, stream_name, text, timeout):
    """Reads PROC's stream until a line containing TEXT; returns the lines read."""
    stream = getattr(proc, stream_name)
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    pytest.fail(f"no line with {text!r} within {timeout} s: {''.join(lines)[-2000:]}")


@pytest.mark.parametrize("failure", ["dies", "hangs"])
def test_a_lost_worker_stops_the_other_with_one_clear_error(failure, tmp_path):
    configs, ports = cluster_configs(2)
    args = run_args("--config", small_config(tmp_path / "run.yaml"), "--epochs", "50", "--learners-per-device", "2")
    chief = start(args, configs[0])
    worker = start(args, configs[1], python=forking.PYTHON if failure == "dies" else sys.executable)
    try:
        wait_for_line(chief, "stdout", "epoch   1/50", timeout=START_UP + 120)
        if failure == "dies":
            # (SIGTERM is a clean stop of the whole cluster: see the checkpoint tests below.)
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=10)
        else:
            worker.send_signal(signal.SIGSTOP)
        code, _, err = finish(chief, timeout=TIMEOUT + 30)
    finally:
        worker.kill()
        worker.communicate()
    errors = [line for line in err.splitlines() if line.startswith("crossbow_tf: error:")]
    assert code == 4, err[-2000:]
    assert len(errors) == 1, err[-2000:]
    reason = "does not answer (not running)" if failure == "dies" else "does not respond"
    assert f"lost worker 1 (worker:1 at 127.0.0.1:{ports[1]}) {reason}" in errors[0]
    assert "Traceback" not in err
    # The message names the mechanism that found the loss (the probe after the all-reduce's timeout);
    # finish's deadline, TIMEOUT + 30 s after the loss, bounds it without timing a loaded machine.


def test_a_worker_that_never_starts_stops_the_other(tmp_path):
    configs, ports = cluster_configs(2)
    chief = start(run_args("--epochs", "1", "--learners-per-device", "2", "--results", "run.json"),
                  configs[0], cwd=tmp_path)
    # finish's deadline bounds the wait; the message says the start-up timeout is what stopped it.
    code, out, err = finish(chief, timeout=START_UP + TIMEOUT + 30)
    assert code == 4
    assert f"crossbow_tf: error: worker 1 (worker:1 at 127.0.0.1:{ports[1]}) did not start within {TIMEOUT} s" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run.json").exists()


# ------------------------------------------------------------------ the cluster spec, without servers
def test_cluster_from_tf_config(monkeypatch):
    from crossbow_tf.distribute import cluster as cluster_lib
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cluster_lib.from_environment() is None
    configs = local_tf_configs(3)
    monkeypatch.setenv("TF_CONFIG", configs[2])
    cluster = cluster_lib.from_environment(timeout=5)
    assert (cluster.num_workers, cluster.worker_index, cluster.is_chief, cluster.timeout) == (3, 2, False, 5.0)
    assert cluster.task_name(1) == "/job:worker/replica:0/task:1"
    address = json.loads(configs[0])["cluster"]["worker"][0]
    assert cluster.describe(0) == f"worker 0 (worker:0 at {address})"
    # A chief task comes first: it is worker 0, the "worker" tasks follow.
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]},
                                                "task": {"type": "worker", "index": 0}}))
    cluster = cluster_lib.from_environment()
    assert (cluster.num_workers, cluster.worker_index, cluster.describe(0)) == (3, 1, "worker 0 (chief:0 at h0:1)")
    # One worker is no cluster: nothing to reduce across.
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["h0:1"]}, "task": {"type": "worker", "index": 0}}))
    assert cluster_lib.from_environment() is None


@pytest.mark.parametrize("text, message", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    (json.dumps({"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 2}}),
     "task worker:2 is not a chief or worker task"),
    (json.dumps({"cluster": {"worker": ["h0:1", "h1:1"]}}), "names no task for this process"),
])
def test_bad_tf_config_is_one_clear_line(monkeypatch, text, message):
    from crossbow_tf.distribute import cluster as cluster_lib
    from crossbow_tf.errors import CrossbowError
    monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(CrossbowError, match=message):
        cluster_lib.from_environment()


def test_worker_timeout_must_be_positive(monkeypatch):
    from crossbow_tf.distribute import cluster as cluster_lib
    from crossbow_tf.errors import CrossbowError
    monkeypatch.setenv("TF_CONFIG", local_tf_configs(2)[0])
    with pytest.raises(CrossbowError, match="worker timeout must be a positive number of seconds, got 0"):
        cluster_lib.from_environment(timeout=0)


# ------------------------------------------------------------------------ checkpoints and resume
def checkpointed_config(path, epochs=3):
    """small_config on 1,280 digits, 2 devices x 2 learners of 8 per worker: 20 iterations per epoch
    on 2 workers; a checkpoint every 6 iterations and at every epoch's end."""
    return small_config(path, n_train=1280, name="multiworker-checkpoints", epochs=epochs, seed=4,
                        checkpoint={"every_iterations": 6})


def start_cluster(config, ckpt, workdirs, *extra):
    """Starts both workers of a fresh 2-worker cluster (worker i in WORKDIRS[i])."""
    configs, _ = cluster_configs(2)
    args = run_args("--config", config, "--checkpoint-dir", ckpt, "--results", "run.json", *extra)
    return [start(args, configs[i], cwd=workdirs[i]) for i in range(2)]


def finish_cluster(procs, signal_worker=None, after=None):
    """Runs the workers PROCS to the end; with SIGNAL_WORKER, sends it SIGTERM once the chief has
    printed AFTER. Returns [(code, out, err)]."""
    try:
        lines = []
        if signal_worker is not None:
            lines = wait_for_line(procs[0], "stdout", after, timeout=START_UP + 120)
            procs[signal_worker].send_signal(signal.SIGTERM)
        # Generous: these runs train for minutes on a busy 2-core machine; the bound is for a hang.
        outcomes = [finish(p, timeout=START_UP + 600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(code, ("".join(lines) if i == 0 else "") + out, err) for i, (code, out, err) in enumerate(outcomes)]


def run_cluster(config, ckpt, workdirs, *extra, signal_worker=None, after=None):
    """Runs both workers of a fresh 2-worker cluster (worker i in WORKDIRS[i]) to the end; with
    SIGNAL_WORKER, sends it SIGTERM once the chief has printed AFTER. Returns [(code, out, err)]."""
    return finish_cluster(start_cluster(config, ckpt, workdirs, *extra), signal_worker, after)


def checkpoint_tensors(directory):
    """Every tensor of the newest checkpoint in DIRECTORY but its record."""
    import tensorflow as tf
    from crossbow_tf.engine.checkpoint import checkpoint_paths
    reader = tf.train.load_checkpoint(checkpoint_paths(directory)[0])
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if "/.ATTRIBUTES/" in k and not k.startswith(("record/", "save_counter/"))}


def test_sigterm_to_one_worker_stops_the_cluster_with_the_chiefs_checkpoint_and_resume_is_bit_identical(tmp_path):
    config = checkpointed_config(tmp_path / "run.yaml")
    dirs = {name: [tmp_path / name / "w0", tmp_path / name / "w1"] for name in ("reference", "stopped")}
    for d in dirs["reference"] + dirs["stopped"]:
        d.mkdir(parents=True)
    # Uninterrupted: a cluster of its own, beside the one that is stopped (the result does not depend
    # on timing).
    reference = start_cluster(config, "ckpt", dirs["reference"])
    # SIGTERM to worker 1 (not the chief) during epoch 2: both stop after the same iteration, the
    # chief writes a checkpoint holding both workers' learners, and both say how to continue.
    (code0, out0, err0), (code1, _, err1) = run_cluster(config, "ckpt", dirs["stopped"], signal_worker=1,
                                                        after="epoch   1/3")
    for code, _, err in finish_cluster(reference):
        assert code == 0, err[-3000:]
    assert (code0, code1) == (143, 143), err0[-2000:] + err1[-2000:]
    stopped0 = [line for line in err0.splitlines() if line.startswith("crossbow_tf: stopped")]
    stopped1 = [line for line in err1.splitlines() if line.startswith("crossbow_tf: stopped")]
    assert len(stopped0) == len(stopped1) == 1, err0[-2000:] + err1[-2000:]
    # (Normally mid-epoch 2; at its end when the machine is so busy that epoch 2 is over first.)
    iteration = re.search(r"at iteration (\d+) \(epoch [23]\)", stopped0[0])
    assert iteration and iteration.group(0) in stopped1[0], stopped0[0] + stopped1[0]
    assert "stopped by a stop signal to another worker" in stopped0[0] and "/ckpt-" in stopped0[0]
    assert "stopped by SIGTERM" in stopped1[0] and "the chief's checkpoint" in stopped1[0]
    assert "--resume" in stopped0[0] and "--resume" in stopped1[0]
    assert list(dirs["stopped"][1].iterdir()) == []   # worker 1 wrote nothing
    checkpoint = checkpoint_tensors(dirs["stopped"][0] / "ckpt")
    # 2 workers x 2 devices: four devices' learners (stacks of 2), one z per device of the chief.
    assert {k.split("/")[1] for k in checkpoint if k.startswith("weights/")} == {"0", "1", "2", "3"}
    assert {k.split("/")[1] for k in checkpoint if k.startswith("center/")} == {"0", "1"}
    halted = checkpoint
    # Restarted without --resume: the chief refuses, and both workers stop with its message.
    for code, _, err in run_cluster(config, "ckpt", dirs["stopped"]):
        assert code == 2 and "holds checkpoints of a run" in err and "pass --resume" in err, err[-2000:]
    # Worker 1's learners were gathered to the chief: they differ from worker 0's.
    assert not np.array_equal(halted["weights/0/0/.ATTRIBUTES/VARIABLE_VALUE"],
                              halted["weights/2/0/.ATTRIBUTES/VARIABLE_VALUE"])
    # One process cannot continue a cluster's checkpoint.
    single = start(["-m", "crossbow_tf.run", "--config", config, "--checkpoint-dir", "ckpt", "--resume"],
                   cwd=dirs["stopped"][0])
    code, _, err = finish(single, timeout=120)
    assert code == 2 and "written by a run on 2 worker(s), this one has 1" in err, err[-2000:]
    # Resumed on a fresh cluster: the same final state, bit for bit, and the same results.
    outcomes = run_cluster(config, "ckpt", dirs["stopped"], "--resume")
    for code, _, err in outcomes:
        assert code == 0, err[-3000:]
    assert f"resuming from" in outcomes[0][1] and f"iteration {iteration.group(1)}" in outcomes[0][1]
    assert f"[worker 1] resuming from" in outcomes[1][2]
    final, reference = checkpoint_tensors(dirs["stopped"][0] / "ckpt"), checkpoint_tensors(dirs["reference"][0] / "ckpt")
    assert sorted(final) == sorted(reference)
    for key in final:
        assert final[key].tobytes() == reference[key].tobytes(), f"{key} differs"
    ours = json.loads((dirs["stopped"][0] / "run.json").read_text())["evaluations"]
    theirs = json.loads((dirs["reference"][0] / "run.json").read_text())["evaluations"]
    assert [(e["accuracy"], e["loss"]) for e in ours] == [(e["accuracy"], e["loss"]) for e in theirs]
    assert len(ours) == 3


def test_divergence_rolls_back_every_worker_alike_from_the_chiefs_checkpoint(tmp_path):
    # At 1e30 halving three times is not enough: every worker rolls back three times (each time the
    # chief reads its checkpoint and sends it to the other), then both stop with exit 3. (At 1e6 the
    # small CNN's ReLUs die and its loss stays finite; LeNet's did not.)
    config = tmp_path / "run.yaml"
    settings = json.loads(open(checkpointed_config(config)).read())
    settings["learning_rate"]["base"] = 1e30
    config.write_text(json.dumps(settings))
    dirs = [tmp_path / "w0", tmp_path / "w1"]
    for d in dirs:
        d.mkdir()
    (code0, out0, err0), (code1, _, err1) = run_cluster(str(config), "ckpt", dirs, "--on-divergence", "rollback")
    assert (code0, code1) == (3, 3), err0[-2000:] + err1[-2000:]
    scales0 = re.findall(r"learning rate scaled by (\S+) \(roll-back", out0)
    scales1 = re.findall(r"\[worker 1\] .*learning rate scaled by (\S+) \(roll-back", err1)
    assert scales0 == scales1 == ["0.5", "0.25", "0.125"], out0[-2000:] + err1[-2000:]
    for err in (err0, err1):
        assert "diverged after 3 roll-back(s): not finite at iteration" in err and "Traceback" not in err
    assert list(dirs[1].iterdir()) == [] and (dirs[0] / "ckpt").is_dir()
