"""Multi-worker trials launched by the harness (``workers: 2`` in a method's settings), on 127.0.0.1:
the harness's run equals the same run launched by hand, the stock baseline runs under
MultiWorkerMirroredStrategy, and a worker killed mid-trial is a lost worker whose trial runs again."""
import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from crossbow_tf.compare import cli as compare, launch, netns, trials as trials_lib
from crossbow_tf.compare.runner import Job, Runner, prepare_out_dir
from crossbow_tf.distribute.cluster import local_tf_configs
import forking
from forking import forked_runs  # noqa: F401  (a fixture)

# Training processes are forked from a server that imported TensorFlow once (tests/forking.py).
pytestmark = pytest.mark.usefixtures("forked_runs")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_experiment(data_dir, **overrides):
    """LeNet on 640 digits (160 to test), one CPU device per worker, 20 iterations per epoch."""
    return dict(dict(name="tiny-workers", model="lenet", data={"name": "mnist", "data_dir": data_dir},
                     devices={"logical_cpu": 1}, learners_per_device=2, batch_size=8,
                     learning_rate={"base": 0.05}, epochs=1, seed=1), **overrides)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """640 real digits to train on and 160 to test, of every class (the embedded set is sorted by label)."""
    import numpy as np
    from crossbow_tf.data.mnist import load_idx_pair
    from test_data_formats import write_mnist
    embedded = os.path.join(REPO, "crossbow_tf", "data", "embedded")
    images, labels = load_idx_pair(os.path.join(embedded, "mnist5k-images-idx3-ubyte.gz"),
                                   os.path.join(embedded, "mnist5k-labels-idx1-ubyte.gz"))
    order = np.random.default_rng(0).permutation(len(labels))[:800]
    directory = str(tmp_path_factory.mktemp("mnist"))
    write_mnist(directory, (images[order[:640]], labels[order[:640]]), (images[order[640:]], labels[order[640:]]))
    return directory


@pytest.fixture(scope="module")
def compared(tmp_path_factory, data_dir):
    """A compare of SMA against tf_ssgd, each run on 2 workers the harness starts."""
    tmp = tmp_path_factory.mktemp("compare")
    settings = tiny_experiment(data_dir)
    settings["compare"] = {"budget": 1, "search_seeds": [0], "seeds": [0], "epochs": 1, "target": 0.5,
                           "timeout": 600,
                           "methods": {"sma": {"workers": 2},
                                       "tf_ssgd": {"workers": 2, "fixed": {"batch_size": 16}}}}
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump(settings))
    out = tmp / "report"
    with ListenerWatch() as sockets:   # issue 52: where the workers' servers listen while the trials run
        proc = subprocess.run([sys.executable, "-m", "crossbow_tf.compare", "--config", str(config), "--out", str(out)],
                              capture_output=True, text=True, timeout=900, cwd=tmp,
                              env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, out, proc.stdout, sockets


def descendants(root):
    """The pids of ROOT's descendants now."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


class ListenerWatch(threading.Thread):
    """Samples, every 0.1 s while its block runs, the listening TCP sockets of this test process's
    descendants (the harness, the fork server and the workers it forks): LISTENING, the (pid, namespace,
    address, port) of each, in whatever namespace it is; EXPOSED, those in this machine's namespace on an
    address other than loopback (crossbow_tf/distribute/exposure.py)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listening, self.exposed, self.done, self.failure = set(), set(), threading.Event(), None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.join()
        if self.failure is not None:
            raise self.failure
        return False

    def run(self):
        try:
            self._watch()
        except Exception as e:   # told by __exit__, not lost with the thread
            self.failure = e

    def _watch(self):
        from crossbow_tf.distribute.exposure import exposed_listeners, listening_sockets, socket_inodes
        while not self.done.wait(0.1):
            pids = descendants(os.getpid())
            self.exposed.update(exposed_listeners(pids))
            for pid in pids:
                try:
                    namespace = os.stat(f"/proc/{pid}/ns/net").st_ino
                except OSError:
                    continue
                own = listening_sockets(f"/proc/{pid}/net")
                self.listening.update((pid, namespace, *own[inode]) for inode in socket_inodes(pid) if inode in own)


def results(path):
    with open(path) as f:
        return json.load(f)


def curve(data):
    return [(e["epoch"], e["iteration"], e["examples"], e["accuracy"], e["loss"], e["train_loss"])
            for e in data["evaluations"]]


def test_a_two_worker_trial_of_the_harness_equals_the_same_run_launched_by_hand(compared):
    tmp, out, stdout, _ = compared
    run = out / "runs" / "sma" / "t00_s0"
    harness = results(f"{run}.json")
    assert harness["workers"] == 2 and harness["num_learners"] == 4 and harness["global_batch"] == 32
    # Every worker's log is kept: worker 1 logs with its prefix, the chief's log is the run's.
    assert "[worker 1] epoch   1/1" in (out / "runs" / "sma" / "t00_s0.worker1.log").read_text()
    assert "2 workers x 1 device(s) x 2" in (out / "runs" / "sma" / "t00_s0.log").read_text()
    assert "epoch 1/1  accuracy" in stdout and "study: 2 of 2 trials done" in stdout, stdout
    # Measured per iteration: one all-reduce of the weights and the loss per iteration, a ring's
    # 2(n-1)/n x its bytes sent per worker, the time in it and the rest.
    across = harness["cross_worker"]
    assert across["workers"] == 2 and across["iterations"] == across["all_reduces"] == 20
    assert across["payload_bytes"] > 4 * 1_000_000   # LeNet's weights, float32
    assert across["bytes_per_iteration"] == pytest.approx(across["payload_bytes"])   # 2(2-1)/2 = 1
    assert 0 < across["collective_ms_per_iteration"] < across["step_ms_per_iteration"]
    assert across["compute_ms_per_iteration"] == pytest.approx(
        across["step_ms_per_iteration"] - across["collective_ms_per_iteration"])
    assert "waiting in all-reduce ms/iteration" in (out / "report.md").read_text()
    # The same config, launched as docs/multiworker.md launches it: each worker with its TF_CONFIG.
    # In a loopback-only namespace of their own, as the harness's workers (issue 52).
    private = contextlib.ExitStack()
    prefix = netns.private_loopback(private).prefix(0)
    procs = [subprocess.Popen([*prefix, forking.PYTHON, "-m", "crossbow_tf.run", "--config", f"{run}.yaml",
                               "--results", str(tmp / f"by_hand{i}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp,
                              env=dict(os.environ, PYTHONPATH=REPO, TF_CONFIG=config, TF_CPP_MIN_LOG_LEVEL="2"),
                              start_new_session=True)
             for i, config in enumerate(local_tf_configs(2))]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        private.close()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-3000:]
    assert not (tmp / "by_hand1.json").exists()   # only the chief writes
    by_hand = results(tmp / "by_hand0.json")
    ours, theirs = curve(harness), curve(by_hand)
    assert len(ours) == len(theirs) == 1
    for a, b in zip(ours, theirs, strict=True):
        assert a[:3] == b[:3]
        assert a[3:] == pytest.approx(b[3:], abs=1e-6)
    # The compared losses moved far beyond the tolerance (1e-6) from an untrained model's, ln 10.
    assert abs(ours[0][5] - math.log(10)) > 0.01 and abs(ours[0][4] - math.log(10)) > 0.01


def test_while_the_harness_runs_local_trials_no_worker_listens_beyond_loopback_in_the_machines_namespace(compared):
    # Issue 52: each worker's TensorFlow server binds every interface; the harness puts a trial's workers
    # in a namespace of their own, so the machine's namespace holds none of their sockets.
    _, out, _, sockets = compared
    here = os.stat("/proc/self/ns/net").st_ino
    servers = {(pid, namespace) for pid, namespace, address, port in sockets.listening if address in ("0.0.0.0", "::")}
    assert len({pid for pid, _ in servers}) >= 4, sockets.listening   # two trials' two workers each were seen
    assert all(namespace != here for _, namespace in servers), servers
    assert sockets.exposed == set(), sockets.exposed
    assert "(a private namespace, loopback only)" in (out / "runs" / "sma" / "t00_s0.log").read_text()


def test_the_stock_baseline_runs_under_multi_worker_mirrored_strategy_on_the_same_workers(compared):
    _, out, _, _ = compared
    stock = results(out / "runs" / "tf_ssgd" / "t00_s0.json")
    assert stock["workers"] == 2 and stock["num_learners"] == 2 and stock["global_batch"] == 32
    assert stock["strategy"] == "CollectiveAllReduceStrategy"   # tf.distribute.MultiWorkerMirroredStrategy's class
    across = stock["cross_worker"]   # its gradients' bytes; its collectives are TensorFlow's, not timed
    assert across["bytes_per_iteration"] == across["payload_bytes"] > 4 * 1_000_000
    assert across["collective_ms_per_iteration"] is None and across["step_ms_per_iteration"] > 0
    assert not any(m.startswith("crossbow_tf.engine") for m in stock["crossbow_modules"])
    [evaluation] = stock["evaluations"]
    assert evaluation["iteration"] == 20 and abs(evaluation["train_loss"] - math.log(10)) > 0.01
    worker = (out / "runs" / "tf_ssgd" / "t00_s0.worker1.log").read_text()
    assert "MultiWorkerMirroredStrategy over 2 workers" in worker and "epoch   1/1" in worker
    assert (out / "report.md").exists()


def test_a_worker_killed_mid_trial_is_a_lost_worker_and_the_trial_runs_again(tmp_path, data_dir, monkeypatch):
    out = tmp_path / "report"
    prepare_out_dir(str(out))
    lines = []
    runner = Runner(str(out), 1, out=open(os.devnull, "w"))
    runner.say = lines.append
    started = []
    real_start = launch.start
    monkeypatch.setattr(launch, "start", lambda *a, **k: started.append(real_start(*a, **k)) or started[-1])
    log1 = out / "runs" / "sma" / "t00_s0.worker1.log"

    def kill_worker_1_after_its_first_epoch():
        deadline = time.time() + 400
        while time.time() < deadline:
            if log1.exists() and "[worker 1] epoch   1/3" in log1.read_text() and len(started) >= 2:
                os.killpg(started[1].popen.pid, signal.SIGKILL)
                return
            time.sleep(0.2)
    killer = threading.Thread(target=kill_worker_1_after_its_first_epoch, daemon=True)
    killer.start()
    from crossbow_tf.compare.spec import run_config
    experiment, _ = run_config(tiny_experiment(data_dir), {}, "sma", {}, seed=0, target=0.99, epochs=3, where="test")
    experiment["stop_at_target"] = False   # all three epochs, whatever the accuracy
    record = runner.run_job(Job("sma", experiment, None, "sma", "t00_s0", "t00", 0, workers=2), 0.99, 600)
    killer.join(1)
    # The first attempt lost worker 1: the chief stopped with exit code 4, naming it.
    assert len(started) == 4, lines
    first_chief = (out / "runs" / "sma" / "t00_s0.attempt1.log").read_text()
    assert "lost worker 1" in first_chief
    assert (out / "runs" / "sma" / "t00_s0.attempt1.worker1.log").exists()
    assert any("lost a worker" in line and "the trial runs again (retry 1 of 3)" in line for line in lines), lines
    # The retry finished the trial (from the chief's checkpoint), on 2 workers.
    assert record.summary is not None and record.code == 0, (record.error, lines)
    final = results(record.path)
    assert final["workers"] == 2 and [e["epoch"] for e in final["evaluations"]] == [1, 2, 3]
    assert final.get("resumed_at_iterations"), "the retry continued from the first attempt's checkpoint"


def test_a_two_worker_trial_behind_a_bandwidth_limit_in_namespaces_the_harness_makes_and_removes(
        tmp_path, monkeypatch):
    """The namespaces, links and TF_CONFIGs of a limited trial (its workers stand-ins: a real training
    run behind a limit is tests/test_network_limits.py's)."""
    from crossbow_tf.compare import netns
    stand_in = tmp_path / "python"
    stand_in.write_text(WORKER_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    monkeypatch.setenv("STAND_IN_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("CROSSBOW_NETWORK", "100mbit")
    out = tmp_path / "report"
    prepare_out_dir(str(out))
    lines = []
    runner = Runner(str(out), 1, out=open(os.devnull, "w"), python=str(stand_in))
    runner.say = lines.append
    assert runner.network == netns.Limit("100mbit", "0ms"), lines   # this machine allows namespaces
    shaped = []
    real_start = launch.start

    def start(index, command, *args, **kwargs):   # what the worker's link looks like while it runs
        shaped.append(subprocess.run(command[:4] + ["tc", "qdisc", "show"], capture_output=True, text=True).stdout)
        return real_start(index, command, *args, **kwargs)
    monkeypatch.setattr(launch, "start", start)
    record = runner.run_job(Job("sma", {"seed": 0}, None, "sma", "t00_s0", "t00", 0, workers=2), 0.5, 60)
    assert record.summary is not None, (record.error, lines)
    assert len(shaped) == 2 and all("tbf" in s and "rate 100Mbit" in s for s in shaped), shaped
    chief_log = (out / "runs" / "sma" / "t00_s0.log").read_text()
    assert f"# worker 0 of 2 in cbn{os.getpid()}x" in chief_log and "(100mbit, 0ms delay)" in chief_log
    # Each worker reached the other on its namespace's address.
    configs = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    hosts = {tuple(c["cluster"]["worker"]) for c in configs}
    assert len(configs) == 2 and len(hosts) == 1, configs
    assert all(h.startswith("10.213.") and h.endswith(":2222") for h in next(iter(hosts))), hosts
    assert results(record.path)["network"] == "100mbit"   # the results say which network they measured
    assert not [n for n in netns.namespaces() if n.startswith(f"cbn{os.getpid()}x")]   # removed


def _stand_in_runner(tmp_path, monkeypatch):
    stand_in = tmp_path / "python"
    stand_in.write_text(WORKER_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    monkeypatch.setenv("STAND_IN_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("STAND_IN_NETNS", str(tmp_path / "netns"))
    monkeypatch.delenv("CROSSBOW_NETWORK", raising=False)
    out = tmp_path / "report"
    prepare_out_dir(str(out))
    lines = []
    runner = Runner(str(out), 1, out=open(os.devnull, "w"), python=str(stand_in))
    runner.say = lines.append
    return runner, out, lines


def test_a_local_two_worker_trial_runs_in_a_private_namespace_with_only_loopback(tmp_path, monkeypatch):
    # Issue 52: the workers' TensorFlow servers bind every interface; in a namespace of their own with
    # only loopback, nobody but the trial's workers reaches them. As root (this machine, CI) the
    # harness makes one per trial and removes it after.
    from crossbow_tf.compare import netns
    runner, out, lines = _stand_in_runner(tmp_path, monkeypatch)
    record = runner.run_job(Job("sma", {"seed": 0}, None, "sma", "t00_s0", "t00", 0, workers=2), 0.5, 60)
    assert record.summary is not None, (record.error, lines)
    seen = (tmp_path / "netns").read_text().splitlines()
    assert len(seen) == 2 and len(set(seen)) == 1, seen                       # both workers, one namespace
    inode, interfaces = seen[0].split(" ", 1)
    assert int(inode) != os.stat("/proc/self/ns/net").st_ino and interfaces == "['lo']", seen
    configs = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    assert all(h.startswith("127.0.0.1:") for c in configs for h in c["cluster"]["worker"]), configs
    chief_log = (out / "runs" / "sma" / "t00_s0.log").read_text()
    assert f"# worker 0 of 2 in cbn{os.getpid()}x" in chief_log and "(a private namespace, loopback only)" in chief_log
    assert not [line for line in lines if "reachable on every interface" in line], lines
    assert not [n for n in netns.namespaces() if n.startswith(f"cbn{os.getpid()}x")]   # removed


class _Refused:
    def __init__(self):
        from crossbow_tf.compare import netns
        raise netns.NetworkError("ip netns add cbn1x1-lo: Operation not permitted")


def test_without_ip_netns_a_local_trials_workers_share_a_user_namespace_with_only_loopback(tmp_path, monkeypatch):
    # An ordinary user's way (tests/test_exposure.py runs it as one): a user namespace and its network namespace.
    from crossbow_tf.compare import netns
    monkeypatch.setattr(netns, "PrivateLoopback", _Refused)
    runner, out, lines = _stand_in_runner(tmp_path, monkeypatch)
    record = runner.run_job(Job("sma", {"seed": 0}, None, "sma", "t00_s0", "t00", 0, workers=2), 0.5, 60)
    assert record.summary is not None, (record.error, lines)
    seen = (tmp_path / "netns").read_text().splitlines()
    assert len(seen) == 2 and len(set(seen)) == 1, seen
    inode, interfaces = seen[0].split(" ", 1)
    assert int(inode) != os.stat("/proc/self/ns/net").st_ino and interfaces == "['lo']", seen
    chief_log = (out / "runs" / "sma" / "t00_s0.log").read_text()
    assert "# worker 0 of 2 in the user namespace held by process" in chief_log, chief_log
    assert not [line for line in lines if "reachable on every interface" in line], lines


def test_where_the_machine_refuses_namespaces_the_exposure_is_said_once_or_refused(tmp_path, monkeypatch):
    from crossbow_tf.compare import netns
    monkeypatch.setattr(netns, "PrivateLoopback", _Refused)
    monkeypatch.setattr(netns, "UserLoopback", _Refused)
    runner, out, lines = _stand_in_runner(tmp_path, monkeypatch)
    for trial in ("t00", "t01"):
        record = runner.run_job(Job("sma", {"seed": 0}, None, "sma", f"{trial}_s0", trial, 0, workers=2), 0.5, 60)
        assert record.summary is not None, (record.error, lines)
    notes = [line for line in lines if "reachable on every interface" in line]
    assert len(notes) == 1 and notes[0].startswith("note: the workers' TensorFlow servers will be reachable on every "
                                                   "interface of this machine"), lines
    assert "Operation not permitted" in notes[0] and "CROSSBOW_PRIVATE_WORKERS=require" in notes[0]
    monkeypatch.setenv("CROSSBOW_PRIVATE_WORKERS", "require")
    record = runner.run_job(Job("sma", {"seed": 0}, None, "sma", "t02_s0", "t02", 0, workers=2), 0.5, 60)
    assert record.summary is None and record.code == 2, record
    assert record.error.startswith("CROSSBOW_PRIVATE_WORKERS=require: the workers' TensorFlow servers"), record.error


def test_namespaces_of_a_killed_harness_are_removed_by_the_next(tmp_path):
    from crossbow_tf.compare import netns
    code = ("import time; from crossbow_tf.compare.netns import Network, Limit\n"
            "with Network(2, Limit('1gbit')) as n:\n    print(n.tag, flush=True); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO))
    tag = proc.stdout.readline().strip()
    made = [n for n in netns.namespaces() if n.startswith(tag + "-")]
    proc.kill()
    proc.wait(10)
    assert len(made) == 3 and tag.startswith("cbn"), made   # two workers and the bridge's
    assert [n for n in netns.namespaces() if n.startswith(tag + "-")] == made   # a kill leaves them
    netns.remove_stale()
    assert not [n for n in netns.namespaces() if n.startswith(tag + "-")]


def test_two_worker_processes_show_the_studys_progress_and_one_prints_the_final_table(tmp_path):
    """Issue 27: each --worker process numbers trials and counts them from the storage (every
    process's), and only the one that finished the study's last trial writes and prints the report."""
    from test_distributed_study import RUNS, STAND_IN, STUDY, command
    import numpy as np
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "generated.npz", x_train=rng.random((64, 28, 28, 1), dtype=np.float32),
             y_train=rng.integers(0, 10, 64), x_test=rng.random((64, 28, 28, 1), dtype=np.float32),
             y_test=rng.integers(0, 10, 64))
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(dict(STUDY, data={"name": "npz", "path": str(tmp_path / "generated.npz")})))
    env = dict(os.environ, CROSSBOW_RUN_PYTHON=str(stand_in), STAND_IN_CALLS=str(tmp_path / "calls"),
               STAND_IN_ROOT=str(tmp_path), STAND_IN_SLEEP="0.5", TF_CPP_MIN_LOG_LEVEL="2")
    out = tmp_path / "workers"
    joining = command(str(config), out, "--storage", f"sqlite:///{tmp_path / 'shared.db'}", "--worker",
                      "--heartbeat", "2")
    workers = [subprocess.Popen(joining, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
               for _ in range(2)]
    logs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(logs)[-3000:]
    done = [[int(n) for n in re.findall(rf"study: (\d+) of {RUNS} trials done", log)] for log in logs]
    assert all(done), logs   # both ran trials and said how far the study was
    # The counts are the storage's, not each process's own: they count the other's trials too.
    assert len(done[0]) + len(done[1]) == RUNS and all(d == sorted(d) for d in done), done
    assert max(max(d) - len(d) for d in done) > 0, done
    tables = [log for log in logs if "\nreport: " in log]
    assert len(tables) == 1, logs
    assert (out / "report.md").exists()


WORKER_STAND_IN = '''#!{python}
"""A stand-in for a training run's worker: records its TF_CONFIG; the chief writes results."""
import json, os, socket, sys
args = sys.argv[1:]
results = args[args.index("--results") + 1]
config = json.loads(os.environ["TF_CONFIG"])
with open(os.environ["STAND_IN_CALLS"], "a") as f:
    f.write(os.environ["TF_CONFIG"] + "\\n")
if os.environ.get("STAND_IN_NETNS"):   # which network namespace it ran in, and what it could reach
    with open(os.environ["STAND_IN_NETNS"], "a") as f:
        f.write(f"{{os.stat('/proc/self/ns/net').st_ino}} {{sorted(n for _, n in socket.if_nameindex())}}\\n")
if config["task"]["index"] == 0:
    print("epoch   1/1  test accuracy 0.9000  time   1.00s", flush=True)
    json.dump(dict(method="sma", config={{}}, environment={{}}, num_learners=4, workers=2,
                   evaluations=[dict(epoch=1, iteration=10, examples=320, wall_time=1.0, accuracy=0.9, loss=0.1,
                                     test_examples=64)]), open(results, "w"))
'''


@pytest.mark.parametrize("given", ["CROSSBOW_HOSTFILE", "--hostfile", "--hosts"])
def test_workers_on_named_hosts_start_through_the_launcher_with_the_hosts_in_their_tf_config(tmp_path, monkeypatch,
                                                                                            given):
    stand_in = tmp_path / "python"
    stand_in.write_text(WORKER_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("STAND_IN_CALLS", str(calls))
    (tmp_path / "hostfile").write_text("# the study's machines\nnode-a:2300  # chief\n\nnode-b:2301\n")
    monkeypatch.setenv("CROSSBOW_HOSTS", "elsewhere-a,elsewhere-b")   # the flags win over the environment
    if given == "CROSSBOW_HOSTFILE":
        monkeypatch.setenv("CROSSBOW_HOSTFILE", str(tmp_path / "hostfile"))
    argv = {"--hostfile": ["--hostfile", str(tmp_path / "hostfile")], "--hosts": ["--hosts", "node-a:2300,node-b:2301"]}
    parser = argparse.ArgumentParser()
    trials_lib.add_arguments(parser)
    options = trials_lib.options(parser.parse_args(argv.get(given, [])), str(tmp_path / "report"))
    if given == "--hostfile":
        (tmp_path / "hostfile").unlink()   # read once, by trials.options: the runs take its names from there
    # A launcher that runs the command here ("ssh {host}" or srun's in real use), told the host.
    monkeypatch.setenv("CROSSBOW_LAUNCHER", "env LAUNCHED_ON={host}")
    out = tmp_path / "report"
    prepare_out_dir(str(out))
    runner = Runner(str(out), 1, out=open(os.devnull, "w"), python=str(stand_in), trials=options)
    record = runner.run_job(Job("sma", {"seed": 0}, None, "sma", "t00_s0", "t00", 0, workers=2), 0.5, 60)
    assert record.summary is not None and record.summary["reached"], record.error
    configs = sorted((json.loads(line) for line in calls.read_text().splitlines()),
                     key=lambda c: c["task"]["index"])
    assert [c["task"] for c in configs] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    assert all(c["cluster"] == {"worker": ["node-a:2300", "node-b:2301"]} for c in configs)
    log1 = (out / "runs" / "sma" / "t00_s0.worker1.log").read_text()
    assert log1.startswith("$ env LAUNCHED_ON=node-b env TF_CONFIG=")
