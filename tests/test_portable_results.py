"""Committed results name no folder of the machine that wrote them (docs/, tools/portable_results.py),
and the harness records paths relative to the folder it ran in."""
import importlib.util
import json
import os
import re
import subprocess
import sys

from crossbow_tf.compare.report import relative_path
from crossbow_tf.files import recorded_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A folder of a machine: the usual roots of homes, scratch space and checkouts, a venv's
# interpreter, an installed package's file. Matched where a path starts (not inside "docs/tmp/").
MACHINE_PATH = re.compile(r"(?<![\w./:~-])(/(work|root|tmp|home|Users|mnt|opt|srv|var)/|/\S*/bin/python|/\S*/site-packages/)")
# Where CUDA installs itself on every machine (docs/gpu.md names them): not one machine's folders.
SYSTEM_PATHS = re.compile(r"/opt/cuda\b|/usr/local/cuda\b")


def _tool():
    spec = importlib.util.spec_from_file_location("portable_results", os.path.join(ROOT, "tools", "portable_results.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_paths(path):
    """[(line number, line)] of PATH's lines naming a machine's folder. A study's config.yaml is the
    user's config file copied as it is: its comments are that file's (example commands), not records."""
    with open(path, "rb") as f:
        text = f.read().decode("latin-1")   # binary files too (PNG, TensorBoard events): a path is ASCII
    copied_config = os.path.basename(path) == "config.yaml"
    return [(n, line[:200]) for n, line in enumerate(text.splitlines(), 1)
            if MACHINE_PATH.search(SYSTEM_PATHS.sub("", line)) and not (copied_config and line.lstrip().startswith("#"))]


def committed_files(folder):
    """The files under FOLDER that git tracks (a run in progress leaves checkpoints and logs there that
    are not committed); every file under it outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", folder], cwd=ROOT, capture_output=True, check=True)
        return [os.path.join(ROOT, name) for name in listed.stdout.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        return [os.path.join(root, name) for root, _, names in os.walk(os.path.join(ROOT, folder)) for name in names]


def test_no_committed_file_under_docs_names_a_folder_of_the_machine_that_wrote_it():
    found, scanned = [], 0
    for path in committed_files("docs"):
        scanned += 1
        found += [(os.path.relpath(path, ROOT), n, line) for n, line in machine_paths(path)]
    assert scanned > 500   # the two committed studies' runs, logs, plots and events
    assert found == [], f"{len(found)} line(s), first: {found[:5]} (rewrite with tools/portable_results.py)"


def test_the_scan_sees_each_kind_of_machine_path(tmp_path):
    lines = ["$ /work/venv/bin/python -m crossbow_tf.run --config docs/results/x/runs/a.yaml",
             '"dir": "/home/me/study/runs/a.checkpoints"',
             "/opt/conda/lib/python3.11/site-packages/keras/src/trainers/epoch_iterator.py:74: UserWarning",
             "results written to /tmp/pytest-of-me/report/runs/a.json",
             # Not machine paths: relative ones, devices, URLs, a fraction.
             "docs/results/x/tmp/a.json /device:CPU:0 https://github.com/x/y (max-min)/median"]
    for n, line in enumerate(lines):
        (tmp_path / f"f{n}.log").write_text(line)
    assert [bool(machine_paths(tmp_path / f"f{n}.log")) for n in range(len(lines))] == [True, True, True, True, False]
    (tmp_path / "config.yaml").write_text("#   crossbow-compare --out /tmp/c\nname: x\n")
    assert machine_paths(tmp_path / "config.yaml") == []
    (tmp_path / "config.yaml").write_text("data: {path: /home/me/data.npz}\n")
    assert len(machine_paths(tmp_path / "config.yaml")) == 1


def test_the_tool_rewrites_paths_into_the_checkout_and_names_those_it_cannot(tmp_path, capsys):
    tool = _tool()
    study = tmp_path / "study"
    (study / "runs").mkdir(parents=True)
    run = {"config": {"checkpoint": {"dir": "/work/main/docs/results/s/runs/a.checkpoints"},
                      "tensorboard": "/work/main/docs/results/s/tensorboard/a"}, "devices": ["/device:CPU:0"]}
    (study / "runs" / "a.json").write_text(json.dumps(run, indent=1))
    (study / "runs" / "a.log").write_text(
        "$ /work/venv/bin/python -m baselines.tf_ssgd --config /work/study/docs/results/s/runs/a.yaml\n"
        "/work/venv/lib/python3.11/site-packages/keras/src/trainers/epoch_iterator.py:74: UserWarning: x\n"
        "resuming from /data/elsewhere/ckpt-3\n")
    (study / "bench.cmd").write_text("/work/study/tools/bench_throughput.py --json docs/results/s/bench/b16.json")
    assert tool.main([str(study)]) == 1   # one path with no portable form
    rewritten = json.loads((study / "runs" / "a.json").read_text())
    assert rewritten["config"] == {"checkpoint": {"dir": "docs/results/s/runs/a.checkpoints"},
                                   "tensorboard": "docs/results/s/tensorboard/a"}
    assert rewritten["devices"] == ["/device:CPU:0"]
    assert (study / "runs" / "a.log").read_text().splitlines() == [
        "$ python -m baselines.tf_ssgd --config docs/results/s/runs/a.yaml",
        "site-packages/keras/src/trainers/epoch_iterator.py:74: UserWarning: x",
        "resuming from /data/elsewhere/ckpt-3"]
    assert (study / "bench.cmd").read_text().startswith("tools/bench_throughput.py --json")
    assert "/data/elsewhere/ckpt-3: no portable form" in capsys.readouterr().out
    # Run again: nothing left to rewrite but the path it cannot place.
    assert tool.rewrite_folder(str(study)) == (0, [(str(study / "runs" / "a.log"), "/data/elsewhere/ckpt-3")])


def test_a_regenerated_report_may_differ_from_the_old_one_only_in_its_date():
    tool = _tool()
    old = "# R\n- started: 2026-12-01T11:49:10+00:00; report written 2026-12-02T04:08:08+00:00\n| a | 1 |\n"
    assert tool.report_changes(old, old.replace("2026-12-02T04", "2026-12-03T15")) == []
    changed = tool.report_changes(old, old.replace("| a | 1 |", "| a | 2 |"))
    assert "-| a | 1 |" in changed and "+| a | 2 |" in changed
    assert tool.summary_changes('{"a": 1, "b": [2]}', '{"b": [2], "a": 1}') == []
    assert tool.summary_changes('{"a": 1, "b": [2]}', '{"a": 1, "b": [3]}') == ["b"]


def test_recorded_paths_are_relative_to_the_working_directory_and_the_interpreter_is_python(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert recorded_path(str(tmp_path / "out" / "runs")) == os.path.join("out", "runs")
    assert recorded_path("out/runs") == "out/runs" and recorded_path(None) is None
    assert relative_path(sys.executable) == "python"
    assert relative_path(f"--json={tmp_path / 'b.json'}") == "--json=b.json"
    monkeypatch.setenv("CROSSBOW_RUN_PYTHON", "/opt/venv/bin/python3")
    assert relative_path("/opt/venv/bin/python3") == "python"
    assert relative_path("/opt/other") == os.path.relpath("/opt/other") and not relative_path("/opt/other").startswith("/")
