"""The reproduction study: Fashion-MNIST by name, per-point grids, equal budgets, the driver end to end."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

import crossbow_tf.compare as study
from crossbow_tf.data import load_dataset
from crossbow_tf.compare.loops import study_items
from crossbow_tf.errors import ConfigError, DataError
from crossbow_tf.results import first_reaching, reaches
from forking import forked_runs  # noqa: F401  (a fixture)

# Training processes are forked from a server that imported TensorFlow once (tests/forking.py).
pytestmark = pytest.mark.usefixtures("forked_runs")
from test_data_formats import write_mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fashion_dir(tmp_path, n_train=256, n_test=64, seed=0):
    """Tiny IDX files in Fashion-MNIST's (= MNIST's) format: a learnable two-pattern task."""
    rng = np.random.default_rng(seed)

    def split(n):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
        for i, label in enumerate(y):   # a bright bar whose row tells the class
            x[i, 2 + 2 * label: 4 + 2 * label, :] = 250
        return x, y
    directory = str(tmp_path / "fashion")
    write_mnist(directory, split(n_train), split(n_test), compress=True)
    return directory


def test_fashion_mnist_loads_from_data_dir(tmp_path):
    d = fashion_dir(tmp_path)
    source = load_dataset("fashion_mnist", d)
    assert source.name == "fashion_mnist" and source.train.size == 256 and source.test.size == 64
    assert source.input_shape == (28, 28, 1) and source.num_classes == 10
    x, _ = next(iter(source.train.dataset.batch(4)))
    assert float(np.max(x)) <= 1.0 and x.dtype.name == "float32"


def test_fashion_mnist_missing_says_how_to_install(tmp_path, monkeypatch):
    from crossbow_tf import config
    how = config.DEFAULT_DATA_DIRS["fashion_mnist"][1]
    monkeypatch.setitem(config.DEFAULT_DATA_DIRS, "fashion_mnist", (str(tmp_path / "not-installed"), how))
    with pytest.raises(DataError, match=r"apt-get install dataset-fashion-mnist.*--data-dir"):
        load_dataset("fashion_mnist")
    with pytest.raises(DataError, match="file not found"):   # a given directory without the files
        load_dataset("fashion_mnist", str(tmp_path))


def test_target_is_compared_at_the_evaluation_resolution():
    as_float32 = float(np.float32(9000 / 10000))          # 0.8999999761581421
    assert as_float32 < 0.90 and reaches(as_float32, 0.90, 10000)
    assert not reaches(float(np.float32(8999 / 10000)), 0.90, 10000)
    assert not reaches(float("nan"), 0.5, 100) and not reaches(None, 0.5, 100)
    evals = [dict(epoch=1, wall_time=1.0, accuracy=float(np.float32(0.8999)), test_examples=10000),
             dict(epoch=2, wall_time=2.0, accuracy=as_float32, test_examples=10000)]
    assert first_reaching(evals, 0.90)["epoch"] == 2


EXPERIMENT = dict(name="tiny", model="lenet", data={"name": "fashion_mnist"}, devices={"logical_cpu": 1},
                  learners_per_device=2, batch_size=16, epochs=2, target_accuracy=0.5, eval_batch_size=64)


def sweep(**series):
    return dict(global_batches=[32, 64], budget=2, search_seeds=[0], seeds=[0], target=0.5, epochs=2,
                series=series)


def plan(section):
    spec = study.parse_study(section, EXPERIMENT)
    return spec, study.plan_study(spec, EXPERIMENT, {"tf_ssgd": {}, "compare": {}, "sweep": {}})


def test_per_point_grids_in_k_and_shapes():
    spec, cells = plan(sweep(
        ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]}),
        sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", "0.5/sqrt(k)"]},
                 points={64: {"grid": [{"algorithm.alpha": 0.1, "learning_rate.base": 0.05},
                                       {"algorithm.alpha": "1/k", "learning_rate.base": 0.02}]}})))
    by = {(c.series.name, c.global_batch): c for c in cells}
    assert [(c.series.name, c.global_batch) for c in cells] == [("ssgd", 32), ("sma", 32), ("ssgd", 64), ("sma", 64)]
    assert [p for _, p, _ in by["sma", 32].trials] == [{"algorithm.alpha": 0.5}, {"algorithm.alpha": 0.3536}]
    assert [p for _, p, _ in by["sma", 64].trials] == [
        {"algorithm.alpha": 0.1, "learning_rate.base": 0.05}, {"algorithm.alpha": 0.25, "learning_rate.base": 0.02}]
    exp, _ = by["sma", 64].trials[1][2][0]
    assert exp["learners_per_device"] == 4 and exp["batch_size"] == 16 and exp["algorithm"]["alpha"] == 0.25
    exp, opts = by["ssgd", 64].trials[0][2][0]
    assert exp["batch_size"] == 64 and opts is not None and by["ssgd", 64].k == 1


def test_interleaved_order_lets_the_series_take_turns_run_by_run():
    series = dict(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]}),
                  sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]}))
    by_series, _ = plan(dict(sweep(**series), seeds=[0, 1]))
    spec, cells = plan(dict(sweep(**series), seeds=[0, 1], order="interleaved"))
    keys = [item.key for item in study_items(spec, cells)[0]]
    assert keys == ["ssgd/G32/t00_s0", "sma/G32/t00_s0", "ssgd/G32/t01_s0", "sma/G32/t01_s0",
                    "ssgd/G32/best_s1", "sma/G32/best_s1",
                    "ssgd/G64/t00_s0", "sma/G64/t00_s0", "ssgd/G64/t01_s0", "sma/G64/t01_s0",
                    "ssgd/G64/best_s1", "sma/G64/best_s1"]
    # The same runs as the default order (each series' trials one after another), only reordered.
    default = [item.key for item in study_items(by_series, cells)[0]]
    assert default[:4] == ["ssgd/G32/t00_s0", "ssgd/G32/t01_s0", "sma/G32/t00_s0", "sma/G32/t01_s0"]
    assert sorted(default) == sorted(keys)
    with pytest.raises(ConfigError, match="sweep.order: expected series or interleaved, got 'random'"):
        plan(dict(sweep(**series), order="random"))


def test_equal_budgets_are_enforced():
    with pytest.raises(ConfigError, match=r"sweep.series.sma \(global batch 32\): the grid has 1 point\(s\), "
                                          r"fewer than the budget of 2"):
        plan(sweep(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]}),
                   sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k"]})))
    # A larger grid is cut to the budget, so every searched series gets exactly the same number.
    _, cells = plan(sweep(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2, 0.3, 0.4]}),
                          sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]})))
    assert set(study.searched_budgets(cells).values()) == {2}
    # A point's own budget holds for every searched series there: a second round at one point.
    four = dict(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2, 0.3, 0.4]}),
                sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1, 0.2]}))
    spec, cells = plan(dict(sweep(**four), point_budgets={64: 3}))
    assert study.searched_budgets(cells) == {("ssgd", 32): 2, ("sma", 32): 2, ("ssgd", 64): 3, ("sma", 64): 3}
    assert spec.describe_budget() == "2 trials per searched series per point (3 at G=64)"
    with pytest.raises(ConfigError, match=r"sweep.series.sma \(global batch 64\): the grid has 3 point\(s\), "
                                          r"fewer than the budget of 4"):
        plan(dict(sweep(**four), point_budgets={64: 4}))
    with pytest.raises(ConfigError, match=r"sweep.point_budgets: 128 is not a point of the study \(\[32, 64\]\)"):
        plan(dict(sweep(**four), point_budgets={128: 3}))
    with pytest.raises(ConfigError, match=r"sweep.point_budgets.64: expected a positive int, got 0"):
        plan(dict(sweep(**four), point_budgets={64: 0}))
    with pytest.raises(ConfigError, match="an untuned series runs one setting"):
        plan(sweep(ssgd=dict(method="tf_ssgd", untuned=True, grid={"learning_rate.base": [0.1]}),
                   sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]})))
    with pytest.raises(ConfigError, match=r"sma.batch_size \(per learner\)"):
        plan(sweep(sma=dict(method="sma", grid={"algorithm.alpha": ["1/k", 0.1]})))
    with pytest.raises(ConfigError, match="sweep.notes: expected a list of sentences"):
        plan(dict(sweep(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]})), notes="one line"))
    with pytest.raises(ConfigError, match="48 is not a point of the study"):
        plan(sweep(sma=dict(method="sma", batch_size=16, points={48: {}}, grid={"algorithm.alpha": ["1/k", 0.1]})))


def test_reproduce_end_to_end_on_tiny_data(tmp_path):
    data = fashion_dir(tmp_path)
    doc = dict(EXPERIMENT, tf_ssgd={"reference_batch": 32}, sweep=dict(
        global_batches=[32, 64], budget=1, search_seeds=[0], seeds=[0], target=0.3, epochs=2, timeout=600,
        notes=["The S-SGD grid was   chosen first."],
        series=dict(ssgd=dict(method="tf_ssgd", fixed={"tf_ssgd.lr_scaling": "linear"},
                              grid={"learning_rate.base": [0.05]}),
                    sma=dict(method="sma", batch_size=16,
                             grid=[{"algorithm.alpha": "1/k", "learning_rate.base": 0.05}]))))
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(doc))
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "crossbow_tf.reproduce", "--config", str(config), "--out", str(out),
           "--data-dir", data, "--bench-rounds", "1", "--bench-examples", "64", "--bn-epochs", "1"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ETA" in proc.stdout
    report = (out / "report.md").read_text()
    for heading in ("## Verdict", "## Half 1", "## Half 2", "## The product", "## BatchNorm", "## Search trials"):
        assert heading in report
    assert "4 of 4 training runs finished" in report and "partial" not in report
    assert "Protocol notes (from the config): The S-SGD grid was chosen first." in report
    for plot in ("epochs_vs_G.png", "tta_vs_G.png", "accuracy_vs_epochs_largest_G.png"):
        assert (out / plot).stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert [v["claim"] for v in summary["verdict"]][0].startswith("S-SGD's epochs")
    assert set(summary["bench"]) == {"b16@32", "b16@64"}
    sma_run = json.loads((out / "runs" / "sma" / "G64" / "t00_s0.json").read_text())
    assert sma_run["num_learners"] == 4 and sma_run["config"]["data"]["data_dir"] == data
    e = sma_run["evaluations"][0]
    assert 0 <= e["learner_accuracy"] <= 1 and e["learner_distance"] > 0 and e["test_examples"] == 64
    bn = json.loads(next((out / "runs" / "bn").glob("*.json")).read_text())
    assert bn["config"]["model"] == "lenet_bn" and "accuracy_bn_recomputed" in bn["evaluations"][0]
    # Resuming reruns nothing.
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done before") == 6 and "ETA" not in again.stdout   # 4 runs, the bench, bn


def test_data_dir_reaches_every_run_of_every_tool(tmp_path):
    import crossbow_tf.compare as harness
    data_dir = str(tmp_path / "fm")   # a directory that is there: the tools refuse one that is not
    os.mkdir(data_dir)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(dict(EXPERIMENT, compare=dict(
        budget=1, seeds=[0], methods={"sma": {"grid": {"learning_rate.base": [0.05]}},
                                      "tf_ssgd": {"grid": {"learning_rate.base": [0.05]}}}),
        sweep=sweep(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]}),
                    sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]})))))
    experiment, sections = harness.load_harness_config(str(config), data_dir)
    spec = harness.parse_compare(sections["compare"], experiment)
    for _, trials in harness.plan_compare(spec, experiment, sections):
        for _, _, configs in trials:
            assert all(exp["data"]["data_dir"] == data_dir for exp, _ in configs.values())
    study_spec = study.parse_study(sections["sweep"], experiment)
    for cell in study.plan_study(study_spec, experiment, sections):
        assert all(exp["data"]["data_dir"] == data_dir for _, _, c in cell.trials for exp, _ in c.values())
    # The sweep command (here a checkout's tools/sweep.py) hands a study-form sweep: section to reproduce.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sweep.py"), "--config", str(config),
                           "--out", str(tmp_path / "s"), "--data-dir", data_dir, "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sma G=64 k=4 t01: alpha=0.1" in proc.stdout and "training runs (at most), budget 2" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "crossbow_tf.compare.sweep", "--config", str(config),
                          "--learners", "4", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "apply to the one-grid sweep form" in bad.stderr
    assert not (tmp_path / "s").exists()


def test_a_finished_run_is_reused_when_only_defaults_were_added():
    import crossbow_tf.compare as harness
    full, _ = harness.run_config(EXPERIMENT, {"tf_ssgd": {}}, "tf_ssgd", {}, seed=0, target=0.5, epochs=2, where="t")
    new = yaml.safe_dump(dict(full, tf_ssgd={"lr_scaling": "linear"}), sort_keys=False)
    older = dict(full, tf_ssgd={"lr_scaling": "linear"})
    del older["collapse_epochs"], older["learner_diagnostics"]       # keys a later version added, at their defaults
    assert harness.same_run(yaml.safe_dump(older, sort_keys=False), new)
    changed = dict(older, seed=1)
    assert not harness.same_run(yaml.safe_dump(changed, sort_keys=False), new)
    assert not harness.same_run(yaml.safe_dump(dict(older, tf_ssgd={}), sort_keys=False), new)
    assert not harness.same_run("model: [", new)


def _stats(epochs, accuracy, tta=None, images_per_second=1000.0, seeds=3):
    """A finished cell's statistics as crossbow_tf.compare.study_report.cell_stats gives them (epochs None: never reached)."""
    reached = seeds if epochs is not None else 0
    return dict(seeds=seeds, of=seeds, complete=True, reached=reached, collapsed=0, diverged=0,
                epochs=(epochs, epochs, epochs), tta=(tta, tta, tta), best_accuracy=(accuracy, accuracy - 0.01, accuracy),
                images_per_second=(images_per_second,) * 3, setting="fixed setting")


def test_verdict_rows_follow_the_numbers_when_nothing_or_only_sma_reaches_the_largest_batch():
    from crossbow_tf.compare import study_report
    spec, cells = plan(sweep(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]}),
                             sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]})))
    bench = {(16, 64): dict(sma=500.0, keras_global=1000.0)}
    small = {("ssgd", 32): _stats(2, 0.6, tta=10.0), ("sma", 32): _stats(2, 0.6, tta=20.0)}

    # Neither reaches the target at G=64: no epochs ratio exists, so there is no projection, and the
    # rows say which ended higher at the cap.
    rows, _ = study_report.verdict(spec, cells, {**small, ("ssgd", 64): _stats(None, 0.48, images_per_second=900.0),
                                                    ("sma", 64): _stats(None, 0.41, images_per_second=450.0)}, bench)
    by = {claim.split()[0]: (v, numbers) for claim, v, numbers, _ in rows}
    assert by["S-SGD's"][0] == "reproduced"          # 2 epochs at G=32, never at G=64
    assert by["SMA's"][0] == "not reproduced" and "sma 0.4100 [0.4000–0.4100]" in by["SMA's"][1]
    assert by["k"] == ("not reproduced on this CPU; GPU claim not testable here", "b=16 G=64: 0.50x")
    assert by["TTA"][0] == "not reproduced at G=64 on this CPU; no projection"
    assert "neither method reaches 50% in 2 epochs" in by["TTA"][1]
    assert "images/s (median): ssgd 900, sma 450" in by["TTA"][1]

    # SMA reaches at G=64 in as many epochs as at the small batch and S-SGD never does: SMA stays near
    # small-batch training, and the projection (S-SGD unreached) counts as reproduced.
    rows, tta = study_report.verdict(spec, cells, {**small, ("ssgd", 64): _stats(None, 0.48),
                                                          ("sma", 64): _stats(2, 0.55, tta=30.0)}, bench)
    by = {claim.split()[0]: (v, numbers) for claim, v, numbers, _ in rows}
    assert by["SMA's"][0] == "reproduced"
    assert by["TTA"][0] == "not reproduced on this CPU; projected where half 2 holds: reproduced"
    assert "S-SGD never reached the target at G=[64] while SMA did" in by["TTA"][1]
    assert tta == [(32, 0.5, 1.0, 2, 2), (64, None, None, float("inf"), 2)]

    # Until every series has finished the largest G, the TTA claim is not decided.
    rows, _ = study_report.verdict(spec, cells, {**small, ("ssgd", 64): _stats(None, 0.48)}, bench)
    assert [v for claim, v, _, _ in rows if claim.startswith("TTA")] == ["not yet measured"]


def test_a_study_of_one_global_batch_leaves_the_claims_across_g_unmeasured():
    # Comparing G with itself read "not reproduced" (S-SGD's 9 epochs at G=512 did not grow over its
    # 9 epochs at G=512); a study of one G cannot speak to a claim across G.
    from crossbow_tf.compare import study_report
    spec, cells = plan(dict(sweep(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]}),
                                  sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]})),
                            global_batches=[64]))
    rows, _ = study_report.verdict(spec, cells, {("ssgd", 64): _stats(2, 0.6, tta=10.0),
                                                 ("sma", 64): _stats(None, 0.41)}, {})
    by = {claim.split()[0]: (v, numbers) for claim, v, numbers, _ in rows}
    assert by["S-SGD's"] == by["SMA's"] == ("not measured", "one global batch: G=64")
    assert by["TTA"][0] != "not measured"     # a claim at equal G still has its verdict


def test_a_run_from_before_the_stability_guard_is_the_same_run_with_allow_unstable():
    """allow_unstable only permits: a finished run written before the key existed (and past the bound)
    is reused when the series now sets it."""
    import crossbow_tf.compare as harness
    unstable = {"learners_per_device": 32, "algorithm.alpha": 0.115}
    with pytest.raises(ConfigError, match=r"the central loop is unstable: its central step k\*alpha = 32\*0.115"):
        harness.run_config(EXPERIMENT, {}, "sma", unstable, seed=0, target=0.5, epochs=2, where="t")
    new, _ = harness.run_config(EXPERIMENT, {}, "sma", dict(unstable, **{"algorithm.allow_unstable": True}),
                                seed=0, target=0.5, epochs=2, where="t")
    older = json.loads(json.dumps(new))
    for key in ("allow_unstable", "central_step", "sync_period", "period", "outer_learning_rate"):
        del older["algorithm"][key]
    assert harness.same_run(yaml.safe_dump(older, sort_keys=False), yaml.safe_dump(new, sort_keys=False))
    older["algorithm"]["alpha"] = 0.1
    assert not harness.same_run(yaml.safe_dump(older, sort_keys=False), yaml.safe_dump(new, sort_keys=False))


def test_beyond_crossbow_verdict_compares_each_averaging_method_with_tuned_ssgd():
    from crossbow_tf.compare import study_report
    spec, cells = plan(sweep(
        ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.1, 0.2]}),
        sma=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]}),
        decoupled=dict(method="sma", batch_size=16, beyond_crossbow=True, global_batches=[64],
                       grid=[{"algorithm.alpha": 0.3, "algorithm.central_step": 1.0},
                             {"algorithm.alpha": 0.5, "algorithm.central_step": 1.0}]),
        local=dict(method="localsgd", batch_size=16, global_batches=[64],
                   grid={"algorithm.period": [1, 4]})))
    assert [c.series.beyond_crossbow for c in cells if c.global_batch == 64] == [False, False, True, True]
    states = {(c.series.name, c.global_batch): dict(cell=c, trials=[], final={}, searched=True, best=None)
              for c in cells}
    finished = {("ssgd", 64): _stats(None, 0.48), ("sma", 64): _stats(None, 0.41),
                ("decoupled", 64): _stats(None, 0.47), ("local", 64): _stats(None, 0.50)}
    rows, tables = study_report.beyond_crossbow(spec, cells, finished, states)
    [(claim, verdict, numbers, _)] = rows                       # only G=64 has a method beyond Crossbow
    assert claim.endswith("sooner than tuned S-SGD at G=64")
    assert verdict == "yes: local"                              # S-SGD never reaches: a higher best accuracy
    assert "tuned S-SGD ssgd not reached, best acc 0.4800 [0.4700–0.4800]" in numbers
    assert [row[0] for row in tables[64]] == ["ssgd (tf_ssgd)", "sma (SMA, b=16)", "decoupled (SMA beyond Crossbow, b=16)",
                                             "local (local SGD, b=16)"]
    # S-SGD reaches in 2 epochs: only fewer epochs count.
    rows, _ = study_report.beyond_crossbow(spec, cells, {**finished, ("ssgd", 64): _stats(2, 0.55),
                                                         ("local", 64): _stats(2, 0.56), ("decoupled", 64): _stats(1, 0.52)},
                                           states)
    assert rows[0][1] == "yes: decoupled"
    rows, _ = study_report.beyond_crossbow(spec, cells, {k: v for k, v in finished.items() if k[0] != "local"}, states)
    assert rows[0][1] == "not yet measured"
    # The paper's rows leave the methods beyond Crossbow out.
    paper, _ = study_report.verdict(spec, cells, {**finished, ("ssgd", 32): _stats(2, 0.6), ("sma", 32): _stats(2, 0.6),
                                                  ("decoupled", 64): _stats(1, 0.9)}, {})
    assert "decoupled" not in " ".join(numbers for _, _, numbers, _ in paper)
