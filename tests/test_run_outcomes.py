"""How runs end and what the commands record: exit codes of a collapsed or diverged run (engine,
stock baseline, harness), inputs that used to pass silently, a resumed run's time to target, the
compare report's TTA sentence, and reproduce --resume reusing a bench wherever it was measured."""
import json
import os
import shutil
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
    args = reproduce.parse_args(["--config", os.path.join(REPO, "configs", "lenet_fashion_mnist_cpu.yaml"),
                                 "--out", out])
    experiment, _, spec, cells = reproduce.build(args)
    return dict(experiment, **overrides), reproduce.bench_jobs(spec, cells)


def test_the_committed_bench_is_reused_from_another_checkout_and_another_out(tmp_path, monkeypatch, capsys):
    # The committed bench/*.cmd were written elsewhere (absolute tool path, another --out): a copy of
    # the folder, under another name, is reused by --resume without running anything.
    copy = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(STUDY, "bench"), copy / "bench")
    assert "/work/" in (copy / "bench" / "b16.cmd").read_text()   # an absolute path of the machine that ran it
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
                           "--out", os.path.relpath(STUDY), "--resume", "--dry-run"])
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
