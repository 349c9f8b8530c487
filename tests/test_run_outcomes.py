"""How runs end and what the commands record: exit codes of a collapsed or diverged run (engine,
stock baseline, harness), inputs that used to pass silently, a resumed run's time to target, the
compare report's TTA sentence, and reproduce --resume reusing a bench wherever it was measured."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

import crossbow_tf.compare as harness
from crossbow_tf.compare import report as report_lib, reproduce

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY = os.path.join(REPO, "docs", "results", "lenet_fashion_mnist_cpu")


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


# --- the compare report's TTA sentence -----------------------------------------------------------

def _row(name, method, tta):
    return dict(name=name, method=method, tta=(tta, tta, tta))


@pytest.mark.parametrize("rows, says, never", [
    ([_row("sma", "sma", None), _row("tf_ssgd", "tf_ssgd", 2.0)],
     ["SMA did not reach 96% in more than half of its seeds", "tf_ssgd reached 96%"], ["no baseline"]),
    ([_row("sma", "sma", 3.0), _row("tf_ssgd", "tf_ssgd", None)],
     ["sma reached 96%", "no baseline reached 96% in more than half of its seeds"], ["SMA did not"]),
    ([_row("sma", "sma", None), _row("tf_ssgd", "tf_ssgd", None)],
     ["SMA did not reach 96%", "no baseline reached 96%"], ["reached 96%;"]),
    ([_row("tf_ssgd", "tf_ssgd", 2.0)], ["no SMA entry was compared", "tf_ssgd reached 96%"], ["SMA did not"]),
])
def test_ratio_line_says_which_side_did_not_reach_the_target(rows, says, never):
    line = report_lib.ratio_line(rows, 0.96)
    assert line.startswith("TTA ratio SMA / best baseline: not available (")
    for text in says:
        assert text in line, line
    for text in never:
        assert text not in line, line


def test_ratio_line_gives_the_ratio_when_both_reached():
    line = report_lib.ratio_line([_row("sma", "sma", 3.0), _row("tf_ssgd", "tf_ssgd", 2.0)], 0.96)
    assert line.startswith("**TTA ratio SMA / best baseline = 1.50** (sma against tf_ssgd")


# --- recorded commands name no machine's folders -------------------------------------------------

def test_the_recorded_command_line_has_paths_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = os.path.join(str(tmp_path), "docs", "out")
    monkeypatch.setattr(sys, "argv", [os.path.join(REPO, "crossbow_tf", "compare", "reproduce.py"),
                                      "--config", "configs/c.yaml", "--out", out, f"--data-dir={tmp_path}/d"])
    assert report_lib.command_line() == \
        "python -m crossbow_tf.compare.reproduce --config configs/c.yaml --out docs/out --data-dir=d"
    assert str(tmp_path) not in report_lib.command_line()


# --- reproduce --resume reuses a bench on what it measured ----------------------------------------

def _study_jobs(out, **overrides):
    # The bench's phases only: they read no data set, so Fashion-MNIST need not be installed.
    args = reproduce.parse_args(["--config", os.path.join(REPO, "configs", "lenet_fashion_mnist_cpu.yaml"),
                                 "--out", out, "--phases", "bench", "report"])
    experiment, _, spec, cells = reproduce.build(args)
    return dict(experiment, **overrides), reproduce.bench_jobs(spec, cells)


def test_the_committed_bench_is_reused_from_another_checkout_and_another_out(tmp_path, monkeypatch, capsys):
    # The committed bench/*.cmd were written elsewhere (absolute tool path, another --out): a copy of
    # the folder, under another name, is reused by --resume without running anything.
    copy = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(STUDY, "bench"), copy / "bench")
    calls = []
    monkeypatch.setattr(reproduce.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 1)
    experiment, jobs = _study_jobs(str(copy))
    assert [b for b, _, _ in jobs] == [16, 64]
    lines = []
    results = reproduce.run_bench(str(copy), experiment, jobs, 3, 8192, lines.append, resume=True)
    assert calls == [] and sorted(results) == [16, 64], lines
    assert all("done before, reusing" in line for line in lines)
    assert results[16] == json.loads((copy / "bench" / "b16.json").read_text())

    # --dry-run says so for the committed folder itself.
    code = reproduce.main(["--config", os.path.join(REPO, "configs", "lenet_fashion_mnist_cpu.yaml"),
                           "--out", os.path.relpath(STUDY), "--resume", "--dry-run", "--phases", "bench", "report"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("done before, --resume reuses") == 2, out

    # A setting the measurement depends on reruns it: rounds, examples, or the precision.
    for rounds, examples, precision in ((1, 8192, "float32"), (3, 4096, "float32"), (3, 8192, "mixed_bfloat16")):
        calls.clear()
        experiment, jobs = _study_jobs(str(copy), precision=precision)
        reproduce.run_bench(str(copy), experiment, jobs, rounds, examples, lines.append, resume=True)
        assert len(calls) == 2, (rounds, examples, precision)
    assert "--precision" in calls[0] and "mixed_bfloat16" in calls[0]
    # (The failed fake runs wrote no .cmd: the committed ones are intact.)
    assert (copy / "bench" / "b16.cmd").read_text() == open(os.path.join(STUDY, "bench", "b16.cmd")).read()


def test_a_bench_records_its_command_relative_and_is_reused_under_another_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def fake_bench(cmd, **kw):   # writes the JSON the bench would
        path = cmd[cmd.index("--json") + 1]
        ks = [int(k) for k in cmd[cmd.index("--ks") + 1:cmd.index("--json")]]
        with open(path, "w") as f:
            json.dump(dict(rows=[dict(k=k, sma=1.0) for k in ks]), f)
        return 0
    monkeypatch.setattr(reproduce.subprocess, "call", fake_bench)
    jobs = [(16, [8, 32], 1)]
    reproduce.run_bench(str(tmp_path / "a"), {"model": "lenet"}, jobs, 3, 8192, lambda line: None, resume=False)
    saved = (tmp_path / "a" / "bench" / "b16.cmd").read_text()
    assert str(tmp_path) not in saved and "--json a/bench/b16.json" in saved
    assert saved.split()[0] == os.path.relpath(os.path.join(reproduce.TOOLS, "bench_throughput.py"))
    shutil.move(str(tmp_path / "a"), str(tmp_path / "b"))
    monkeypatch.setattr(reproduce.subprocess, "call", lambda cmd, **kw: pytest.fail("re-ran the bench"))
    lines = []
    results = reproduce.run_bench(str(tmp_path / "b"), {"model": "lenet"}, jobs, 3, 8192, lines.append, resume=True)
    assert sorted(results) == [16] and "done before" in lines[0]
    # A JSON missing one of the k measured is not reused.
    (tmp_path / "b" / "bench" / "b16.json").write_text(json.dumps(dict(rows=[dict(k=8)])))
    with pytest.raises(pytest.fail.Exception, match="re-ran"):
        reproduce.run_bench(str(tmp_path / "b"), {"model": "lenet"}, jobs, 3, 8192, lines.append, resume=True)


# --- the harness: a collapsed run (exit code 5) is an outcome -------------------------------------

FAKE_PYTHON = '''#!{python}
"""Stands in for `python -m MODULE --config C --results R`: a run that collapses (exit code 5)."""
import json, os, sys
args = sys.argv[1:]
results = args[args.index("--results") + 1]
mode = os.environ["FAKE_MODE"]
evals = [dict(epoch=e, iteration=10 * e, examples=400 * e, wall_time=1.0 * e, accuracy=0.1, loss=2.3)
         for e in (1, 2, 3)]
extra = dict(collapsed=True) if mode == "collapsed" else {{}}
json.dump(dict(method="sma", config={{}}, environment={{}}, evaluations=evals, num_learners=1, **extra),
          open(results, "w"))
sys.exit(5)
'''


def test_the_harness_takes_a_collapsed_run_exit_5_as_an_outcome(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "report"
    harness.prepare_out_dir(str(out))
    runner = harness.Runner(str(out), 2, out=open(os.devnull, "w"), python=str(fake))
    monkeypatch.setenv("FAKE_MODE", "collapsed")
    record = runner.run("sma", {"seed": 0}, None, "sma", "a", "a", 0, 0.96, 60)
    assert record.error is None and record.summary["collapsed"] and not record.summary["reached"]
    # Exit code 5 from a run whose results do not say it collapsed is a failure.
    monkeypatch.setenv("FAKE_MODE", "other")
    record = runner.run("sma", {"seed": 0}, None, "sma", "b", "b", 0, 0.96, 60)
    assert record.summary is None and "exit code 5" in record.error
    # The run's log names its command relative to this folder: no interpreter's or report's absolute path.
    first = (out / "runs" / "sma" / "a.log").read_text().splitlines()[0]
    assert first.startswith("$ fake_python -m crossbow_tf.run --config report/runs/sma/a.yaml --results "
                            "report/runs/sma/a.json"), first


# --- a resumed run's time to target is training time ----------------------------------------------

class _Clock:
    """Stands in for the trainer's time module: time moves only when a step runs (STEP seconds; the
    first step of an engine, which traces it, TRACE more), so training times are exact."""
    STEP, TRACE = 0.01, 2.0

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def timed(self, engine, stop=None, stop_after=None):
        step, calls = engine.train_step, []

        def timed_step(*args, **kwargs):
            self.now += self.STEP + (self.TRACE if not calls else 0.0)
            calls.append(1)
            if stop is not None and len(calls) == stop_after:
                stop.received = signal.SIGTERM   # as StopSignals after a SIGTERM: stops before the next step
            return step(*args, **kwargs)
        engine.train_step = timed_step
        return engine


class _Signals:
    received, deferred = None, False


def _tiny_engine(devices):
    import keras

    from crossbow_tf.algorithms import SMA
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine.core import Engine
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    return Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), SMA(),
                  CrossbowStrategy(devices=devices, learners_per_device=2))


def _linear_problem():
    import numpy as np

    from crossbow_tf.data.source import from_arrays
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 8)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(8, 3)), axis=1).astype("int32")
    return from_arrays("linear", (x[:256], y[:256]), (x[256:], y[256:]), 3)   # 8 iterations of 4 x 8


def test_a_resumed_run_counts_its_step_tracing_once(cpu_devices, tmp_path, monkeypatch):
    from crossbow_tf.engine import trainer
    from crossbow_tf.engine.checkpoint import Checkpoints
    from crossbow_tf.engine.schedule import StepSchedule
    from crossbow_tf.errors import TrainingInterrupted
    from crossbow_tf.results import RunResults
    clock = _Clock()
    monkeypatch.setattr(trainer, "time", clock)
    data, quiet = _linear_problem(), dict(seed=0, log=lambda line: None, learner_diagnostics=False)

    def run(name, stop_after=None, resume=False):
        """A new process's run: a new engine (its step traced again), the checkpoints of NAME; stopped
        by a SIGTERM after STOP_AFTER steps (0: before the first)."""
        stop = _Signals()
        if stop_after == 0:
            stop.received = signal.SIGTERM
        engine = clock.timed(_tiny_engine(cpu_devices[:2]), stop, stop_after)
        checkpoints = Checkpoints(str(tmp_path / name), engine)
        results, progress = RunResults("sma", {}, env={}), None
        if resume:
            _, progress = checkpoints.restore_newest(results, log=lambda line: None)
        trainer.train(engine, data, 8, 2, StepSchedule(0.05), results, checkpoints=checkpoints, progress=progress,
                      stop_signals=stop, **quiet)
        return results

    reference = run("reference")
    assert [e["wall_time"] for e in reference.evaluations] == pytest.approx([2.08, 2.16])   # one trace, 16 steps
    assert "retrace_times" not in reference.extra
    # Stopped in epoch 2 (iteration 12 of 16), and stopped before its first step (its one checkpoint
    # is the start's: the resumed process's trace is the run's first, and counts).
    for stopped_after, retraced in ((12, True), (0, False)):
        name = f"stopped_{stopped_after}"
        with pytest.raises(TrainingInterrupted):
            run(name, stop_after=stopped_after)
        resumed = run(name, resume=True)   # traces again: TRACE more in its first step
        # Its training time is the uninterrupted run's: the second trace is recorded, not counted.
        assert [e["wall_time"] for e in resumed.evaluations] == pytest.approx([2.08, 2.16]), name
        assert resumed.extra.get("retrace_times") == ([pytest.approx(clock.TRACE)] if retraced else None), name
        if retraced:
            assert resumed.evaluations[1]["epoch_time"] == pytest.approx(8 * clock.STEP)


# --- a collapsed run exits 5, a diverged stock run exits 3: one line, results written -------------

# A model that cannot learn: its logits are always (1, 0) (its gradients 0), so it always predicts
# class 0, half of the balanced test set: at chance for 2 classes (the loss stays finite).
FLAT_MODEL = '''import keras


class Zero(keras.layers.Layer):
    def call(self, x):
        return x * 0.0 + keras.ops.one_hot(0, x.shape[-1])


def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(num_classes),
                             Zero()])
'''


@pytest.fixture
def flat_folder(tmp_path, monkeypatch):
    import numpy as np
    rng = np.random.default_rng(0)
    labels = lambda n: np.tile([0, 1], n // 2).astype(np.uint8)   # noqa: E731
    np.savez(tmp_path / "two.npz", x_train=rng.random((64, 4, 4), dtype=np.float32), y_train=labels(64),
             x_test=rng.random((32, 4, 4), dtype=np.float32), y_test=labels(32))
    (tmp_path / "flat.py").write_text(FLAT_MODEL)
    (tmp_path / "c.yaml").write_text(json.dumps(dict(
        name="flat", model="flat.py:build", data={"name": "npz", "path": "two.npz"}, learners_per_device=2,
        batch_size=8, epochs=6, target_accuracy=0.9, collapse_epochs=2, seed=0)))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def one_line(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["crossbow_tf.run", "baselines.tf_ssgd"])
def test_a_collapsed_run_exits_5_with_its_results_written(flat_folder, capsys, command):
    import importlib
    main = importlib.import_module(command).main
    assert main(["--config", "c.yaml", "--results", "r.json"]) == 5
    err = one_line(capsys)
    assert "collapsed: test accuracy at chance for 2 epochs after the first (0.5000 at epoch 3)" in err, err
    saved = strict_json((flat_folder / "r.json").read_text())
    assert saved["collapsed"] is True and [e["epoch"] for e in saved["evaluations"]] == [1, 2, 3]
    assert harness.run_summary(saved, 0.9)["collapsed"]


@pytest.mark.parametrize("command", ["baselines.tf_ssgd", "baselines.crossbow_ssgd"])
def test_a_baseline_at_a_huge_learning_rate_stops_as_diverged_with_exit_3(tmp_path, capsys, command):
    """The stock baseline's own divergence stop (a Keras callback), and an engine baseline's."""
    import importlib
    main = importlib.import_module(command).main
    config, results = tmp_path / "c.yaml", tmp_path / "r.json"
    config.write_text(json.dumps(dict(name="huge", model="lenet", data={"name": "mnist_embedded"}, batch_size=32,
                                      learning_rate={"base": 1e6}, epochs=2, seed=0)))
    assert main(["--config", str(config), "--results", str(results)]) == 3
    err = one_line(capsys)
    assert re.search(rf"^python -m {command}: diverged: not finite at iteration \d+ \(epoch 1, iteration "
                     r"\d+ of \d+\): (the loss|z)", err), err
    saved = strict_json(results.read_text())   # no bare NaN anywhere
    assert saved["diverged"]["epoch"] == 1 and saved["diverged"]["non_finite"][0] in ("the loss", "z")
    assert saved["diverged"]["iteration"] == int(re.search(r"iteration (\d+)", err).group(1))
    assert saved["evaluations"] == []   # the diverged epoch is not recorded
    assert saved["method"] == command.split(".")[1]
    summary = harness.run_summary(saved, 0.96)
    assert summary["diverged"] and not summary["reached"]


# --- inputs that passed silently: one line, exit 2, nothing written -------------------------------

def _exit_code(main, argv):
    try:
        return main(argv)
    except SystemExit as e:   # argparse's errors
        return e.code


@pytest.mark.parametrize("command, argv, message", [
    ("crossbow_tf.run", ["--data-dir", "{dir}", "--results", "r.json"],
     "command line: data.data_dir: the mnist_embedded data set ships inside the package and reads no directory"),
    ("baselines.tf_ssgd", ["--config", "{default}", "--data-dir", "{dir}", "--results", "r.json"],
     "command line: data.data_dir: the mnist_embedded data set ships inside the package"),
    ("crossbow_tf.run", ["--results", ""], "argument --results: expected a path, got ''"),
    ("baselines.tf_ssgd", ["--config", "{default}", "--results", ""], "argument --results: expected a path, got ''"),
    ("baselines.crossbow_ssgd", ["--config", "{default}", "--results", " "],
     "argument --results: expected a path, got ' '"),
    ("crossbow_tf.run", ["--checkpoint-dir", "", "--results", "r.json"], "argument --checkpoint-dir: expected a path"),
    ("crossbow_tf.run", ["--on-divergence", "rollback", "--results", "r.json"],
     "command line: on_divergence: rollback needs checkpoints to roll back to: give --checkpoint-dir"),
    ("crossbow_tf.run", ["--on-divergence", "rollback", "--check"], "rollback needs checkpoints"),
])
def test_inputs_that_passed_silently_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, command, argv, message):
    import importlib

    from crossbow_tf.run import DEFAULT_CONFIG
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(command).main
    argv = [a.format(dir=str(tmp_path), default=DEFAULT_CONFIG) for a in argv]
    assert _exit_code(main, argv) == 2
    assert message in one_line(capsys)
    assert os.listdir(tmp_path) == []   # nothing written
