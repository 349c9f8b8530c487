"""A study's trials in one Optuna storage: run sequentially, with --parallel 2 and as two --worker
processes, the same trials run once each and the reports agree; a worker SIGKILLed mid-trial
leaves its trial to the other, which runs it again and counts it once.

The training processes are a stand-in (CROSSBOW_RUN_PYTHON): a script that reads the run's
config and writes a results file whose accuracy is a function of the config (learning rate, seed,
global batch) after sleeping a moment, so the tests exercise the harness's scheduling, storage and
reports in seconds; tests/test_reproduce.py runs real training through the same path.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import optuna
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAND_IN = '''#!{python}
"""python -m MODULE --config C --results R [...]: a deterministic stand-in for a training run."""
import json, os, sys, time
import yaml
args = sys.argv[1:]
config, results = args[args.index("--config") + 1], args[args.index("--results") + 1]
with open(config) as f:
    c = yaml.safe_load(f)
first = not os.path.exists(os.environ["STAND_IN_CALLS"])
with open(os.environ["STAND_IN_CALLS"], "a") as f:
    f.write(f"{{os.path.relpath(results, os.environ['STAND_IN_ROOT'])}} {{os.getpid()}}\\n")
time.sleep(float(os.environ.get("STAND_IN_FIRST" if first else "STAND_IN_SLEEP", "0.1")))
lr, seed = c["learning_rate"]["base"], c["seed"]
g = c["batch_size"] * (c.get("learners_per_device") or 1) * (c["devices"]["logical_cpu"] or 1)
evals, wall = [], 0.0
for epoch in range(1, c["epochs"] + 1):
    wall += 0.5
    accuracy = round(min(0.99, 0.30 + lr * epoch * 2 + 0.01 * seed - g / 10000), 4)
    print(f"epoch {{epoch:3d}}/{{c['epochs']}}  test accuracy {{accuracy:.4f}}  time {{wall:6.2f}}s", flush=True)
    evals.append(dict(epoch=epoch, iteration=10 * epoch, examples=256 * epoch, wall_time=wall, accuracy=accuracy,
                      loss=1 - accuracy, test_examples=64, images_per_second=512.0, epoch_time=0.5))
json.dump(dict(method="tf_ssgd" if "tf_ssgd" in c else "sma",
               config=c, environment={{}}, evaluations=evals, num_learners=1, total_time=wall + 0.25),
          open(results, "w"))
'''

STUDY = dict(
    name="tiny", model="lenet", data={"name": "npz", "path": "generated.npz"}, devices={"logical_cpu": 1},
    learners_per_device=2, batch_size=16, epochs=2, target_accuracy=0.5, eval_batch_size=64,
    sweep=dict(global_batches=[32, 64], budget=2, search_seeds=[0], seeds=[0, 1], target=0.5, epochs=2,
               timeout=120,
               series=dict(ssgd=dict(method="tf_ssgd", grid={"learning_rate.base": [0.05, 0.1]}),
                           sma=dict(method="sma", batch_size=16, grid={"learning_rate.base": [0.05, 0.1]}))))
RUNS = 12   # 2 series x 2 points x (2 search trials + the best on the second seed)


@pytest.fixture
def setup(tmp_path):
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    rng = np.random.default_rng(0)   # generated data (the stand-in does not read it; the plan checks it)
    np.savez(tmp_path / "generated.npz", x_train=rng.random((64, 28, 28, 1), dtype=np.float32),
             y_train=rng.integers(0, 10, 64), x_test=rng.random((64, 28, 28, 1), dtype=np.float32),
             y_test=rng.integers(0, 10, 64))
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(dict(STUDY, data={"name": "npz", "path": str(tmp_path / "generated.npz")})))
    calls = tmp_path / "calls"
    env = dict(os.environ, CROSSBOW_RUN_PYTHON=str(stand_in), STAND_IN_CALLS=str(calls),
               STAND_IN_ROOT=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2")
    return tmp_path, str(config), calls, env


def command(config, out, *extra):
    return [sys.executable, "-m", "crossbow_tf.reproduce", "--config", config, "--out", str(out),
            "--phases", "sweep", "report", *extra]


def started(calls, out):
    """The runs started under OUT, in the order they started (one line per training process)."""
    if not calls.exists():
        return []
    return [line.split()[0] for line in calls.read_text().splitlines() if line.startswith(f"{out.name}/")]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def storage_trials(url, name):
    return optuna.load_study(study_name=name, storage=url).get_trials()


def plan_lines(report):
    """The report's lines about the plan and budgets, and its tables of results (times excluded)."""
    keep = []
    for line in report.splitlines():
        if line.startswith(("- finished", "- started", "- machine", "- command", "- software", "- load")):
            continue
        keep.append(line)
    return keep


def test_sequential_parallel_and_two_workers_run_every_trial_once_and_agree(setup):
    tmp, config, calls, env = setup
    reports, results = {}, {}
    ways = {"sequential": [], "parallel": ["--parallel", "2", "--heartbeat", "2"]}
    for way, extra in ways.items():
        out = tmp / way
        proc = subprocess.run(command(config, out, *extra), capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        reports[way] = (out / "report.md").read_text()
    # Two workers on one SQLite storage (they may start in either order), then the command
    # without --worker on the same storage: nothing left to run, it writes the report.
    out = tmp / "workers"
    url = f"sqlite:///{tmp / 'shared.db'}"
    joining = command(config, out, "--storage", url, "--worker", "--heartbeat", "2")
    workers = [subprocess.Popen(joining, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
               for _ in range(2)]
    logs = [w.communicate(timeout=120)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(logs)[-3000:]
    assert all("[" in log for log in logs), "both workers ran trials"
    # One worker writes the report and prints its verdict; the other says so in one line.
    writers = [log for log in logs if "report: " in log and "| claim of the paper |" in log]
    others = [log for log in logs if "the study is complete; another worker writes the report" in log]
    assert len(writers) == 1 and len(others) == 1 and "| claim of the paper |" not in others[0], logs
    final = subprocess.run(command(config, out, "--storage", url), capture_output=True, text=True, env=env,
                           timeout=120)
    assert final.returncode == 0, final.stderr[-2000:]
    assert " ... (elapsed" not in final.stdout   # nothing left to run
    reports["workers"] = (out / "report.md").read_text()

    for way in ("sequential", "parallel", "workers"):
        runs = started(calls, tmp / way)
        assert len(runs) == RUNS and len(set(runs)) == RUNS, (way, runs)   # every run once
        storage = f"sqlite:///{tmp / way / 'study.db'}" if way != "workers" else url
        name = (tmp / way / ".crossbow_study").read_text().strip()   # kept by the command that planned it
        assert name.startswith(f"crossbow:{way}-") and len(name) == len(f"crossbow:{way}-") + 8, name
        trials = storage_trials(storage, name)
        assert [t.state.name for t in trials] == ["COMPLETE"] * RUNS
        assert sorted(t.user_attrs["resolved"] for t in trials) == sorted(r[len(way) + 6:-5] for r in runs)
        results[way] = {r: json.loads((tmp / r).read_text())["evaluations"][-1]["accuracy"] for r in runs}
    # Sequentially, replications come after their cell's search, point by point, as before.
    order = [r.split("/", 2)[2] for r in started(calls, tmp / "sequential")]
    assert order[:6] == ["sma/G32/t00_s0.json", "sma/G32/t01_s0.json", "ssgd/G32/t00_s0.json",
                         "ssgd/G32/t01_s0.json", "sma/G32/t01_s1.json", "ssgd/G32/t01_s1.json"]
    strip = {way: {r.split("/", 1)[1]: v for r, v in res.items()} for way, res in results.items()}
    assert strip["sequential"] == strip["parallel"] == strip["workers"]
    assert plan_lines(reports["sequential"]) == plan_lines(reports["parallel"]) == plan_lines(reports["workers"])
    assert "12 of 12 training runs finished" in reports["workers"]
    # The study's time on W workers from its measured runs (1.25 s each here): the sum on one, and
    # on unlimited workers the critical path, a cell's search (side by side) then its replication.
    tool = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "critical_path.py"), str(tmp / "sequential"),
                           "--config", config, "--workers", "1", "100"], capture_output=True, text=True, timeout=60)
    assert tool.returncode == 0, tool.stderr[-2000:]
    assert "12 of 12 planned runs measured" in tool.stdout
    assert "1 worker(s), first claimable trial:   0.00 h  = sum / 1.0" in tool.stdout
    assert "100 worker(s), first claimable trial:   0.00 h  = sum / 6.0" in tool.stdout   # 15 s / 2.5 s


def test_a_worker_killed_mid_trial_leaves_it_to_the_other(setup):
    tmp, config, calls, env = setup
    out = tmp / "killed"
    url = f"sqlite:///{tmp / 'shared.db'}"
    env = dict(env, STAND_IN_FIRST="30")   # the first trial runs until its worker is killed
    cmd = command(config, out, "--storage", url, "--worker", "--heartbeat", "1")
    victim = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 60
    while not started(calls, out) and time.time() < deadline:   # its first trial is running
        time.sleep(0.1)
    first = started(calls, out)
    assert first, "the first worker never started a trial"
    survivor = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    time.sleep(0.3)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    child = int(calls.read_text().split()[1])   # the killed worker's training process dies with it
    deadline = time.time() + 10
    while alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(child)
    log = survivor.communicate(timeout=180)[0]
    assert survivor.returncode == 0, log[-3000:]
    runs = started(calls, out)
    assert runs.count(first[0]) == 2, runs          # the killed trial ran again
    assert len(set(runs)) == RUNS and len(runs) == RUNS + 1
    trials = storage_trials(url, (out / ".crossbow_study").read_text().strip())
    complete = [t.user_attrs["resolved"] for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == RUNS and len(set(complete)) == RUNS   # counted once
    [failed] = [t for t in trials if t.state.name == "FAIL"]
    assert failed.user_attrs["run"] == first[0][len("killed/runs/"):-len(".json")]
    report = (out / "report.md").read_text()
    assert "12 of 12 training runs finished" in report


def test_the_default_study_name_is_the_folder_and_its_config_and_stays_with_the_folder(tmp_path):
    from crossbow_tf.compare import trials
    one, other = tmp_path / "a.yaml", tmp_path / "b.yaml"
    one.write_text("model: lenet\n")
    other.write_text("model: resnet32\n")
    # Two studies whose folders share a name, on two configs, do not meet in a shared storage.
    names = [trials.default_name(str(tmp_path / where / "study"), str(c)) for where, c in (("x", one), ("y", other))]
    assert names[0] != names[1] and all(n.startswith("crossbow:study-") for n in names)
    # Every worker given the same command computes the same name.
    assert trials.default_name(str(tmp_path / "z" / "study"), str(one)) == names[0]
    # The report directory keeps its name: --resume finds its study after the config was edited.
    out = tmp_path / "x" / "study"
    out.mkdir(parents=True)
    trials.remember_name(trials.Options(name=names[0]), str(out))
    one.write_text("model: lenet\nepochs: 3\n")
    assert trials.default_name(str(out), str(one)) == names[0]
    # A report directory made before names were kept (its own study.db): the folder's name, as then.
    old = tmp_path / "old" / "study"
    old.mkdir(parents=True)
    (old / trials.STORAGE_FILE).write_bytes(b"")
    assert trials.default_name(str(old), str(one)) == "crossbow:study"


def test_slots_share_the_gpus_or_the_cores(monkeypatch):
    from crossbow_tf.compare import trials
    from crossbow_tf.errors import ConfigError
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in trials.make_slots(4)] == ["0,1", "2,3", "4,5", "6,7"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in trials.make_slots(8)] == [str(i) for i in range(8)]
    assert trials.make_slots(1)[0].env == {}   # one trial: every GPU, as before
    with pytest.raises(ConfigError, match="needs 16 GPUs; 8 visible"):
        trials.make_slots(8, gpus_per_trial=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(trials.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    slots = trials.make_slots(2)
    assert [s.cpus for s in slots] == [(0, 1), (2, 3)]
    assert slots[0].env["TF_NUM_INTRAOP_THREADS"] == slots[0].env["TF_NUM_INTEROP_THREADS"] == "2"


def test_a_study_killed_on_this_machine_resumes_at_once(setup):
    """One command, one machine, no server: killed with SIGKILL mid-trial, --resume continues it
    without waiting for the heartbeat (the trial's worker process is gone) and runs it again."""
    tmp, config, calls, env = setup
    out = tmp / "alone"
    proc = subprocess.Popen(command(config, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(env, STAND_IN_FIRST="30"))
    deadline = time.time() + 60
    while not started(calls, out) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    start = time.time()
    again = subprocess.run(command(config, out, "--resume"), capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    runs = started(calls, out)
    assert len(runs) == RUNS + 1 and runs[0] == runs[1]   # the killed trial first, then the rest once
    assert time.time() - start < 60   # not the 90 s of three missed default heartbeats
    assert "12 of 12 training runs finished" in (out / "report.md").read_text()


def test_on_a_journal_storage_a_silent_workers_trial_is_failed_and_runs_again(tmp_path):
    """Optuna gives its journal storage no heartbeat: the workers beat in the trial's user attributes,
    and the next worker fails a trial whose beat stopped and enqueues it again, as with a database."""
    from crossbow_tf.compare import trials
    storage = trials.open_storage(f"journal:{tmp_path / 'journal.log'}", heartbeat=1)
    items = [trials.Item("sma/G32/t00_s0", "sma/G32", 0), trials.Item("sma/G32/t01_s0", "sma/G32", 0)]
    study = trials.Study(storage, "crossbow:j", items, heartbeat=1, say=lambda line: None)
    assert study.own_heartbeat
    seen = []

    def run_item(item, slot):   # the worker beats while its run goes on
        seen.append(item.key)
        return 0.5, {}
    trial, item = study._claim()
    study._run(trial, item, run_item, trials.Slot(0, {}))   # beats once at its start, then tells
    assert [t.state.name for t in study.trials()] == ["COMPLETE", "WAITING"]
    # A worker dies holding the second trial: its beat is where it stopped.
    trial, item = study._claim()
    storage.set_trial_user_attr(trial._trial_id, trials.BEAT_ATTR, [trial.number, 1000.0])
    assert study.fail_silent_trials(now=1002.5) == []            # within three beats: alive
    assert study.fail_silent_trials(now=1003.5) == [item.key]    # three beats missed: given back
    assert [t.state.name for t in study.trials()] == ["COMPLETE", "FAIL", "WAITING"]
    retry = study.trials()[-1]
    assert retry.user_attrs["run"] == item.key
    # The retry carries the dead trial's attributes, its old beat among them: that beat is not its own.
    assert study.fail_silent_trials(now=5000.0) == []
    again, again_item = study._claim()
    assert again_item.key == item.key and again.number == retry.number
    assert study.fail_silent_trials(now=5000.0) == []             # claimed, not yet beaten: left alone
    study._run(again, again_item, run_item, trials.Slot(0, {}))
    assert study.complete() and seen == [items[0].key, item.key]
