"""What a worker's TensorFlow server exposes, in the one line each worker prints when it starts
(crossbow_tf/distribute/exposure.py, issue 52); the line itself in a real 2-worker run:
tests/test_multiworker.py."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from crossbow_tf.distribute.exposure import exposure_line, is_loopback, split_address

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_loopback_names_and_addresses():
    for host in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("10.0.0.2", "192.168.1.4", "node-a", "0.0.0.0", "fe80::1"):
        assert not is_loopback(host), host
    assert split_address("[::1]:2222") == ("::1", "2222") and split_address("node-a:2223") == ("node-a", "2223")


def test_a_cluster_across_machines_names_the_other_hosts_and_the_port():
    line = exposure_line("worker 1 (worker:1 at 10.0.0.2:2222)", "10.0.0.2:2222",
                         ["10.0.0.1:2222", "10.0.0.2:2222", "node-c:2300"])
    assert line.startswith("crossbow_tf: worker 1 (worker:1 at 10.0.0.2:2222): TensorFlow's server listens on port "
                           "2222 of every interface of this machine and accepts unauthenticated connections")
    assert "its cluster names other hosts (10.0.0.1, 10.0.0.2, node-c)" in line
    assert line.endswith("run workers on a trusted network only (docs/multiworker.md#security)")
    assert "\n" not in line


def test_a_cluster_on_loopback_still_says_the_server_binds_every_interface():
    line = exposure_line("worker 0", "127.0.0.1:40001", ["127.0.0.1:40001", "localhost:40002"])
    assert "listens on port 40001" in line and "its cluster is on this machine only, but the server binds" in line


def test_the_module_does_not_import_tensorflow():
    code = "import sys, crossbow_tf.distribute.exposure; assert 'tensorflow' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def test_a_storage_urls_password_is_never_printed(monkeypatch, tmp_path):
    # Issue 52: --storage takes a database URL, which may carry a password.
    import types

    import pytest

    from crossbow_tf.compare import trials
    from crossbow_tf.errors import ConfigError
    assert trials.redacted("postgresql://alice:s3cret@db.example:5432/optuna") == \
        "postgresql://alice:***@db.example:5432/optuna"
    assert trials.redacted("sqlite:///study.db") == "sqlite:///study.db"
    assert trials.redacted("journal:runs/study.log") == "journal:runs/study.log"
    with pytest.raises(ConfigError) as refused:       # a driver not installed, or a form Optuna has not
        trials.check_storage("nosuchdb+driver://alice:s3cret@db.example/optuna")
    assert "s3cret" not in str(refused.value) and "alice:***@db.example" in str(refused.value)

    def unreachable(url, heartbeat):
        raise RuntimeError(f"connection to {url} failed: password authentication failed (s3cret)")
    monkeypatch.setattr(trials, "check_storage", lambda url: None)
    monkeypatch.setattr(trials, "open_storage", unreachable)
    with pytest.raises(ConfigError) as refused:
        trials.open_given_storage(types.SimpleNamespace(storage="postgresql://alice:s3cret@db.example/optuna",
                                                        heartbeat=60))
    assert "s3cret" not in str(refused.value), refused.value
    assert str(refused.value).startswith("--storage postgresql://alice:***@db.example/optuna: cannot open it:")


# A stand-in for a worker's TensorFlow server, which binds every interface: it listens on 0.0.0.0, says its
# port, is told its peer's port and says whether it reached the peer on loopback, then waits to be closed.
LISTENER = """import socket, sys
server = socket.socket()
server.bind(("0.0.0.0", 0))
server.listen()
print(server.getsockname()[1], flush=True)
peer = int(sys.stdin.readline())
try:
    socket.create_connection(("127.0.0.1", peer), timeout=5).close()
    print("reached", flush=True)
except OSError as e:
    print(f"not reached: {e}", flush=True)
sys.stdin.read()
"""

# Two such workers started as the harness starts a local trial's, outside any namespace and then in
# netns.private_loopback's; printed: which kind, the sockets exposed in this process's namespace, the
# workers' namespaces, whether each reached the other.
TWO_WORKERS = """import contextlib, importlib.util, json, os, subprocess, sys


def by_path(name):   # standard library only; the harness package needs what an ordinary user's Python may lack
    spec = importlib.util.spec_from_file_location(name, os.path.join({where!r}, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


netns, exposed_listeners = by_path("netns"), by_path("exposure").exposed_listeners
LISTENER = {listener!r}
seen = {{"here": os.stat("/proc/self/ns/net").st_ino}}
for private in (False, True):
    with contextlib.ExitStack() as stack:
        net = netns.private_loopback(stack) if private else None
        workers = [subprocess.Popen((net.prefix(i) if net else []) + [sys.executable, "-c", LISTENER],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(2)]
        ports = [int(w.stdout.readline()) for w in workers]
        exposed = exposed_listeners([w.pid for w in workers])
        for w, peer in zip(workers, reversed(ports), strict=True):
            w.stdin.write(f"{{peer}}\\n")
            w.stdin.flush()
        seen[str(private)] = dict(kind=type(net).__name__ if net else None, exposed=exposed,
                                  namespaces=[os.stat(f"/proc/{{w.pid}}/ns/net").st_ino for w in workers],
                                  reached=[w.stdout.readline().strip() for w in workers])
        for w in workers:
            w.stdin.close()
            w.wait(timeout=30)
print(json.dumps(seen))
"""


def _two_workers(prefix=(), python=sys.executable):
    # The three modules copied where any user may read them (a checkout may sit in root's home).
    where = tempfile.mkdtemp(prefix="crossbow-exposure-")
    try:
        os.chmod(where, 0o755)
        for module in ("compare/netns.py", "compare/user_namespace.py", "distribute/exposure.py"):
            shutil.copy(os.path.join(REPO, "crossbow_tf", module), where)
        done = subprocess.run([*prefix, python, "-c", TWO_WORKERS.format(listener=LISTENER, where=where)],
                              capture_output=True, text=True, timeout=120, cwd="/")
    finally:
        shutil.rmtree(where)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _check_private(seen, kind):
    outside, inside = seen["False"], seen["True"]
    # The converse, today's way: both servers in this machine's namespace, on every interface.
    assert [(address, port > 0) for _, address, port in outside["exposed"]] == [("0.0.0.0", True)] * 2, outside
    assert outside["namespaces"] == [seen["here"]] * 2
    # In the private namespace: one for both, not this machine's, nothing exposed, and they reach each other.
    assert inside["kind"] == kind and inside["exposed"] == [], inside
    assert len(set(inside["namespaces"])) == 1 and inside["namespaces"][0] != seen["here"], inside
    assert inside["reached"] == ["reached", "reached"] == outside["reached"], (inside, outside)


def test_as_root_a_local_trials_workers_listen_in_a_private_namespace_not_on_the_machines_interfaces():
    assert os.geteuid() == 0, "CI runs as root: this test is the root half"
    _check_private(_two_workers(), "PrivateLoopback")


def test_as_an_ordinary_user_the_workers_share_a_private_user_and_network_namespace():
    # setpriv drops to nobody (uid 65534); a Python that nobody may run (the venv's may live under /root).
    drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv on this machine to drop to an ordinary user")
    starts_itself = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
    python = next((p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
                   if subprocess.run([*drop, p, "-c", starts_itself], capture_output=True).returncode == 0), None)
    if python is None:
        pytest.skip("no Python an ordinary user may run here")
    refused = subprocess.run([*drop, "unshare", "--user", "--net", "true"], capture_output=True, text=True)
    if refused.returncode != 0:
        pytest.skip(f"this kernel gives ordinary users no namespaces: {refused.stderr.strip()}")
    _check_private(_two_workers(drop, python), "UserLoopback")


def _gone(pid):
    """Whether process PID has ended (a zombie not yet reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _command(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def test_a_killed_harness_leaves_neither_its_user_namespaces_holder_nor_a_worker_behind():
    # kill -9 runs no clean-up: the holder ends as its stdin's pipe closes, the worker by the death signal
    # it set after joining the namespace (the kernel clears the one launch.start sets).
    harness = f"""import contextlib, importlib.util, subprocess, time
spec = importlib.util.spec_from_file_location("netns", {os.path.join(REPO, "crossbow_tf", "compare", "netns.py")!r})
netns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netns)
with netns.UserLoopback() as net:
    worker = subprocess.Popen(net.prefix(0) + ["sleep", "600"])
    print(net.holder.pid, worker.pid, flush=True)
    time.sleep(600)
"""
    process = subprocess.Popen([sys.executable, "-c", harness], stdout=subprocess.PIPE, text=True)
    holder, worker = map(int, process.stdout.readline().split())
    deadline = time.monotonic() + 10   # the worker has joined the namespace and runs its command
    while _command(worker) != "sleep" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _command(worker) == "sleep" and not _gone(holder)
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while not (_gone(holder) and _gone(worker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(holder) and _gone(worker), (holder, worker)
