"""The benchmark scripts run end to end on a tiny budget and print the tables they promise."""
import os
import re
import subprocess

import pytest

import forking
from forking import forked_runs  # noqa: F401  (a fixture)

# Training processes are forked from a server that imported TensorFlow once (tests/forking.py).
pytestmark = pytest.mark.usefixtures("forked_runs")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(*args, timeout=600):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([forking.PYTHON, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def table_rows(text):
    return [line for line in text.splitlines() if re.match(r"\| *\w", line) and "---" not in line][1:]


def test_bench_throughput_prints_ratios_and_the_update_share():
    proc = run_tool("tools/bench_throughput.py", "--ks", "1", "2", "--rounds", "1", "--examples", "96",
                    "--learner-momentum", "0.9", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = table_rows(proc.stdout)
    assert [tuple(c.strip() for c in r.split("|")[1:3]) for r in rows] == [
        ("1", "0.9"), ("1", "0"), ("2", "0.9"), ("2", "0")]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[2:7])
        assert 0 < float(cells[7].rstrip("%")) < 100


def test_bench_input_prints_pipeline_and_training_rates():
    proc = run_tool("tools/bench_input.py", "--models", "lenet", "--iterations", "3", "--devices", "1",
                    "--learners-per-device", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lenet" in proc.stdout.lower()
    assert re.search(r"\d+(\.\d+)?x", proc.stdout), proc.stdout


@pytest.mark.parametrize("args, message", [(["--ks", "3", "--devices", "2"], "not a positive multiple"),
                                           (["--rounds", "0"], "at least 1"),
                                           (["--learner-momentum", "-0.5"], "--learner-momentum")])
def test_bench_throughput_rejects_bad_arguments(args, message):
    proc = run_tool("tools/bench_throughput.py", *args)
    assert proc.returncode == 2 and message in proc.stderr


def test_profile_step_reports_op_groups_and_the_memory_floor():
    proc = run_tool("tools/profile_step.py", "--k", "2", "--iterations", "2", "--top", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    sma_ms, keras_ms = map(float, re.search(r"^\| iteration \(median ms\) \| ([\d.]+) \| ([\d.]+) \|$", out, re.M).groups())
    assert sma_ms > 0 and keras_ms > 0
    groups = {g: tuple(map(float, v.split(" | "))) for g, v in re.findall(
        r"^\| op time: (convolutions|matmuls|update \(XLA\)|other) \(ms, summed over threads\) \| ([\d. |]+) \|$",
        out, re.M)}
    # Both run LeNet's convolutions and matmuls; only SMA has the XLA update.
    assert all(groups[g][0] > 0 and groups[g][1] > 0 for g in ("convolutions", "matmuls")), out
    assert groups["update (XLA)"][0] > 0 and groups["update (XLA)"][1] == 0, out
    assert "learners' weights: 2 x 1,111,946 floats" in out
    assert "at least 9 passes over them per iteration" in out


def test_profile_step_rejects_bad_arguments():
    proc = run_tool("tools/profile_step.py", "--learner-momentum", "1.5")
    assert proc.returncode == 2 and "--learner-momentum" in proc.stderr


def test_ab_step_times_each_variant_side_by_side():
    proc = run_tool("tools/ab_step.py", "--k", "2", "--rounds", "1", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {cells[0]: cells[1:] for cells in
            ([c.strip() for c in r.strip("|").split("|")] for r in table_rows(proc.stdout))}
    assert list(rows) == ["default", "no-xla-update", "one-launch", "momentum-0"]
    # LeNet with 2 learners: the convolutions join the 1024x1024 dense layer in the first group.
    assert rows["default"][0] == "2" and rows["one-launch"][0] == "1"
    assert all(float(v) > 0 for cells in rows.values() for v in cells[1:])


def test_ab_step_rejects_bad_arguments():
    proc = run_tool("tools/ab_step.py", "--steps", "0")
    assert proc.returncode == 2 and "--steps" in proc.stderr
