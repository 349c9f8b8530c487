"""Checkpoints, resume, signals and divergence of `python -m crossbow_tf.run` (and of the trainer).

The kill tests start real training processes, SIGKILL them at seeded random moments, resume each
one, and compare the final state bit for bit with an uninterrupted run of the same seed.
"""
import json
import os
import queue
import random
import re
import signal
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from crossbow_tf.algorithms import SMA
from crossbow_tf.data.mnist import load_idx_pair
from crossbow_tf.data.source import from_arrays
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.checkpoint import Checkpoints, checkpoint_paths, read_record
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.schedule import StepSchedule
from crossbow_tf.engine.trainer import train
from crossbow_tf.engine.signals import StopSignals
from crossbow_tf.errors import TrainingDiverged, TrainingInterrupted
from crossbow_tf.results import RunResults
from crossbow_tf.run import main, parse_args
from crossbow_tf.run import run as run_command
from forking import ForkedProcess
from test_data_formats import write_mnist

TESTS = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(TESTS, "bn_dropout_run.py")   # crossbow_tf.run with a BatchNorm + Dropout model
EMBEDDED = os.path.join(os.path.dirname(TESTS), "crossbow_tf", "data", "embedded")
HEADER = "iterations per epoch"   # the run's description line, printed just before training starts


# --- helpers ---------------------------------------------------------------------------------------

class Process:
    """A training process whose combined output is read line by line as it comes."""

    def __init__(self, args):
        self.proc = ForkedProcess(args)
        self.lines, self._queue = [], queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text, timeout=300):
        """Reads until a line containing TEXT (True) or the end of the output (False)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                self._queue.put(None)
                return False
            self.lines.append(line)
            if text in line:
                return True
        raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output}")

    def finish(self, timeout=300):
        self.wait_for("\0never\0", timeout)
        return self.proc.wait(timeout)

    @property
    def output(self):
        return "".join(self.lines)


def tiny_mnist(directory, n_train=640, n_test=160):
    """Real digits from the embedded set as IDX files: 640 to train on, 160 to test."""
    images, labels = load_idx_pair(os.path.join(EMBEDDED, "mnist5k-images-idx3-ubyte.gz"),
                                   os.path.join(EMBEDDED, "mnist5k-labels-idx1-ubyte.gz"))
    write_mnist(str(directory), (images[:n_train], labels[:n_train]),
                (images[n_train:n_train + n_test], labels[n_train:n_train + n_test]))
    return str(directory)


def write_config(path, **settings):
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return str(path)


def tiny_config(tmp_path, name="run.yaml", **overrides):
    """A config of the bn_dropout model on tiny MNIST: 2 devices x 2 learners of 8, 20 iterations per
    epoch, a step drop of the learning rate at epoch 2 (learners restart from z there)."""
    settings = dict(name="tiny", model=f"{DRIVER}:bn_dropout", data={"name": "mnist", "data_dir": tiny_mnist(tmp_path / "mnist")},
                    devices={"logical_cpu": 2}, learners_per_device=2, batch_size=8,
                    learning_rate={"base": 0.05, "drops_at_epochs": [2]}, epochs=3, seed=3)
    settings.update(overrides)
    return write_config(tmp_path / name, **settings)


def final_state(directory):
    """Every tensor of the newest checkpoint in DIRECTORY but its record: z, u, learners, states."""
    reader = tf.train.load_checkpoint(checkpoint_paths(directory)[0])
    keys = [k for k in reader.get_variable_to_shape_map() if "/.ATTRIBUTES/" in k
            and not k.startswith(("record/", "save_counter/"))]
    return {k: reader.get_tensor(k) for k in keys}


def assert_bit_identical(directory, reference):
    ours, theirs = final_state(directory), final_state(reference)
    assert sorted(ours) == sorted(theirs) and any(k.startswith("center/") for k in ours)
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
        assert ours[key].tobytes() == theirs[key].tobytes(), f"{key} differs"


def newest_checkpoint(directory):
    """The number of the newest checkpoint whose files are complete in DIRECTORY (0 for none yet).
    (TensorFlow writes a checkpoint's .index last, then names it in the directory's index file.)"""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return max([int(m.group(1)) for m in map(re.compile(r"ckpt-(\d+)\.index$").match, names) if m], default=0)


def kill_and_resume(args, directory, kills, rng, most=4, jitter=0.3, timeout=300):
    """Runs ARGS (which include --resume and --checkpoint-dir DIRECTORY) to the end, SIGKILLing it
    KILLS times and resuming. Each kill lands at a seeded (RNG) random point: once the process has
    written 1 to MOST new checkpoints (the first kill: past the run's second, so that a resume never
    starts from the checkpoint at iteration 0), then a random 0 to JITTER seconds later, so anywhere
    in an iteration or in writing the next checkpoint, however busy the machine. Returns the processes."""
    processes = []
    for attempt in range(kills + 1):
        p = Process(args)
        processes.append(p)
        if attempt < kills:
            target = max(newest_checkpoint(directory), 2) + rng.randint(1, most)
            deadline = time.time() + timeout
            while newest_checkpoint(directory) < target:
                assert time.time() < deadline and p.proc.poll() is None, p.output
                time.sleep(0.02)
            time.sleep(rng.uniform(0, jitter))
            p.proc.send_signal(signal.SIGKILL)
        p.finish()
    return processes


def wait_for_checkpoint(p, path, timeout=300):
    """Returns once P has written checkpoint PATH."""
    assert p.wait_for(HEADER)
    deadline = time.time() + timeout
    while not os.path.exists(f"{path}.index"):
        assert time.time() < deadline and p.proc.poll() is None, p.output
        time.sleep(0.02)


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


# --- SIGKILL at random points: the final state is bit-identical ------------------------------------

def test_sigkill_at_random_points_then_resume_is_bit_identical_with_batchnorm_and_dropout(tmp_path):
    config = tiny_config(tmp_path, checkpoint={"every_iterations": 3})
    # The uninterrupted reference runs beside the killed ones (the result does not depend on timing).
    reference = Process([DRIVER, "--config", config, "--checkpoint-dir", str(tmp_path / "reference"),
                         "--results", str(tmp_path / "reference.json")])
    # Two kills: one in the first process, one in a resumed process (which must checkpoint what it
    # resumed from); each lands at a seeded random point, in an iteration or a checkpoint's writing.
    killed = kill_and_resume([DRIVER, "--config", config, "--checkpoint-dir", str(tmp_path / "killed"),
                              "--resume", "--results", str(tmp_path / "killed.json"), "--force"],
                             tmp_path / "killed", kills=2, rng=random.Random(11))
    assert reference.finish() == 0, reference.output
    codes = [p.proc.returncode for p in killed]
    assert codes == [-signal.SIGKILL] * 2 + [0], (codes, killed[-1].output)   # every kill landed mid-run
    resumed = [[int(m) for m in re.findall(r"resuming from \S+: iteration (\d+)", p.output)] for p in killed[1:]]
    assert all(len(r) == 1 and r[0] > 0 for r in resumed), [p.output for p in killed]
    assert_bit_identical(tmp_path / "killed", tmp_path / "reference")
    ours, theirs = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("killed", "reference"))
    keys = ("epoch", "iteration", "examples", "accuracy", "loss", "train_loss")
    assert [[e[k] for k in keys] for e in ours["evaluations"]] == [[e[k] for k in keys] for e in theirs["evaluations"]]
    assert len(ours["evaluations"]) == 3 and ours["resumed_at_iterations"]


def test_sigkill_then_resume_of_the_auto_tuned_default_is_bit_identical_and_does_not_retune(tmp_path):
    config = tmp_path / "default.yaml"
    from crossbow_tf.run import DEFAULT_CONFIG
    settings = yaml.safe_load(open(DEFAULT_CONFIG))
    # The subject is that the tuner's choice comes back from the checkpoint, not which m it picks: two
    # candidates (m = 1, 2) on 3 timed iterations each make a real, measured choice at half the cost
    # of the default's up to 16 (m = 1..4 here, with 10 iterations each).
    settings.update(epochs=1, stop_at_target=False, checkpoint={"every_iterations": 4},
                    autotune={"max_learners_per_device": 2, "measure_iterations": 3})
    write_config(config, **settings)
    killed = kill_and_resume(["-m", "crossbow_tf.run", "--config", str(config), "--checkpoint-dir",
                              str(tmp_path / "killed"), "--resume", "--results", str(tmp_path / "killed.json"), "--force"],
                             tmp_path / "killed", kills=2, rng=random.Random(5), most=2)
    assert [p.proc.returncode for p in killed] == [-signal.SIGKILL] * 2 + [0], killed[-1].output
    assert "auto-tuned learners per device" in killed[0].output
    for p in killed[1:]:   # the tuner's choice comes from the checkpoint
        assert "auto-tuning" not in p.output and "auto-tuned m kept" in p.output, p.output
    results = json.loads((tmp_path / "killed.json").read_text())
    chosen = results["autotune"]["chosen"]
    assert results["num_learners"] == 2 * chosen and results["autotune"]["curve"]["1"] > 0

    # Tuning is seeded around: the run is the one a fixed m = chosen gives.
    reference = Process(["-m", "crossbow_tf.run", "--config", str(config), "--learners-per-device", str(chosen),
                         "--checkpoint-dir", str(tmp_path / "reference")])
    assert reference.finish() == 0, reference.output
    assert_bit_identical(tmp_path / "killed", tmp_path / "reference")


# --- SIGTERM and SIGINT --------------------------------------------------------------------------

def test_sigterm_mid_epoch_writes_a_checkpoint_says_how_to_resume_and_exits_143(tmp_path, capsys):
    config = tiny_config(tmp_path, checkpoint={"every_iterations": 5})
    checkpoints = tmp_path / "checkpoints"
    p = Process([DRIVER, "--config", config, "--checkpoint-dir", str(checkpoints)])
    wait_for_checkpoint(p, checkpoints / "ckpt-2")               # at iteration 5 (ckpt-1: the start)
    p.proc.send_signal(signal.SIGTERM)
    assert p.finish() == 143, p.output
    m = re.search(r"stopped by SIGTERM at iteration (\d+) \(epoch 1\); checkpoint (\S+); "
                  r"to continue: (.*)$", p.output, re.M)
    assert m, p.output
    iteration, path, command = int(m.group(1)), m.group(2), m.group(3)
    assert 5 <= iteration < 20                                  # mid-epoch (20 iterations per epoch)
    assert path == checkpoint_paths(str(checkpoints))[0]
    progress = read_record(path)["progress"]
    assert (progress["iteration"], progress["position"], progress["epoch"]) == (iteration, iteration, 0)
    assert command.endswith("--resume") and str(checkpoints) in command
    assert "Traceback" not in p.output

    # Resuming without --resume, or with a setting that changes the trajectory, is refused (before
    # the devices are set up, so this process can check it).
    assert main(["--config", config, "--checkpoint-dir", str(checkpoints)]) == 2
    assert "pass --resume to continue it" in capsys.readouterr().err
    changed = tiny_config(tmp_path, name="changed.yaml", batch_size=4, seed=4)
    assert main(["--config", changed, "--checkpoint-dir", str(checkpoints), "--resume"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "different configuration" in error
    assert "batch_size (8 in the checkpoint, 4 now)" in error and "seed (3 in the checkpoint, 4 now)" in error
    assert checkpoint_paths(str(checkpoints))[0] == path          # nothing written


def test_second_sigint_exits_at_once_without_a_traceback(tmp_path):
    p = Process([DRIVER, "--config", tiny_config(tmp_path), "--checkpoint-dir", str(tmp_path / "c")])
    wait_for_checkpoint(p, tmp_path / "c" / "ckpt-1")            # training starts after this one
    p.proc.send_signal(signal.SIGINT)
    assert p.wait_for("SIGINT received: stopping at the end of this iteration")
    p.proc.send_signal(signal.SIGINT)
    assert p.finish() == 130
    assert "interrupted again: exiting now" in p.output and "Traceback" not in p.output


# --- divergence ------------------------------------------------------------------------------------

def test_huge_learning_rate_stops_with_exit_3_valid_results_and_an_intact_checkpoint(tmp_path):
    config = tiny_config(tmp_path, model="lenet", learning_rate={"base": 1000000.0})
    results = tmp_path / "results.json"
    checkpoints = tmp_path / "checkpoints"
    p = Process(["-m", "crossbow_tf.run", "--config", config, "--checkpoint-dir", str(checkpoints),
                 "--results", str(results)])
    assert p.finish() == 3, p.output
    m = re.search(r"crossbow_tf: diverged: not finite at iteration (\d+) \(epoch 1, iteration \d+ of 20\): "
                  r"the loss(, z)?(, learners? [0-9, -]+)?; last good checkpoint (?P<good>\S+)$", p.output, re.M)
    assert m and "Traceback" not in p.output, p.output
    saved = strict_json(results.read_text())                     # no bare NaN anywhere
    assert saved["diverged"]["iteration"] == int(m.group(1)) and saved["diverged"]["non_finite"][0] == "the loss"
    good = m.group("good")
    assert good == checkpoint_paths(str(checkpoints))[0]
    record = read_record(good)
    assert record["progress"]["iteration"] < int(m.group(1))
    assert all(np.isfinite(v).all() for k, v in final_state(str(checkpoints)).items() if v.dtype.kind == "f")

def test_rollback_halves_the_learning_rate_at_most_max_rollbacks_times_then_stops(tmp_path, capsys):
    # At 1e6 halving three times is not enough, so it stops as without roll-backs. (In this process:
    # the test session's 4 devices, one learner each.)
    config = tiny_config(tmp_path, model="lenet", learning_rate={"base": 1000000.0}, devices={"logical_cpu": 4},
                         learners_per_device=1)
    assert main(["--config", config, "--checkpoint-dir", str(tmp_path / "c"), "--on-divergence", "rollback"]) == 3
    captured = capsys.readouterr()
    scales = [float(s) for s in re.findall(r"learning rate scaled by (\S+) \(roll-back", captured.out)]
    assert scales == [0.5, 0.25, 0.125]
    assert "diverged after 3 roll-back(s): not finite at iteration" in captured.err


def _engine(devices, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(3)])
    return Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), SMA(),
                  CrossbowStrategy(devices=devices, learners_per_device=2))


def _problem(seed=0, n=320):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 3))
    x = rng.normal(size=(n, 8)).astype("float32")
    y = np.argmax(x @ w, axis=1).astype("int32")
    return from_arrays("linear", (x[:256], y[:256]), (x[256:], y[256:]), 3)


class _PoisonOnce:
    """Engine.train_step that, on call AT, first sets learner 1's first weight to NaN (a transient fault)."""

    def __init__(self, engine, at):
        self.engine, self.at, self.calls, self.step = engine, at, 0, engine.train_step

    def __call__(self, x, y, mask, lr, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            w = self.engine.weights[0][0]
            poisoned = w.numpy()
            poisoned[1, 0, 0] = np.nan
            w.assign(poisoned)
        return self.step(x, y, mask, lr, **kwargs)


@pytest.mark.parametrize("action", ["stop", "rollback"])
def test_non_finite_learner_is_named_and_rollback_recovers(cpu_devices, tmp_path, action):
    engine = _engine(cpu_devices[:2])
    engine.train_step = _PoisonOnce(engine, at=13)           # iteration 13 = epoch 2, iteration 5 of 8
    checkpoints = Checkpoints(str(tmp_path / "c"), engine, every_iterations=4)
    results = RunResults("sma", {}, env={})
    data = _problem()
    kwargs = dict(seed=0, log=lambda line: None, checkpoints=checkpoints, on_divergence=action)
    if action == "stop":
        with pytest.raises(TrainingDiverged, match=r"not finite at iteration 13 \(epoch 2, iteration 5 of 8\): "
                                                   r"the loss, z, learner 1; last good checkpoint .*ckpt-\d+$"):
            train(engine, data, 8, 4, StepSchedule(0.1), results, **kwargs)
        assert results.extra["diverged"] == dict(iteration=13, epoch=2, non_finite=["the loss", "z", "learner 1"])
        assert len(results.evaluations) == 1                     # the epoch finished before stays recorded
        assert read_record(checkpoints.last_saved)["progress"]["iteration"] == 12
        return
    train(engine, data, 8, 4, StepSchedule(0.1), results, **kwargs)
    assert results.extra["rollbacks"] == 1 and results.extra["lr_scale"] == 0.5
    assert [e["epoch"] for e in results.evaluations] == [1, 2, 3, 4]
    assert all(np.isfinite(w).all() for w in engine.center_weights())
    assert results.evaluations[-1]["accuracy"] > 0.7               # 3 classes: chance is 1/3


# --- configuration and the Keras path --------------------------------------------------------------

def test_sigint_at_an_epoch_end_then_resume_with_more_epochs(tmp_path, capsys):
    """SIGINT stops at the next boundary (exit code 130). More epochs are not part of the trajectory:
    resuming with them continues. (In this process: the test session's 4 devices.)"""
    config = tiny_config(tmp_path, devices={"logical_cpu": 4}, learners_per_device=1, epochs=2)
    checkpoints = str(tmp_path / "c")

    def log(line):
        if line.startswith("epoch   1/2"):
            os.kill(os.getpid(), signal.SIGINT)
    with StopSignals() as stop, pytest.raises(TrainingInterrupted) as stopped:
        run_command(parse_args(["--config", config, "--checkpoint-dir", checkpoints]), log=log, stop_signals=stop)
    assert (stopped.value.exit_code, stopped.value.iteration, stopped.value.epoch) == (130, 20, 2)
    assert stopped.value.checkpoint == checkpoint_paths(checkpoints)[0]
    assert "SIGINT received" in capsys.readouterr().err
    assert main(["--config", config, "--checkpoint-dir", checkpoints, "--epochs", "3", "--resume",
                 "--results", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "epoch   2/3" in out and "epoch   1/3" not in out
    assert [e["epoch"] for e in json.loads((tmp_path / "r.json").read_text())["evaluations"]] == [1, 2, 3]


def test_resume_needs_a_checkpoint_directory(capsys):
    assert main(["--resume"]) == 2
    assert "--resume: needs a checkpoint directory" in capsys.readouterr().err


def test_damaged_keras_backup_or_sidecar_is_one_clear_error(cpu_devices, tmp_path):
    from crossbow_tf.errors import CheckpointError
    from test_keras_callbacks import _Interrupt, _problem as keras_problem, _sma_model
    (x, y), _ = keras_problem()
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _sma_model(cpu_devices).fit(x, y, batch_size=8, epochs=3, verbose=0,
                                    callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt(2)])
    assert sorted(os.listdir(backup)) == ["latest.weights.h5", "latest.weights.h5.crossbow.npz",
                                          "training_metadata.json"]   # no temporary file left behind
    sidecar = os.path.join(backup, "latest.weights.h5.crossbow.npz")
    data = open(sidecar, "rb").read()
    for damaged in (os.path.join(backup, "latest.weights.h5"), sidecar):
        original = open(damaged, "rb").read()
        with open(damaged, "wb") as f:
            f.write(original[:len(original) // 2])              # a half-written file
        with pytest.raises(CheckpointError, match=re.escape(damaged) + ": damaged") as e:
            _sma_model(cpu_devices).fit(x, y, batch_size=8, epochs=3, verbose=0,
                                        callbacks=[keras.callbacks.BackupAndRestore(backup)])
        assert "\n" not in str(e.value)
        with open(damaged, "wb") as f:
            f.write(original)
    assert open(sidecar, "rb").read() == data


# --- tools/compare.py and tools/sweep.py: an unfinished run continues from its checkpoints ----------

FAKE_RUN = '''#!{python}
"""Stands in for `python -m crossbow_tf.run ...`: logs whether it was given a checkpoint directory that
already holds a checkpoint; "stopped" leaves one there and exits 143 as a SIGTERM would."""
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_CALLS"], "a") as f:
    found = "--checkpoint-dir" in args and os.path.exists(os.path.join(args[args.index("--checkpoint-dir") + 1], "ckpt"))
    f.write(json.dumps(dict(args=args, found=found)) + "\\n")
if os.environ["FAKE_MODE"] == "stopped":
    directory = args[args.index("--checkpoint-dir") + 1]
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, "ckpt"), "w").close()
    sys.exit(143)
evals = [dict(epoch=1, iteration=10, examples=4000, wall_time=2.5, accuracy=0.97, loss=0.1)]
json.dump(dict(method="sma", config={{}}, environment={{}}, evaluations=evals, num_learners=1),
          open(args[args.index("--results") + 1], "w"))
'''


def test_resumed_comparison_continues_a_run_checkpointed_mid_way(tmp_path, monkeypatch):
    import crossbow_tf.compare as harness
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_RUN.format(python=sys.executable))
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    out = tmp_path / "report"
    harness.prepare_out_dir(str(out))
    checkpoints = out / "runs" / "sma" / "a.checkpoints"

    def run(mode, resume, seed=0, method="sma"):
        monkeypatch.setenv("FAKE_MODE", mode)
        runner = harness.Runner(str(out), 1, resume=resume, out=open(os.devnull, "w"), python=str(fake))
        return runner.run(method, {"seed": seed}, None, method, "a", "a", seed, 0.96, 30)

    def last_call():
        return json.loads(calls.read_text().splitlines()[-1])

    assert run("stopped", resume=False).summary is None           # a compare stopped mid-run
    assert last_call()["args"][-3:] == ["--checkpoint-dir", str(checkpoints), "--resume"]
    assert (checkpoints / "ckpt").exists()
    assert run("ok", resume=True).summary["tta"] == 2.5              # --resume: the run continues
    assert last_call()["found"] and not checkpoints.exists()         # finished: its checkpoints go
    run("stopped", resume=False, seed=1)
    run("ok", resume=True, seed=2)                                    # other settings: starts afresh
    assert not last_call()["found"]
    run("ok", resume=False, method="tf_ssgd")                         # stock Keras: no checkpoints
    assert "--checkpoint-dir" not in last_call()["args"]


def test_a_divergence_names_runs_of_learners_as_ranges():
    from crossbow_tf.engine.trainer import describe_non_finite
    assert describe_non_finite(["the loss"] + [f"learner {i}" for i in range(128)]) == "the loss, learners 0-127"
    assert describe_non_finite(["the loss", "z", "learner 1", "learner 3", "learner 4"]) == "the loss, z, learners 1, 3-4"
    assert describe_non_finite(["z", "learner 5"]) == "z, learner 5"
