"""Starting a run's training processes: one process, or the N workers of a multi-worker trial, each
with its log, under one deadline. Nothing here imports TensorFlow.

A multi-worker trial is launched as docs/multiworker.md launches one by hand: every worker runs the
same command with its own ``TF_CONFIG`` (``crossbow_tf.distribute.cluster.local_tf_configs``: free
ports on 127.0.0.1), or, on named machines (``hosts``), through a launcher prefix that starts a
command on a host (by default Slurm's ``srun``, as the docs' Slurm job does). Worker 0 is the
chief: its output is the run's log and its results file the run's; worker i's output goes to
``<run>.worker<i>.log``. Every process is the leader of its own process group, so a deadline or a
lost peer ends the whole group (a worker whose peer never starts blocks in TensorFlow and ignores
SIGTERM: it is killed, not asked).
"""
import dataclasses
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

from crossbow_tf.cli import ABSL_LINE_AFTER_SEVERITY

# A worker that outlives a failed peer by this long is killed: a healthy one stops by itself with
# exit code 4 once TensorFlow's peer-health probe (2 s) finds its peer gone.
PEER_GRACE = 20.0
LOST_WORKER = 4      # crossbow_tf.distribute.cluster.ClusterError's exit code
ERROR_PREFIX = "crossbow_tf: error:"   # the training command's one line for the user (run.py: cli.fail)
GLUED_LOG = re.compile(rf"(?<=\S)[IWEF]{ABSL_LINE_AFTER_SEVERITY}")   # a C++ log line begun mid-line
DEFAULT_LAUNCHER = "srun --nodes=1 --ntasks=1 --nodelist={host}"
DEFAULT_PORT = 2222
HOSTS_GIVEN = "--hosts/--hostfile (CROSSBOW_HOSTS/CROSSBOW_HOSTFILE)"   # where named machines come from
# The methods whose command trains on the workers TF_CONFIG names (the engine's crossbow_tf.run,
# and the stock baseline under MultiWorkerMirroredStrategy).
MULTI_WORKER_METHODS = ("sma", "localsgd", "tf_ssgd")


def _die_with_parent():
    """In the training process before it starts (Linux): killed when the runner's thread is, so a
    worker killed mid-trial leaves no run behind writing into the files of its retry."""
    try:
        _LIBC.prctl(1, 9)   # PR_SET_PDEATHSIG, SIGKILL
    except Exception:   # noqa: BLE001 - not Linux: the run outlives its runner, as before
        pass


try:
    import ctypes
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


@dataclasses.dataclass
class Process:
    """One started training process, its log and the lines it printed last."""
    index: int
    popen: subprocess.Popen
    log: object
    tail: list = dataclasses.field(default_factory=list)
    code: int = None
    error_line: str = None   # its last "crossbow_tf: error:" line, whatever TensorFlow logged after it

    def reason(self):
        """Why this process failed, in one line: its error line, else the last line it printed."""
        return self.error_line or next((t for t in reversed(self.tail) if t.strip()), "")


def tf_configs(workers, hosts=None, port=DEFAULT_PORT):
    """TF_CONFIG texts of WORKERS workers: free ports on 127.0.0.1, or HOSTS (host or host:port)."""
    if not hosts:
        from crossbow_tf.distribute.cluster import local_tf_configs
        return local_tf_configs(workers)
    if len(hosts) < workers:
        raise ValueError(f"{workers} workers need {workers} hosts; {len(hosts)} given")
    addresses = [h if ":" in h else f"{h}:{port}" for h in hosts[:workers]]
    return [json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}})
            for i in range(workers)]


def read_hostfile(path):
    """Host names of a hostfile: one a line (the first word; # comments and blank lines skipped)."""
    with open(path) as f:
        return [line.split("#")[0].split()[0] for line in f if line.split("#")[0].strip()]


def named_hosts(hosts=None, environ=None):
    """The machines of multi-worker trials and the error that stops them, (hosts or None, error or
    None): HOSTS (trials.Options.hosts: --hosts or --hostfile's, checked there), else
    CROSSBOW_HOSTFILE's or CROSSBOW_HOSTS=a,b in ENVIRON (default os.environ); (None, None): workers on
    free local ports."""
    if hosts:
        return list(hosts), None
    environ = os.environ if environ is None else environ
    hostfile = environ.get("CROSSBOW_HOSTFILE")
    if hostfile:
        try:
            return read_hostfile(hostfile) or None, None
        except OSError as e:   # every multi-worker trial fails with this line
            return None, f"CROSSBOW_HOSTFILE {hostfile}: {e.strerror}"
    return [h.strip() for h in environ.get("CROSSBOW_HOSTS", "").split(",") if h.strip()] or None, None


def worker_command(command, tf_config, host=None, launcher=DEFAULT_LAUNCHER):
    """COMMAND as worker of TF_CONFIG: on this machine with TF_CONFIG in its environment (None), or
    on HOST through LAUNCHER (its environment given with env, which srun and ssh both pass on)."""
    if host is None:
        return command, {"TF_CONFIG": tf_config}
    name = host.rsplit(":", 1)[0]   # host or host:port; the launcher takes the machine's name
    return shlex.split(launcher.format(host=name)) + ["env", f"TF_CONFIG={tf_config}"] + command, {}


def start(index, command, env, cwd, log, cpus=None):
    """Starts COMMAND, its output for LOG (see supervise)."""
    log.flush()
    popen = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             bufsize=1, cwd=cwd, start_new_session=True,
                             preexec_fn=_die_with_parent if _LIBC else None)
    if cpus and hasattr(os, "sched_setaffinity"):
        try:   # its share of the cores (its threads, made after this, inherit it)
            os.sched_setaffinity(popen.pid, cpus)
        except OSError:
            pass
    return Process(index, popen, log)


def kill(process):
    """Ends PROCESS's whole group (the training process and anything it started), at once."""
    try:
        os.killpg(process.popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.popen.kill()


def supervise(processes, timeout, on_line=None):
    """Pumps every process's output into its log until all have exited; kills all at the deadline
    (TIMEOUT s) and the survivors PEER_GRACE s after a peer failed. ON_LINE(index, line) sees every
    line. Returns the error text (None: every process ended by itself)."""
    lines = queue.Queue()
    for p in processes:
        def pump(p=p):
            for line in p.popen.stdout:
                lines.put((p, line))
            lines.put((p, None))
        threading.Thread(target=pump, daemon=True).start()
    deadline, open_streams, error, failed_at = time.time() + timeout, len(processes), None, None
    while open_streams:
        try:
            p, line = lines.get(timeout=0.5)
        except queue.Empty:
            p = line = None
        if p is not None and line is None:
            open_streams -= 1
        elif line is not None:
            p.log.write(line)
            p.log.flush()
            p.tail = (p.tail + [line.rstrip()])[-5:]
            if ERROR_PREFIX in line:
                # TensorFlow's C++ log can land on the same line, after the message's end.
                p.error_line = GLUED_LOG.split(line[line.index(ERROR_PREFIX):].rstrip())[0]
            if on_line is not None:
                on_line(p.index, line)
        failed = [q for q in processes if q.popen.poll() not in (None, 0)]
        if failed and failed_at is None:
            failed_at = time.time()
        if error is None and time.time() > deadline:
            error = f"timed out after {timeout:.0f}s"
        if error is not None or (failed_at is not None and time.time() > failed_at + PEER_GRACE):
            for q in processes:
                if q.popen.poll() is None:
                    kill(q)
            if error is None:
                error = "a worker outlived its failed peer: killed"
    for p in processes:
        p.code = p.popen.wait()
    return error


def outcome(processes, error):
    """(exit code, error or None) of a run from its processes: the chief's, unless the chief
    finished and another worker failed (then that worker's)."""
    chief = processes[0]
    worst = next((p for p in processes if p.code != 0), chief)
    code = chief.code if chief.code != 0 else worst.code
    if code != 0 and error is None:
        who = f"worker {worst.index}: " if len(processes) > 1 and worst.index != 0 and chief.code == 0 else ""
        first = chief if chief.code != 0 else worst
        error = f"{who}exit code {first.code}: " + first.reason()
    if error is not None and len(processes) > 1 and any(p.code == LOST_WORKER for p in processes):
        codes = ", ".join(f"worker {p.index} {p.code}" for p in processes)
        error = f"lost a worker ({codes}): {error}"
    return code, error
