"""How the study report words the learners' distance to z and the study's duration."""
import json

from crossbow_tf.compare.study_report import RESTARTED, _duration_line, distance_text, training_time


def test_local_sgd_zero_distance_says_the_learners_just_restarted_from_z():
    assert distance_text("localsgd", 0.0) == RESTARTED
    assert "restarts every learner from z" in RESTARTED


def test_a_zero_distance_of_sma_and_a_nonzero_one_of_local_sgd_are_numbers():
    assert distance_text("sma", 0.0) == "0.000"
    assert distance_text("localsgd", 1.1349) == "1.135"
    assert distance_text("localsgd", 1.1349, "{:.3g}") == "1.13"
    assert distance_text("sma", None) is None


def test_a_resumed_study_keeps_a_copy_of_the_config_its_report_was_built_from(tmp_path):
    """A study resumed with a config that gained series (or notes) is reported from that config,
    so the folder's config.yaml must be that one, not the first start's."""
    import subprocess
    import sys

    import yaml
    from test_reproduce import EXPERIMENT
    doc = dict(EXPERIMENT, sweep=dict(global_batches=[32], budget=1, search_seeds=[0], seeds=[0], target=0.3,
                                      epochs=1, notes=["first start"],
                                      series=dict(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.05]}))))
    out = tmp_path / "report"
    for notes, resume in ((["first start"], []), (["resumed with a new note"], ["--resume"])):
        doc["sweep"]["notes"] = notes
        config = tmp_path / "study.yaml"
        config.write_text(yaml.safe_dump(doc))
        proc = subprocess.run([sys.executable, "-m", "crossbow_tf.reproduce", "--config", str(config), "--out",
                               str(out), "--phases", "report", *resume], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    copied = yaml.safe_load((out / "config.yaml").read_text())
    assert copied["sweep"]["notes"] == ["resumed with a new note"]


def test_the_duration_sums_every_finished_runs_training_time_the_limits_phases_too(tmp_path):
    runs = tmp_path / "runs" / "ssgd" / "G512"
    (runs / "net-1gbit").mkdir(parents=True)
    for path, total in ((runs / "t00_s0.json", 3000.0), (runs / "net-1gbit" / "t00_s0.json", 1830.5),
                        (runs / "t01_s0.json", None)):       # a results file without the figure
        path.write_text(json.dumps({"total_time": total} if total else {"evaluations": []}))
    (runs / "t00_s0.yaml").write_text("total_time: 99\n")
    assert training_time(str(tmp_path)) == (2, 4830.5)
    assert _duration_line(str(tmp_path))[0].startswith("- measured duration: 2 runs trained for 1 h 21 min in all")
    assert _duration_line(str(tmp_path / "empty")) == []
    # The BatchNorm phase's run is outside the progress line's planned runs: the line names it.
    (tmp_path / "runs" / "bn").mkdir()
    (tmp_path / "runs" / "bn" / "lenet_bn_G512_s0.json").write_text(json.dumps({"total_time": 600.0}))
    assert training_time(str(tmp_path), "bn") == (1, 600.0)
    assert _duration_line(str(tmp_path))[0].startswith(
        "- measured duration: 3 runs (the BatchNorm phase's 1 included) trained for 1 h 31 min in all")
