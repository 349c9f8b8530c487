"""Issue 29: crossbow-reproduce's limits phase (sweep.network_limits) runs each multi-worker series'
best trial of the sweep again, every worker behind each limit, as trials of the same study; the
report's across-workers verdict has a column per network."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from crossbow_tf.compare import across_workers, netns, reproduce, trials as trials_lib
from crossbow_tf.compare.loops import limit_plan, study_items
from crossbow_tf.compare.runner import Job, Runner, prepare_out_dir
from crossbow_tf.errors import ConfigError
from forking import forked_runs  # noqa: F401  (a fixture)

# Training processes are forked from a server that imported TensorFlow once (tests/forking.py).
pytestmark = pytest.mark.usefixtures("forked_runs")
from test_reproduce import EXPERIMENT, fashion_dir, plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def two_worker_sweep(**extra):
    """Two searched 2-worker series and a 1-worker one at G=32 and 64, seeds 0-2."""
    return dict(dict(global_batches=[32, 64], budget=2, search_seeds=[0], seeds=[0, 1, 2], target=0.5, epochs=2,
                     series=dict(ssgd_2w=dict(method="tf_ssgd", workers=2, grid={"learning_rate.base": [0.1, 0.2]}),
                                 local_2w=dict(method="localsgd", workers=2, batch_size=16,
                                               grid={"learning_rate.base": [0.05, 0.1]}),
                                 sma_1w=dict(method="sma", batch_size=16, grid={"algorithm.alpha": ["1/k", 0.1]}))),
                **extra)


def test_network_limits_are_validated_with_the_limits_own_parser():
    spec, _ = plan(two_worker_sweep(network_limits=["1gbit", "100mbit/1ms"]))
    assert spec.network_limits == [netns.Limit("1gbit", "0ms"), netns.Limit("100mbit", "1ms")]
    assert [limit.label() for limit in spec.network_limits] == ["1gbit", "100mbit-1ms"]   # folder names: no '/'
    assert plan(two_worker_sweep())[0].network_limits == []
    for bad, message in ((["10xbit"], r"sweep.network_limits: '10xbit': expected RATE\[/DELAY\], e.g. 100mbit/1ms"),
                         ("1gbit", r"sweep.network_limits: expected a list of limits RATE\[/DELAY\]"),
                         (["1gbit", "1gbit/0ms"], "sweep.network_limits: a limit is listed twice")):
        with pytest.raises(ConfigError, match=message):
            plan(two_worker_sweep(network_limits=bad))


def test_bad_network_limits_are_one_line_and_exit_2_with_nothing_written(tmp_path, capsys):
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(dict(EXPERIMENT, sweep=two_worker_sweep(network_limits=["fast"]))))
    code = reproduce.main(["--config", str(config), "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "sweep.network_limits: 'fast': expected RATE[/DELAY]" in err, err
    assert not (tmp_path / "out").exists()


def test_the_limits_phase_plans_every_multi_worker_cells_best_trial_on_every_seed_after_the_sweep():
    spec, cells = plan(two_worker_sweep(network_limits=["1gbit", "100mbit"]))
    sweep_items, _, groups = study_items(spec, cells)
    items, _, _ = study_items(spec, cells, limits=True)
    assert items[:len(sweep_items)] == sweep_items      # after every run of the sweep
    limits = items[len(sweep_items):]
    assert len(limits) == 2 * 2 * 2 * 3                 # limits x multi-worker series x points x seeds
    assert limits[:3] == [trials_lib.Item(f"ssgd_2w/G32/net-1gbit/best_s{s}", "ssgd_2w/G32", s, replicate=True)
                          for s in (0, 1, 2)]
    assert {item.key.split("/")[0] for item in limits} == {"ssgd_2w", "local_2w"}   # sma_1w has no network
    assert {item.key.split("/")[2] for item in limits} == {"net-1gbit", "net-100mbit"}
    # Each is claimable once its cell's search has finished: a replication of that cell's group.
    assert all(item.replicate and item.group in groups and item.key.startswith(item.group + "/net-")
               for item in limits)
    # Interleaved: within a limit and seed the series take turns.
    spec, cells = plan(two_worker_sweep(network_limits=["100mbit"], order="interleaved"))
    assert [run.item.key for run in limit_plan(spec, cells)][:3] == [
        "ssgd_2w/G32/net-100mbit/best_s0", "local_2w/G32/net-100mbit/best_s0", "ssgd_2w/G64/net-100mbit/best_s0"]


def test_a_study_without_network_limits_plans_exactly_as_before():
    spec, cells = plan(two_worker_sweep())
    with_flag, _, _ = study_items(spec, cells, limits=True)
    without, _, _ = study_items(spec, cells)
    assert limit_plan(spec, cells) == [] and with_flag == without
    assert trials_lib.fingerprint(with_flag) == trials_lib.fingerprint(without)
    # A study with limits planned without the phase (--phases sweep report) keeps the sweep's plan.
    limited, limited_cells = plan(two_worker_sweep(network_limits=["100mbit"]))
    assert trials_lib.fingerprint(study_items(limited, limited_cells)[0]) == trials_lib.fingerprint(without)


def test_the_phase_says_in_one_line_what_it_leaves_out(monkeypatch):
    class Args:
        phases, phases_given = ["sweep", "limits", "report"], True
    study = trials_lib.Options()
    said = []
    spec, cells = plan(two_worker_sweep(network_limits=["100mbit"]))
    monkeypatch.setattr(netns, "refusal", lambda: "network namespaces are not available here (not root)")
    assert reproduce.limits_phase(Args, study, spec, cells, said.append) is False
    assert said == ["reproduce: limits: sma_1w run on one worker (no network between workers): not run at the limits",
                    "reproduce: limits: network namespaces are not available here (not root); the phase is not run "
                    "(no loopback runs labelled as limited)"]
    monkeypatch.setattr(netns, "refusal", lambda: None)
    assert reproduce.limits_phase(Args, study, spec, cells, said.append) is True
    said.clear()
    named = trials_lib.Options(hosts=("node-a", "node-b"))   # --hosts: the namespaces are this machine's
    assert reproduce.limits_phase(Args, named, spec, cells, said.append) is False
    assert said[-1] == ("reproduce: limits: the phase runs its workers on this machine in network namespaces, "
                        "not on the hosts of --hosts/--hostfile (CROSSBOW_HOSTS/CROSSBOW_HOSTFILE); not run")
    said.clear()
    assert reproduce.limits_phase(Args, study, *plan(two_worker_sweep()), said.append) is False
    assert said == ["reproduce: limits: the config's sweep has no network_limits; nothing to run at limits"]


def test_a_finished_loopback_run_does_not_count_as_a_run_behind_a_limit(tmp_path):
    out = tmp_path / "report"
    prepare_out_dir(str(out))
    runner = Runner(str(out), 1, out=open(os.devnull, "w"))
    runner.hosts = ["node-a", "node-b"]    # named hosts: a limit's workers must start here
    job = Job("sma", {"seed": 0}, None, "sma/G32/net-100mbit", "t00_s0", "t00", 0, workers=2,
              network=netns.Limit("100mbit"))
    code, error = runner._spawn(job, job.paths(str(out)), 60)
    assert code == 2 and "needs its 2 worker(s) started here in namespaces" in error
    from crossbow_tf.compare.runner import _as_planned
    path = out / "runs" / "sma" / "G32" / "net-100mbit" / "t00_s0.json"
    run = dict(method="sma", config={}, environment={}, num_learners=2, workers=2,
               evaluations=[dict(epoch=1, iteration=2, examples=64, wall_time=1.0, accuracy=0.9, loss=0.1,
                                 test_examples=64)])
    path.write_text(json.dumps(run))
    record = _as_planned(runner._record("t00", 0, str(path), 0.5, 0.0, None), job, None)
    assert record.summary is None and record.error == "ran on loopback, planned behind 100mbit: refused"
    path.write_text(json.dumps(dict(run, network="100mbit")))
    assert _as_planned(runner._record("t00", 0, str(path), 0.5, 0.0, None), job, None).summary["reached"]


# ---------------------------------------------------------------------------------------------
# The verdict per network, from hand-made runs.

def _run(tta, epochs, ms, mb, network=None, accuracy=0.9):
    """A loaded run as study_report.load_run gives it: (summary, evaluations, results)."""
    summary = dict(reached=tta is not None, tta=tta, epochs_to_target=epochs, best_accuracy=accuracy,
                   cross_worker=dict(workers=2, step_ms_per_iteration=ms, bytes_per_iteration=mb * 1e6,
                                     compute_ms_per_iteration=None, collective_ms_per_iteration=None))
    return summary, [], ({"network": network} if network else {})


def _verdicts(runs):
    """across_workers' (lines, summary) for a study of ssgd_2w, sma_2w and local_2w at G=32 behind
    1gbit and 100mbit, RUNS {(series, network): loaded run or None} for every seed."""
    spec, cells = plan(dict(global_batches=[32], budget=1, search_seeds=[0], seeds=[0, 1, 2], target=0.5, epochs=10,
                            network_limits=["1gbit", "100mbit"],
                            series=dict(ssgd_2w=dict(method="tf_ssgd", workers=2, grid={"learning_rate.base": [0.1]}),
                                        sma_2w=dict(method="sma", workers=2, batch_size=16),
                                        local_2w=dict(method="localsgd", workers=2, batch_size=16))))
    states = {(c.series.name, 32): dict(cell=c, searched=True, best=dict(label="t00"), trials=[],
                                        final={s: runs[(c.series.name, "loopback")] for s in spec.seeds})
              for c in cells}

    def load(path, target):
        assert path.endswith("_s0.json") or path.endswith("_s1.json") or path.endswith("_s2.json")
        series, _, net = path.split(os.sep)[-4:-1]
        return runs.get((series, net[len("net-"):]))
    return across_workers.across_workers("out", spec, cells, states, load)


def test_the_across_workers_verdict_applies_the_1_3x_threshold_per_network():
    runs = {("ssgd_2w", "loopback"): _run(100.0, 8, 150, 4.45), ("sma_2w", "loopback"): _run(80.0, 9, 150, 4.45),
            ("local_2w", "loopback"): _run(90.0, 9, 93, 0.28),                 # 100 / 80 = 1.25: short of 1.3
            ("ssgd_2w", "1gbit"): _run(130.0, 8, 190, 4.45, "1gbit"),
            ("sma_2w", "1gbit"): _run(120.0, 9, 180, 4.45, "1gbit"),
            ("local_2w", "1gbit"): _run(100.0, 7, 93, 1.11, "1gbit"),          # 130 / 100 = 1.3: holds
            ("ssgd_2w", "100mbit"): _run(400.0, 8, 600, 4.45),                 # no "network": not behind it
            ("sma_2w", "100mbit"): _run(300.0, 9, 500, 4.45, "100mbit"),
            ("local_2w", "100mbit"): _run(200.0, 9, 150, 0.28, "100mbit")}
    lines, summary = _verdicts(runs)
    [point] = summary["points"]
    verdicts = point["verdicts"]
    assert list(verdicts) == summary["networks"] == ["loopback", "1gbit", "100mbit"]
    assert (verdicts["loopback"]["verdict"], verdicts["loopback"]["averaging"]) == ("does not hold", "sma_2w")
    assert verdicts["loopback"]["ratio"] == pytest.approx(1.25)
    assert (verdicts["1gbit"]["verdict"], verdicts["1gbit"]["averaging"]) == ("holds", "local_2w")
    assert verdicts["1gbit"]["ratio"] == pytest.approx(1.3)
    assert verdicts["100mbit"]["verdict"] == "not measured"
    # The limits phase's runs found (every seed at 1gbit; two series' at 100mbit) of those planned.
    assert summary["limit_runs"] == dict(planned=3 * 2 * 3, finished=3 * 3 + 2 * 3)
    assert summary["claim"] == ("an averaging method with a synchronisation period reaches 50% at least 1.3x sooner "
                                "in wall time than tuned synchronous SGD on 2 workers")
    table = "\n".join(lines)
    assert ("| **holds** (S-SGD/averaging TTA 1.30x): local_2w 100.0 s, 7 epochs, 93 ms/iteration, 1.11 MB/iteration; "
            "ssgd_2w 130.0 s, 8 epochs, 190 ms/iteration, 4.45 MB/iteration |") in table
    assert "**does not hold** (S-SGD/averaging TTA 1.25x): sma_2w 80.0 s" in table
    assert "not measured (2 of 3 series finished on every seed) |" in table
    assert "| ssgd_2w | 100mbit | not run yet |" in table and "| local_2w | 1gbit | 3/3 | 100.0 | 7 | 93 | 1.11 |" in table


def test_runs_that_never_reach_the_target_count_as_never_reaching():
    reach, never = _run(300.0, 9, 100, 0.3), _run(None, None, 100, 0.3, accuracy=0.85)
    runs = {("ssgd_2w", "loopback"): never, ("sma_2w", "loopback"): never, ("local_2w", "loopback"): reach,
            ("ssgd_2w", "1gbit"): _run(100.0, 5, 100, 4.45, "1gbit"),
            ("sma_2w", "1gbit"): _run(None, None, 100, 4.45, "1gbit"),
            ("local_2w", "1gbit"): _run(None, None, 100, 0.3, "1gbit")}
    lines, summary = _verdicts(runs)
    verdicts = summary["points"][0]["verdicts"]
    # S-SGD never reaches where local SGD does: it holds, whatever the times.
    assert (verdicts["loopback"]["verdict"], verdicts["loopback"]["ratio"]) == ("holds", None)
    assert (verdicts["1gbit"]["verdict"], verdicts["1gbit"]["ssgd"]) == ("does not hold", "ssgd_2w")
    assert "ssgd_2w not reached in 10 epochs (0/3 seeds reached; best acc 0.8500)" in "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# End to end: a tiny 2-worker study, its sweep (by a stand-in), then its limits phase at 100mbit (real).

SWEEP_STAND_IN = '''#!{python}
"""A stand-in for a 2-worker training run of the sweep: the chief writes results whose accuracy
follows the learning rate (a rate of 0.05 reaches 0.9, a tiny one stays at chance)."""
import json, os, sys
import yaml
args = sys.argv[1:]
config, results = args[args.index("--config") + 1], args[args.index("--results") + 1]
if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
    c = yaml.safe_load(open(config))
    accuracy = 0.9 if c["learning_rate"]["base"] > 0.01 else 0.1
    print(f"epoch   1/1  test accuracy {{accuracy:.4f}}  time   1.00s", flush=True)
    json.dump(dict(method="sma", config=c, environment={{}}, num_learners=2, workers=2,
                   evaluations=[dict(epoch=1, iteration=8, examples=256, wall_time=1.0, accuracy=accuracy,
                                     loss=1 - accuracy, test_examples=64)]), open(results, "w"))
'''


@pytest.fixture(scope="module")
def limited_study(tmp_path_factory):
    """The sweep's two trials (t00: a tiny rate, t01: 0.05) run by a stand-in; then the study resumed
    with the real runs: the sweep's are reused, the limits phase trains the sweep's best behind 100mbit."""
    tmp = tmp_path_factory.mktemp("limits")
    data = fashion_dir(tmp)
    doc = dict(EXPERIMENT, sweep=dict(
        global_batches=[32], budget=2, search_seeds=[0], seeds=[0], target=0.3, epochs=1, timeout=600,
        network_limits=["100mbit"],
        series=dict(sma_2w=dict(method="sma", workers=2, batch_size=16,
                                grid={"learning_rate.base": [1e-6, 0.05]}))))
    config = tmp / "study.yaml"
    config.write_text(yaml.safe_dump(doc))
    stand_in = tmp / "python"
    stand_in.write_text(SWEEP_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    out = tmp / "report"
    cmd = [sys.executable, "-m", "crossbow_tf.reproduce", "--config", str(config), "--out", str(out),
           "--data-dir", data]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    swept = subprocess.run(cmd + ["--phases", "sweep", "report"], capture_output=True, text=True, timeout=300,
                           env=dict(env, CROSSBOW_RUN_PYTHON=str(stand_in)), cwd=tmp)
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    assert not (out / "runs" / "sma_2w" / "G32" / "net-100mbit").exists()   # no limits phase asked for
    cmd += ["--resume", "--phases", "sweep", "limits", "report"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, cmd, env, tmp, proc.stdout


def test_the_limits_phase_runs_the_sweeps_best_trial_behind_the_limit(limited_study):
    out, _, _, _, stdout = limited_study
    sweep, limited = out / "runs" / "sma_2w" / "G32", out / "runs" / "sma_2w" / "G32" / "net-100mbit"
    assert sorted(p.name for p in limited.glob("*.json")) == ["t01_s0.json"], stdout   # the sweep's best, t01
    assert (limited / "t01_s0.yaml").read_text() == (sweep / "t01_s0.yaml").read_text()
    run = json.loads((limited / "t01_s0.json").read_text())
    assert run["network"] == "100mbit" and "network" not in json.loads((sweep / "t01_s0.json").read_text())
    assert run["workers"] == 2 and run["cross_worker"]["all_reduces"] == run["cross_worker"]["iterations"] > 0
    log = (limited / "t01_s0.log").read_text()
    assert "# worker 0 of 2 in cbn" in log and "(100mbit, 0ms delay): TF_CONFIG" in log and "10.213." in log
    assert (limited / "t01_s0.worker1.log").exists()
    assert stdout.count("done before") == 2 and "study: 3 of 3 trials done" in stdout   # one study: sweep, then limits


def test_the_report_of_a_two_worker_study_has_a_column_per_network(limited_study):
    out, _, _, _, _ = limited_study
    report = (out / "report.md").read_text()
    assert "### Across 2 workers: a synchronisation period against tuned S-SGD, per network" in report
    assert "| claim | loopback | 100mbit |" in report
    assert "- progress: 3 of 3 training runs finished" in report   # the sweep's two and the limit's
    assert "| sma_2w | 100mbit | 1/1 |" in report and "| sma_2w | loopback | 1/1 |" in report
    summary = json.loads((out / "summary.json").read_text())
    figures = summary["across_workers"]["points"][0]["series"]["sma_2w"]["100mbit"]
    assert figures["seeds"] == 1 and figures["mb_per_iteration"] > 4     # LeNet's weights, every iteration
    assert summary["across_workers"]["points"][0]["series"]["sma_2w"]["loopback"]["tta"][0] == 1.0   # the stand-in's
    # No tuned S-SGD in this study: nothing to compare against, said so.
    assert summary["across_workers"]["points"][0]["verdicts"]["100mbit"]["verdict"] == "not measured"
    assert "| not measured (the study has no tuned tf_ssgd series on these workers) |" in report


def test_resuming_the_study_reruns_nothing_and_dry_run_lists_the_limits_runs(limited_study):
    out, cmd, env, tmp, _ = limited_study
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done before") == 3 and "ETA" not in again.stdout
    dry = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert ("sma_2w G=32 behind 100mbit: the sweep's best trial on seeds [0], on 2 workers "
            "(runs/sma_2w/G32/net-100mbit/)") in dry.stdout
    assert "3 training runs (at most)" in dry.stdout


def test_a_sweep_run_made_behind_crossbow_network_is_not_a_loopback_run():
    spec, cells = plan(two_worker_sweep(network_limits=["100mbit"]))
    behind, plain = _run(90.0, 7, 150, 4.45, network="100mbit"), _run(80.0, 7, 120, 4.45)
    state = dict(cell=cells[0], searched=True, best=dict(label="t00"), trials=[], final={0: behind, 1: plain, 2: None})
    runs = across_workers.network_runs("out", spec, state, lambda path, target: behind)
    assert runs == {"loopback": [None, plain, None], "100mbit": [behind, behind, behind]}
    assert across_workers.network_stats(runs["loopback"])["tta"] == (80.0, 80.0, 80.0)
    assert across_workers.network_runs("out", spec, dict(state, searched=False), None) == {}
