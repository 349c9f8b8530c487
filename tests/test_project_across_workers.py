"""tools/project_across_workers.py: the ring all-reduce projection of a multi-worker study beyond this
machine. The formula is checked against the equations written out here, the closed-form crossover
against the point where the two projected times cross, and the tool end to end on a small study
folder of hand-made runs shaped like the real ones (no TensorFlow anywhere)."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from crossbow_tf.distribute import traffic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "project_across_workers.py")
_spec = importlib.util.spec_from_file_location("project_across_workers", TOOL)
project = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(project)

ALPHA = 50e-6
GBIT = 1e9


def inputs(name="x", method="localsgd", epochs=3.0, iterations_per_epoch=100, compute_ms=40.0, payload=4e6,
           syncs=None, reached=True, workers=2):
    return project.Inputs(
        name=name, method=method, trial="t00", setting="", choice="", runs=1, reached=int(reached), epochs=epochs,
        reached_target=reached, iterations_per_epoch=iterations_per_epoch, workers=workers, compute_ms=compute_ms,
        compute_source="", step_ms=compute_ms, payload_bytes=payload,
        syncs=int(epochs * iterations_per_epoch) if syncs is None else syncs, schedule="", measured_tta=None, files=())


def hand_time(epochs, iterations_per_epoch, compute_ms, measured_workers, payload, syncs, workers, bits, alpha):
    """The issue's model, written out: compute at fixed global batch scaled by W0 / W, then every ring
    all-reduce's 2 (W - 1) / W x payload per worker at the bandwidth and 2 (W - 1) latencies."""
    compute_seconds = epochs * iterations_per_epoch * (compute_ms / 1000.0) * measured_workers / workers
    per_all_reduce = (2.0 * (workers - 1) / workers) * payload * 8.0 / bits + 2.0 * (workers - 1) * alpha
    return compute_seconds + syncs * per_all_reduce


@pytest.mark.parametrize("workers,bits", [(2, 1 * GBIT), (8, 1 * GBIT), (32, 10 * GBIT), (8, 100e6)])
def test_projected_time_is_the_ring_all_reduce_formula(workers, bits):
    x = inputs(epochs=3.0, iterations_per_epoch=100, compute_ms=40.0, payload=4e6, syncs=75)
    got = project.projected_time(x, workers, bits, ALPHA)
    want = hand_time(3, 100, 40.0, 2, 4e6, 75, workers, bits, ALPHA)
    assert got == pytest.approx(want, rel=1e-12)
    # One case in plain numbers: 8 workers at 1 Gbit/s: 3.0 s of compute, 75 x (56 ms + 0.7 ms).
    if (workers, bits) == (8, GBIT):
        assert got == pytest.approx(3.0 + 75 * (0.056 + 0.0007), rel=1e-12)
    # The terms a + b / B are the same time.
    a, b = project.time_terms(x, workers, ALPHA)
    assert a + b / bits == pytest.approx(got, rel=1e-12)
    # Each input moves the projection: twice the payload, twice the compute.
    assert project.projected_time(inputs(payload=8e6, syncs=75), workers, bits, ALPHA) > got * 1.01
    assert project.projected_time(inputs(compute_ms=80.0, syncs=75), workers, bits, ALPHA) > got * 1.01


def _crossing_by_bisection(x, ref, workers, low=1e3, high=1e15):
    """The bandwidth where the projected times of X and REF are equal, found numerically (log scale)."""
    def gap(bits):
        return project.projected_time(x, workers, bits, ALPHA) - project.projected_time(ref, workers, bits, ALPHA)
    assert gap(low) * gap(high) < 0, "no crossing in the bracket"
    for _ in range(200):
        mid = math.sqrt(low * high)
        if gap(low) * gap(mid) <= 0:
            high = mid
        else:
            low = mid
    return math.sqrt(low * high)


@pytest.mark.parametrize("workers", [2, 8, 32])
def test_the_closed_form_crossover_is_where_the_projected_times_cross(workers):
    # Period 16 with 2 extra epochs against S-SGD synchronising every iteration.
    ssgd = inputs("ssgd", "tf_ssgd", epochs=6, compute_ms=100.0, payload=4.45e6)
    period16 = inputs("h16", epochs=8, compute_ms=110.0, payload=4.45e6, syncs=8 * 100 // 16)
    rate, how = project.crossover(project.time_terms(period16, workers, ALPHA), project.time_terms(ssgd, workers, ALPHA))
    assert how == "sooner below"
    assert rate == pytest.approx(_crossing_by_bisection(period16, ssgd, workers), rel=1e-9)
    t_x, t_s = (project.projected_time(i, workers, rate, ALPHA) for i in (period16, ssgd))
    assert t_x == pytest.approx(t_s, rel=1e-9)
    # Below the crossover the period is sooner, above it S-SGD is, by more than the tolerance.
    for bits, sooner in ((rate / 4, True), (rate * 4, False)):
        gap = project.projected_time(period16, workers, bits, ALPHA) - project.projected_time(ssgd, workers, bits, ALPHA)
        assert abs(gap) > 1e-3 * t_s and (gap < 0) == sooner


def test_the_crossover_cases_with_no_crossing_or_the_other_direction():
    ssgd = inputs("ssgd", "tf_ssgd", epochs=6, compute_ms=100.0)
    # Fewer bits and no more compute: sooner everywhere; more of both: never.
    assert project.crossover(project.time_terms(inputs(epochs=6, compute_ms=90.0, syncs=60), 8, ALPHA),
                             project.time_terms(ssgd, 8, ALPHA)) == (None, "always sooner")
    assert project.crossover(project.time_terms(inputs(epochs=7, compute_ms=100.0, payload=8e6), 8, ALPHA),
                             project.time_terms(ssgd, 8, ALPHA)) == (None, "never sooner")
    # More bits but less compute (a cheaper step): sooner only above the crossing.
    cheap = inputs(epochs=6, compute_ms=50.0, payload=8e6)
    rate, how = project.crossover(project.time_terms(cheap, 8, ALPHA), project.time_terms(ssgd, 8, ALPHA))
    assert how == "sooner above"
    assert rate == pytest.approx(_crossing_by_bisection(cheap, ssgd, 8), rel=1e-9)
    assert project.crossover(project.time_terms(ssgd, 8, ALPHA), project.time_terms(ssgd, 8, ALPHA)) == (None, "equal")


# ------------------------------------------------------------------------------------- a small study

EXPERIMENT = dict(name="tiny-2workers", model="lenet", data={"name": "fashion_mnist"}, devices={"logical_cpu": 1},
                  learners_per_device=2, batch_size=16, epochs=3, target_accuracy=0.8, eval_batch_size=64)
SERIES = dict(
    ssgd_2w=dict(method="tf_ssgd", workers=2, grid={"learning_rate.base": [0.05]}),
    localsgd_h4_2w=dict(method="localsgd", workers=2, batch_size=16, fixed={"algorithm.period": 4},
                        grid={"learning_rate.base": [0.05]}),
    postlocal_h4_2w=dict(method="localsgd", workers=2, batch_size=16,
                         fixed={"algorithm.period": 4, "algorithm.local_after_epochs": 1},
                         grid={"learning_rate.base": [0.05]}))
G = 64
I = 100                  # iterations per epoch
PAYLOAD = 4.45e6         # LeNet's all-reduce vector, as measured
# Per series: (accuracy per epoch, algorithm, compute ms, collective ms per all-reduce (None: stock), step ms)
RUNS = dict(
    ssgd_2w=([0.7, 0.85, 0.86], dict(name="ssgd", momentum=0.9), None, None, 150.0),
    localsgd_h4_2w=([0.7, 0.75, 0.82], dict(name="localsgd", momentum=0.9, period=4, outer_learning_rate=1.0),
                    120.0, 22.25, None),
    postlocal_h4_2w=([0.7, 0.76, 0.81], dict(name="localsgd", momentum=0.9, period=4, local_after_epochs=1,
                                             outer_learning_rate=1.0), 125.0, 22.25, None))


def schedule_syncs(algorithm, iterations):
    """The all-reduces of ITERATIONS by the rule's documented schedule, counted here by hand."""
    period, after = algorithm.get("period", 1), algorithm.get("local_after_epochs") or 0
    return sum(1 for t in range(iterations) if t < after * I or (t + 1) % period == 0)


def fake_run(accuracies, algorithm, compute_ms, collective_ms, step_ms, epochs=None):
    """A results mapping shaped like a real run's (the keys the tools read), to the target or the cap."""
    reached = next((e + 1 for e, a in enumerate(accuracies) if a >= EXPERIMENT["target_accuracy"]), len(accuracies))
    epochs = epochs or reached
    iterations = epochs * I
    syncs = schedule_syncs(algorithm, iterations)
    if collective_ms is None:
        cross = traffic.summary(syncs, PAYLOAD, None, 2, iterations, step_ms * iterations / 1000)
    else:
        collective = syncs * collective_ms / 1000
        cross = traffic.summary(syncs, PAYLOAD, collective, 2, iterations, compute_ms * iterations / 1000 + collective)
    per_epoch = cross["step_ms_per_iteration"] * I / 1000
    evaluations = [dict(epoch=e, iteration=e * I, examples=e * I * G, wall_time=e * per_epoch, accuracy=accuracies[e - 1],
                        loss=1.0 - accuracies[e - 1]) for e in range(1, epochs + 1)]
    return dict(method="tf_ssgd" if algorithm["name"] == "ssgd" else "localsgd",
                config=dict(EXPERIMENT, algorithm=algorithm), environment={}, evaluations=evaluations,
                iterations_per_epoch=I, workers=2, global_batch=G, num_learners=4, cross_worker=cross)


def write_study(folder, runs=True, series=SERIES, budget=1):
    folder.mkdir()
    doc = dict(EXPERIMENT, sweep=dict(global_batches=[G], budget=budget, search_seeds=[0], seeds=[0], target=0.8,
                                      network_limits=["1gbit", "100mbit"],
                                      epochs=3, series=series))
    (folder / "config.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    for name, (acc, algorithm, compute, collective, step) in RUNS.items() if runs else ():
        path = folder / "runs" / name / f"G{G}" / "t00_s0.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(fake_run(acc, algorithm, compute, collective, step)))
    return folder


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return write_study(tmp_path_factory.mktemp("projection") / "study")


def run_tool(*argv):
    return project.main([str(a) for a in argv])


def table_row(text, heading, name):
    section = text[text.index(heading):]
    return next(line for line in section.splitlines() if line.startswith(f"| {name} |"))


def expected_times(workers, bits):
    """Each series' time to target by the formula, from the runs' numbers as written above: S-SGD's
    compute is its step less the loopback transfer at the local-SGD runs' measured ms per byte."""
    per_byte_ms = 22.25 / PAYLOAD      # both local-SGD series: 22.25 ms per all-reduce of PAYLOAD
    ssgd_compute = 150.0 - PAYLOAD * per_byte_ms
    return dict(
        ssgd_2w=hand_time(2, I, ssgd_compute, 2, PAYLOAD, 2 * I, workers, bits, ALPHA),
        localsgd_h4_2w=hand_time(3, I, 120.0, 2, PAYLOAD, 3 * I // 4, workers, bits, ALPHA),
        postlocal_h4_2w=hand_time(3, I, 125.0, 2, PAYLOAD, I + 2 * I // 4, workers, bits, ALPHA))


@pytest.fixture(scope="module")
def projection(study, tmp_path_factory):
    out = tmp_path_factory.mktemp("projection") / "out"
    assert run_tool("--study", study, "--out", out) == 0
    return out


def test_the_tool_writes_the_projection_from_the_runs(projection):
    text = (projection / "projection.md").read_text()
    assert text.startswith("# Beyond this machine: a projection, not a measurement")
    assert "T(W, B) = E * I * c * W0 / W" in text
    # 22.25 ms per all-reduce of 4.45 MB at loopback: 5 ms per MB, 1.6 Gbit/s.
    assert "all-reduce took 5.00 ms per MB sent (median over its runs; 1.60 Gbit/s effective)" in text
    # The measured inputs with their files and the schedules' all-reduce counts.
    for name in RUNS:
        assert f"runs/{name}/G{G}/t00_s0.json" in table_row(text, "## Measured inputs", name)
    assert "| 200 |" in table_row(text, "## Measured inputs", "ssgd_2w")
    assert "| 75 |" in table_row(text, "## Measured inputs", "localsgd_h4_2w")
    assert "| 150 |" in table_row(text, "## Measured inputs", "postlocal_h4_2w")
    # Every cell of every table is the formula's time, and the ratio S-SGD / series.
    for workers in (2, 8, 32):
        heading = f"### {workers} workers"
        for bits in (1 * GBIT, 10 * GBIT, 100 * GBIT):
            want = expected_times(workers, bits)
            for name, t in want.items():
                cell = f"{t:,.0f} s" + ("" if name == "ssgd_2w" else f" ({want['ssgd_2w'] / t:.2f}x)")
                assert cell in table_row(text, heading, name), (workers, bits, name)
    png = (projection / "projection.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_the_crossover_in_the_report_is_the_closed_form(projection):
    text = (projection / "projection.md").read_text()
    # Local SGD with period 4: one more epoch, a quarter of the all-reduces: sooner below B*.
    per_byte_ms = 22.25 / PAYLOAD
    ssgd = inputs("s", "tf_ssgd", epochs=2, iterations_per_epoch=I, compute_ms=150.0 - PAYLOAD * per_byte_ms,
                  payload=PAYLOAD, syncs=200)
    h4 = inputs("h4", epochs=3, iterations_per_epoch=I, compute_ms=120.0, payload=PAYLOAD, syncs=75)
    for workers in (2, 8, 32):
        bits = _crossing_by_bisection(h4, ssgd, workers)
        row = table_row(text, f"### {workers} workers", "localsgd_h4_2w")
        assert f"sooner below {project.bandwidth_words(bits)}" in row


def test_the_check_says_not_measured_yet_without_limit_runs(projection):
    text = (projection / "projection.md").read_text()
    assert "Not measured yet: the study has no runs behind real limits" in text


def test_the_check_compares_the_projection_with_runs_behind_a_limit(tmp_path):
    folder = write_study(tmp_path / "study")
    acc, algorithm, compute, _, _ = RUNS["localsgd_h4_2w"]
    # At 100 Mbit/s the all-reduce of 4.45 MB takes 356 ms by the model; the measured run says 400 ms.
    limited = dict(fake_run(acc, algorithm, compute, 400.0, None), network="100mbit")   # the runner's stamp
    path = folder / "runs" / "localsgd_h4_2w" / f"G{G}" / "net-100mbit" / "t00_s0.json"
    path.parent.mkdir()
    path.write_text(json.dumps(limited))
    # Neither a run of another trial nor one whose results name another network is the chosen trial's.
    other = fake_run(acc, algorithm, compute, 900.0, None)
    (path.parent / "t01_s0.json").write_text(json.dumps(other))
    (path.parent / "t00_s1.json").write_text(json.dumps(dict(other, network="1gbit")))
    out = tmp_path / "out"
    assert run_tool("--study", folder, "--out", out) == 0
    text = (out / "projection.md").read_text()
    row = table_row(text, "## Checked against the measured limits", "localsgd_h4_2w")
    cells = [c.strip() for c in row.strip("|").split("|")]
    per_iteration = 120.0 + 0.25 * (PAYLOAD * 8 / 100e6 * 1000 + 2 * ALPHA * 1000)
    measured = limited["cross_worker"]["step_ms_per_iteration"]
    assert cells[1] == "100mbit"
    assert float(cells[2]) == pytest.approx(per_iteration, abs=0.05)
    assert float(cells[3]) == pytest.approx(measured, abs=0.05)
    assert abs(per_iteration - measured) > 1.0   # the two differ, and the error says by how much
    assert cells[4] == f"{(per_iteration - measured) / measured:+.0%}"
    tta = hand_time(3, I, 120.0, 2, PAYLOAD, 75, 2, 100e6, ALPHA)
    assert cells[5] == f"{tta:.0f}" and cells[6] == f"{limited['evaluations'][-1]['wall_time']:.0f}"
    assert cells[8] == "3" and cells[9] == f"runs/localsgd_h4_2w/G{G}/net-100mbit/t00_s0.json"


def test_a_series_not_reached_is_a_lower_bound_and_a_partial_search_is_provisional(tmp_path):
    # Two trials per series. S-SGD's search has one finished, and it did not reach the target; local
    # SGD's has both, the second worse.
    series = {name: dict(body, grid={"learning_rate.base": [0.05, 0.1]}) for name, body in SERIES.items()}
    folder = write_study(tmp_path / "study", series=series, budget=2)
    path = folder / "runs" / "ssgd_2w" / f"G{G}" / "t00_s0.json"
    path.write_text(json.dumps(fake_run([0.7, 0.75, 0.78], RUNS["ssgd_2w"][1], None, None, 150.0)))
    acc, algorithm, _, collective, _ = RUNS["localsgd_h4_2w"]
    localsgd = folder / "runs" / "localsgd_h4_2w" / f"G{G}"
    (localsgd / "t00_s0.json").write_text(
        json.dumps(fake_run(acc, algorithm, 140.0, collective, None)))   # more compute than S-SGD's at its cap
    (localsgd / "t01_s0.json").write_text(json.dumps(fake_run([0.5, 0.6, 0.7], algorithm, 100.0, collective, None)))
    (folder / "runs" / "postlocal_h4_2w" / f"G{G}" / "t00_s0.json").unlink()
    out = tmp_path / "out"
    assert run_tool("--study", folder, "--out", out) == 0
    text = (out / "projection.md").read_text()
    row = table_row(text, "## Measured inputs", "ssgd_2w")
    assert "not reached (cap 3: a lower bound)" in row and "provisional**: best of the 1 of 2 search trials" in row
    row = table_row(text, "## Measured inputs", "localsgd_h4_2w")
    assert "the study's best trial" in row and "t00_s0.json" in row and "t01" not in row
    assert "No finished run yet: postlocal_h4_2w." in text
    assert table_row(text, "### 8 workers", "ssgd_2w").count("> ") == 3
    # Against a lower bound the series' ratio is a lower bound too, and so is its crossover.
    row = table_row(text, "### 8 workers", "localsgd_h4_2w")
    assert "(> " in row and "sooner below at least" in row


# ------------------------------------------------------------------------------------------ bad inputs

def _bad(capsys, argv, message, written):
    with pytest.raises(SystemExit) as stop:
        code = run_tool(*argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.count("\n") == 1 and err.startswith("project_across_workers: error: ") and message in err, err
    assert "Traceback" not in err
    assert not os.path.exists(written)


@pytest.mark.parametrize("argv,message", [
    (["--workers", "1"], "at least 2"),
    (["--workers", "two"], "invalid int value"),
    (["--bandwidths", "-1"], "a bandwidth must be positive"),
    (["--bandwidths", "nan"], "a bandwidth must be positive"),
    (["--alpha-us", "-5"], "--alpha-us must be zero or positive"),
    (["--global-batch", "128"], "the study's global batches are [64]"),
    (["--colour", "red"], "unrecognized arguments"),
])
def test_bad_flags_are_one_line_and_write_nothing(study, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    _bad(capsys, ["--study", study, "--out", out, *argv], message, out)


def test_a_missing_or_empty_study_folder_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    _bad(capsys, ["--study", tmp_path / "nowhere", "--out", out], "no such study folder", out)
    (tmp_path / "plain").mkdir()
    _bad(capsys, ["--study", tmp_path / "plain", "--out", out], "not a study folder (no config.yaml", out)
    empty = write_study(tmp_path / "empty", runs=False)
    _bad(capsys, ["--study", empty, "--out", out], "no finished multi-worker run yet", out)
    # With --out left to its default, the study's own folder gains nothing either.
    _bad(capsys, ["--study", empty], "no finished multi-worker run yet", empty / "projection.md")
    # A results file without the multi-worker figures (an older run's) is no input to project from.
    run = fake_run(*RUNS["ssgd_2w"])
    del run["cross_worker"]
    path = empty / "runs" / "ssgd_2w" / f"G{G}" / "t00_s0.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run))
    _bad(capsys, ["--study", empty, "--out", out], "no finished multi-worker run yet", out)


def test_a_study_without_several_workers_or_with_a_broken_config_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    one_worker = {name: {k: v for k, v in body.items() if k != "workers"} for name, body in SERIES.items()}
    _bad(capsys, ["--study", write_study(tmp_path / "one", series=one_worker), "--out", out],
         "no series runs on several workers", out)
    broken = write_study(tmp_path / "broken")
    (broken / "config.yaml").write_text("sweep: [unclosed\n")
    _bad(capsys, ["--study", broken, "--out", out], "config.yaml", out)


def test_an_out_that_is_a_file_is_refused_and_kept(study, tmp_path, capsys):
    out = tmp_path / "taken"
    out.write_text("keep me")
    with pytest.raises(SystemExit) as stop:
        raise SystemExit(run_tool("--study", study, "--out", out))
    assert stop.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
    assert out.read_text() == "keep me"


def test_the_command_line_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, TOOL, "--study", str(tmp_path / "nowhere")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"project_across_workers: error: {tmp_path / 'nowhere'}: no such study folder"]
