"""The time-to-accuracy harness: TTA on known curves, statistics, config errors, and a tiny real run."""
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

import crossbow_tf.compare as harness
from crossbow_tf.compare import cli as compare, sweep
from crossbow_tf.results import EVALUATION_KEYS, RunResults, format_problems
from forking import forked_runs  # noqa: F401  (a fixture)

# Training processes are forked from a server that imported TensorFlow once (tests/forking.py).
pytestmark = pytest.mark.usefixtures("forked_runs")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def curve(accuracies, epoch_time=1.5):
    return [dict(epoch=i + 1, iteration=10 * (i + 1), examples=100 * (i + 1), wall_time=epoch_time * (i + 1),
                 accuracy=a, loss=1.0 - a) for i, a in enumerate(accuracies)]


# --- time to target -----------------------------------------------------------------------------

def test_time_to_target_on_a_synthetic_learning_curve_with_known_answer():
    # accuracy(t) = 1 - 0.9 exp(-t / tau), evaluated every 1.5 s of training. It first reaches 0.96
    # when t >= tau * ln(0.9 / 0.04) = 2.5 * 3.1135 = 7.78 s, i.e. at the 6th evaluation (t = 9.0 s).
    tau, dt = 2.5, 1.5
    accs = [1 - 0.9 * math.exp(-dt * (i + 1) / tau) for i in range(12)]
    evals = curve(accs, dt)
    assert harness.time_to_target(evals, 0.96) == (9.0, 6)
    results = RunResults("sma", {}, env={}, evaluations=evals)
    assert results.time_to_accuracy(0.96) == 9.0 and results.epochs_to_accuracy(0.96) == 6
    # Exactly on the target counts; a later dip does not undo it; never reached is None.
    assert harness.time_to_target(curve([0.5, 0.96, 0.90]), 0.96) == (3.0, 2)
    assert harness.time_to_target(curve([0.5, 0.7, float("nan")]), 0.96) is None
    assert harness.time_to_target([], 0.5) is None


def test_time_to_target_refuses_a_clock_that_goes_backwards():
    evals = curve([0.1, 0.2, 0.99])
    evals[2]["wall_time"] = 1.0
    with pytest.raises(ValueError, match="backwards"):
        harness.time_to_target(evals, 0.9)
    assert any("backwards" in p for p in format_problems(dict(method="m", config={}, environment={},
                                                              evaluations=evals)))


def test_run_summary_and_seed_statistics():
    d = dict(method="tf_ssgd", config={"batch_size": 32}, environment={}, num_learners=4, trace_time=0.7,
             evaluations=[dict(e, epoch_start_time=0.25) for e in curve([0.8, 0.97, 0.98])])
    s = harness.run_summary(d, 0.96)
    assert (s["reached"], s["tta"], s["epochs_to_target"], s["best_accuracy"]) == (True, 3.0, 2, 0.98)
    assert s["global_batch"] == 128 and s["epoch_start_wait"] == 0.75
    assert s["images_per_second"] == pytest.approx(300 / 4.5)
    # None = never reached, ranked as infinitely slow.
    assert harness.seed_statistics([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert harness.seed_statistics([3.0, None, 1.0]) == (3.0, 1.0, None)
    assert harness.seed_statistics([None, None, 1.0]) == (None, 1.0, None)
    assert harness.seed_statistics([]) == (None, None, None)


def test_grid_budget_and_choice_of_the_best_trial():
    grid = {"batch_size": [64, 128, 256], "learning_rate.base": [0.01, 0.1]}
    points = harness.expand_grid(grid)
    assert len(points) == 6 and points[0] == {"batch_size": 64, "learning_rate.base": 0.01}
    chosen = harness.choose_trials(points, 4)
    assert len(chosen) == 4 and chosen == harness.choose_trials(points, 4)   # seeded: reproducible
    assert all(p in points for p in chosen)
    assert harness.choose_trials(points, 10) == points
    reached = lambda tta, ep, acc: dict(tta=tta, epochs_to_target=ep, best_accuracy=acc)   # noqa: E731
    missed = lambda acc: dict(tta=None, epochs_to_target=None, best_accuracy=acc)         # noqa: E731
    trials = [[missed(0.95)], [reached(9.0, 3, 0.97)], [reached(7.0, 5, 0.97)], [None], [missed(0.959)]]
    assert harness.best_trial(trials, by="tta") == 2
    assert harness.best_trial(trials, by="epochs") == 1
    assert harness.best_trial([[missed(0.9)], [missed(0.95)], [None]]) == 1


def test_tta_ratio_is_sma_over_the_fastest_baseline():
    def row(name, method, tta):
        return dict(name=name, method=method, tta=(tta, tta, tta))
    rows = [row("sma", "sma", 6.0), row("tf_ssgd", "tf_ssgd", 5.0), row("mirrored", "tf_ssgd", 30.0),
            row("easgd", "easgd", None)]
    assert harness.tta_ratio(rows) == (pytest.approx(1.2), "sma", "tf_ssgd")
    assert harness.tta_ratio([row("sma", "sma", None), row("b", "tf_ssgd", 2.0)])[0] is None


# --- config and argument errors: one line, exit 2, nothing written ----------------------------

def write_config(path, **changes):
    with open(os.path.join(REPO, "configs", "lenet_mnist_cpu.yaml")) as f:
        doc = yaml.safe_load(f)
    for key, value in changes.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    with open(path, "w") as f:
        yaml.safe_dump(doc, f)
    return str(path)


@pytest.mark.parametrize("changes, message", [
    (dict(compare=None), "no compare: section"),
    (dict(compare={"methods": {"sma": {}, "sgd": {}}}), "unknown method 'sgd'"),
    (dict(compare={"methods": {"sma": {"grid": {"learning_rate.bse": [0.1]}}, "tf_ssgd": {}}}),
     "unknown key 'learning_rate.bse'"),
    (dict(compare={"methods": {"sma": {"fixed": {"tf_ssgd.input": "repeat"}}, "tf_ssgd": {}}}),
     "applies to the tf_ssgd method only"),
    (dict(compare={"methods": {"sma": {}, "tf_ssgd": {"grid": {"batch_size": ["big"]}}}}),
     "batch_size: expected an integer"),
    (dict(compare={"methods": {"sma": {}, "tf_ssgd": {"grid": {"tf_ssgd.input": ["stream"]}}}}),
     "tf_ssgd.input: choose per_epoch or repeat"),
    (dict(compare={"methods": {"sma": {}}}), "at least one baseline"),
    (dict(compare={"methods": {"sma": {}, "tf_ssgd": {}}, "budget": 0}), "compare.budget"),
    (dict(target_accuracy=1.5), "target_accuracy"),
])
def test_bad_compare_config_is_one_clear_error(tmp_path, capsys, changes, message):
    out = tmp_path / "report"
    code = compare.main(["--config", write_config(tmp_path / "c.yaml", **changes), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("compare: error:") and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_bad_sweep_config_and_arguments(tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml")
    assert sweep.main(["--config", cfg, "--learners", "3", "--dry-run"]) == 0   # one device: any k
    capsys.readouterr()
    bad = write_config(tmp_path / "bad.yaml", sweep={"sma": {"learners": [3]}, "ssgd": {},
                                                     "seeds": [0]},
                       devices={"logical_cpu": 2, "cross_device_reduction": "auto"})
    assert sweep.main(["--config", bad, "--out", str(tmp_path / "s2"), "--dry-run"]) == 2
    assert "do not spread evenly" in capsys.readouterr().err
    assert compare.main(["--config", cfg, "--methods", "nope", "--dry-run"]) == 2
    assert "--methods: 'nope'" in capsys.readouterr().err
    assert compare.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_shipped_cpu_config_validates_every_run(capsys):
    cfg = os.path.join(REPO, "configs", "lenet_mnist_cpu.yaml")
    assert compare.main(["--config", cfg, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tf_ssgd_mirrored (tf_ssgd)" in out and "sweep sma global batch 1024" in out
    assert sweep.main(["--config", cfg, "--dry-run"]) == 0


def test_existing_report_directory_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.md").write_text("earlier report")
    code = compare.main(["--config", write_config(tmp_path / "c.yaml"), "--out", str(out)])
    assert code == 2 and "report directory exists" in capsys.readouterr().err
    code = compare.main(["--config", write_config(tmp_path / "c.yaml"), "--out", str(out), "--force"])
    assert code == 2 and "not a report directory made by these tools" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "earlier report"


# --- a tiny real comparison, end to end ------------------------------------------------------

TINY = {
    "compare": {"budget": 1, "search_seeds": [0], "seeds": [0], "epochs": 1, "target": 0.5, "timeout": 600,
                "methods": {"sma": {"fixed": {"devices.logical_cpu": 1},
                                    "grid": {"learners_per_device": [2], "learning_rate.base": [0.05]}},
                            "tf_ssgd": {"fixed": {"devices.logical_cpu": 1},
                                        "grid": {"batch_size": [64], "learning_rate.base": [0.05]}}}},
    "sweep": {"seeds": [0], "epochs": 1, "target": 0.5,
              "ssgd": {"method": "tf_ssgd", "global_batches": [128], "fixed": {"devices.logical_cpu": 1},
                       "grid": {"learning_rate.base": [0.05]}},
              "sma": {"batch_size": 16, "learners": [2], "fixed": {"devices.logical_cpu": 1},
                      "grid": {"learning_rate.base": [0.05]}}},
}


def test_tiny_comparison_end_to_end(tmp_path):
    cfg = write_config(tmp_path / "tiny.yaml", **TINY)
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "crossbow_tf.compare", "--config", cfg, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[  4/4]" in proc.stdout and "epoch 1/1  accuracy" in proc.stdout   # progress was shown

    runs = {}
    for method in ("sma", "tf_ssgd", "sweep_ssgd", "sweep_sma"):
        [name] = [n for n in os.listdir(out / "runs" / method) if n.endswith(".json")]
        with open(out / "runs" / method / name) as f:
            runs[method] = json.load(f)
    for method, d in runs.items():
        assert format_problems(d) == [], method
        [e] = d["evaluations"]   # one epoch, one evaluation
        assert all(k in e for k in EVALUATION_KEYS)
        assert e["epoch"] == 1 and e["examples"] == 4000 and e["wall_time"] > 0 and 0 <= e["accuracy"] <= 1
        assert d["environment"]["tensorflow"] and d["trace_time"] >= 0
    assert runs["sma"]["method"] == "sma" and runs["sma"]["num_learners"] == 2
    assert runs["tf_ssgd"]["method"] == "tf_ssgd" and runs["tf_ssgd"]["global_batch"] == 64
    assert runs["sweep_ssgd"]["global_batch"] == 128 and runs["sweep_sma"]["config"]["learners_per_device"] == 2

    # The ratio in the report is SMA's time to 50% over the baseline's, from the runs' own files.
    with open(out / "summary.json") as f:
        summary = json.load(f)
    tta = {m: harness.time_to_target(runs[m]["evaluations"], 0.5) for m in ("sma", "tf_ssgd")}
    assert all(tta.values()), "both should reach 50% in one epoch"
    ratio = tta["sma"][0] / tta["tf_ssgd"][0]
    assert summary["tta_ratio"]["ratio"] == pytest.approx(ratio)
    report = (out / "report.md").read_text()
    assert f"TTA ratio SMA / best baseline = {ratio:.2f}" in report
    assert "| sma |" in report and "| tf_ssgd |" in report and "## Statistical efficiency" in report
    assert {r["name"] for r in summary["rows"]} == {"sma", "tf_ssgd"}
    assert [p["global_batch"] for p in summary["sweep"]["ssgd"]] == [128]
    assert [p["global_batch"] for p in summary["sweep"]["sma"]] == [32]
    for png in ("accuracy_vs_time.png", "accuracy_vs_epochs.png", "sweep.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000

    # Given an absolute --out, every command, log and result names the folders relative to the
    # working directory, and the interpreter as python (issue 27).
    texts = {}
    for root, _, names in os.walk(out):
        for name in names:
            if name.endswith((".json", ".log", ".md", ".cmd", ".yaml")):
                with open(os.path.join(root, name)) as f:
                    texts[os.path.relpath(os.path.join(root, name), out)] = f.read()
    assert {"runs/sma/t00_s0.log", "runs/sma/t00_s0.json", "summary.json", "report.md"} <= set(texts)
    absolute = re.compile(f"(?<![\\w.]){re.escape(str(tmp_path))}|{re.escape(sys.executable)}")   # ../../tmp/x is relative
    assert [p for p, text in texts.items() if absolute.search(text)] == []
    assert texts["runs/sma/t00_s0.log"].startswith("$ python -m crossbow_tf.run --config ")
    assert runs["sma"]["config"]["tensorboard"] == os.path.relpath(out / "tensorboard" / "sma" / "t00_s0")

    # A second run into the same directory is refused and changes nothing.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "report directory exists" in again.stderr
    assert (out / "report.md").read_text() == report


# --- the runner: failures, timeouts and --resume, with a stand-in for the training process --------

FAKE_PYTHON = '''#!{python}
"""Stands in for `python -m MODULE --config C --results R`: behaves as FAKE_MODE says."""
import json, os, sys, time
args = sys.argv[1:]
results = args[args.index("--results") + 1]
mode = os.environ["FAKE_MODE"]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(mode + "\\n")
print("epoch   1/1  test accuracy 0.9700  test loss 0.1  train loss 0.2  time   1.00s  4000 images/s  lr 0.1")
if mode == "crash":
    print("Traceback: something broke", flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(60)
evals = [dict(epoch=1, iteration=10, examples=4000, wall_time=2.5, accuracy=0.97, loss=0.1)]
if mode == "malformed":
    del evals[0]["loss"]
extra = {{}}
if mode == "diverged":   # as crossbow_tf.run: its results say where, and it exits with code 3
    evals[0]["accuracy"] = 0.5
    extra = dict(diverged=dict(iteration=14, epoch=2, non_finite=["the loss"]))
json.dump(dict(method="sma", config={{}}, environment={{}}, evaluations=evals, num_learners=1, **extra),
          open(results, "w"))
sys.exit(3 if mode == "diverged" else 0)
'''


def test_runner_records_failures_timeouts_and_resumes(tmp_path, monkeypatch):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    out = tmp_path / "report"
    harness.prepare_out_dir(str(out))
    runner = harness.Runner(str(out), 6, out=open(os.devnull, "w"), python=str(fake))
    exp = {"seed": 0}

    def run(mode, name, timeout=30):
        monkeypatch.setenv("FAKE_MODE", mode)
        return runner.run("sma", exp, None, "sma", name, name, 0, 0.96, timeout)
    ok = run("ok", "a")
    assert ok.summary["tta"] == 2.5 and ok.summary["epochs_to_target"] == 1 and ok.error is None
    crash = run("crash", "b")
    assert crash.summary is None and "exit code 3" in crash.error and "something broke" in crash.error
    # A run that diverged is an outcome (not reached, diverged), not a failed run.
    diverged = run("diverged", "e")
    assert diverged.error is None and diverged.summary["diverged"] and not diverged.summary["reached"]
    assert diverged.summary["best_accuracy"] == 0.5 and not ok.summary["diverged"]
    bad = run("malformed", "c")
    assert bad.summary is None and "malformed results" in bad.error and "loss" in bad.error
    start = time.time()
    hung = run("hang", "d", timeout=2)
    assert hung.summary is None and "timed out" in hung.error and time.time() - start < 20
    log = (out / "runs" / "sma" / "a.log").read_text()
    assert "--results" in log and "epoch   1/1" in log
    # --resume reuses a finished run with the same settings and reruns one whose settings changed.
    runner = harness.Runner(str(out), 2, resume=True, out=open(os.devnull, "w"), python=str(fake))
    n = len(calls.read_text().split())
    assert run("ok", "a").summary["tta"] == 2.5 and len(calls.read_text().split()) == n
    exp["seed"] = 1
    assert run("ok", "a").summary is not None and len(calls.read_text().split()) == n + 1
