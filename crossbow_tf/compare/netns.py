"""Workers behind a real bandwidth limit on one machine: one network namespace per worker, joined to
a bridge in a namespace of its own by a veth pair, each worker's side shaped with ``tc`` (netem's
delay, then a token bucket at the rate). Needs root (``ip netns``); nothing here imports TensorFlow.

    with Network(2, Limit("100mbit", "1ms")) as net:       # (or Limit.parse("100mbit/1ms"))
        net.addresses        # ["10.213.0.1", "10.213.0.2"]: the workers' TF_CONFIG hosts
        net.prefix(i)        # ["ip", "netns", "exec", "<worker i's namespace>"]: run a command inside

Every worker sends through its own shaped link, so each direction of every pair of workers is
limited to the rate, with the delay added once per hop. The namespaces and links are removed when
the block ends, also on an exception or Ctrl-C; after a kill (-9) of the harness, the next Network
(or ``remove_stale()``) removes the namespaces whose owner process is gone: their names carry its pid.
"""
import dataclasses
import os
import re
import subprocess
import sys

NAME = re.compile(r"^cbn(\d+)x(\d+)-")   # cbn<pid>x<serial>-hub, cbn<pid>x<serial>-w<i>
_serial = [0]


class NetworkError(RuntimeError):
    """The machine refuses namespaces (not root, no ip or tc, no kernel support): one line."""


@dataclasses.dataclass(frozen=True)
class Limit:
    rate: str = "1gbit"       # tc's rate syntax: 1gbit, 100mbit
    delay: str = "0ms"        # netem's delay, per direction

    @classmethod
    def parse(cls, text):
        """'100mbit' or '100mbit/2ms'."""
        rate, _, delay = text.partition("/")
        if not re.fullmatch(r"\d+(\.\d+)?[kmg]?bit", rate.strip()) or (delay and not re.fullmatch(
                r"\d+(\.\d+)?(us|ms|s)", delay.strip())):
            raise ValueError(f"{text!r}: expected RATE[/DELAY], e.g. 100mbit/1ms")
        return cls(rate.strip(), delay.strip() or "0ms")

    def describe(self):
        return f"{self.rate}, {self.delay} delay"

    def delayed(self):
        return re.fullmatch(r"0+(\.0+)?(us|ms|s)", self.delay) is None

    def text(self):
        """As written in a config or CROSSBOW_NETWORK: '100mbit', '100mbit/1ms' (parse's inverse)."""
        return f"{self.rate}/{self.delay}" if self.delayed() else self.rate

    def label(self):
        """A file name's form of text(), without '/': '100mbit', '100mbit-1ms'."""
        return self.text().replace("/", "-")


def _run(*command):
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(command)}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout


def namespaces():
    try:
        return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]
    except (NetworkError, FileNotFoundError):
        return []


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_stale():
    """Removes the namespaces of Networks whose process is gone (a harness killed outright)."""
    for name in namespaces():
        m = NAME.match(name)
        if m and not _alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Network:
    """WORKERS namespaces behind LIMIT (see the module doc)."""

    def __init__(self, workers, limit):
        _serial[0] += 1
        self.workers, self.limit = workers, limit
        self.tag = f"cbn{os.getpid()}x{_serial[0]}"
        self.hub = f"{self.tag}-hub"
        subnet = 1 + (os.getpid() * 7 + _serial[0]) % 250
        self.addresses = [f"10.213.{subnet}.{i + 1}" for i in range(workers)]
        self.made = []

    def name(self, i):
        return f"{self.tag}-w{i}"

    def prefix(self, i):
        return ["ip", "netns", "exec", self.name(i)]

    def __enter__(self):
        remove_stale()
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def _make(self):
        self._netns(self.hub)
        self._in(self.hub, "ip", "link", "add", "br0", "type", "bridge")
        self._in(self.hub, "ip", "link", "set", "br0", "up")
        for i in range(self.workers):
            ns = self.name(i)
            self._netns(ns)
            mine = f"w{i}x{self.tag[3:]}"[:15]
            theirs = f"h{i}x{self.tag[3:]}"[:15]
            _run("ip", "link", "add", mine, "type", "veth", "peer", "name", theirs)
            _run("ip", "link", "set", mine, "netns", ns)
            _run("ip", "link", "set", theirs, "netns", self.hub)
            self._in(self.hub, "ip", "link", "set", theirs, "master", "br0", "up")
            self._in(ns, "ip", "addr", "add", f"{self.addresses[i]}/24", "dev", mine)
            self._in(ns, "ip", "link", "set", mine, "up")
            self._in(ns, "ip", "link", "set", "lo", "up")
            self._shape(ns, mine)

    def _shape(self, ns, device):
        """DEVICE's egress: netem's delay (when there is one; the kernel needs sch_netem), then a
        token bucket at the rate."""
        token_bucket = ["tbf", "rate", self.limit.rate, "burst", "256kb", "latency", "100ms"]
        if not self.limit.delayed():
            self._in(ns, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:", *token_bucket)
            return
        self._in(ns, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "netem", "delay", self.limit.delay)
        self._in(ns, "tc", "qdisc", "add", "dev", device, "parent", "1:", "handle", "10:", *token_bucket)

    def _netns(self, name):
        _run("ip", "netns", "add", name)
        self.made.append(name)

    def _in(self, ns, *command):
        return _run("ip", "netns", "exec", ns, *command)

    def remove(self):
        """Deletes every namespace made (their links go with them); safe to call twice."""
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made = []


class PrivateLoopback(Network):
    """One network namespace with only its loopback, for every worker of a trial that runs on this
    machine (issue 52): their TensorFlow servers, which bind every interface, can then be reached by
    nobody but each other. A Network's naming, removal and stale removal.

        with PrivateLoopback() as net:
            net.prefix(i)      # ["ip", "netns", "exec", "<the namespace>"], for every worker i
    """

    addresses = None   # the workers' TF_CONFIG hosts: loopback, as without a namespace

    def __init__(self):
        _serial[0] += 1
        self.tag = f"cbn{os.getpid()}x{_serial[0]}"
        self.made = []

    def name(self, i=0):
        return f"{self.tag}-lo"

    def _make(self):
        self._netns(self.name())
        self._in(self.name(), "ip", "link", "set", "lo", "up")


class UserLoopback:
    """PrivateLoopback for a user who is not root (or a machine without ``ip netns``): one network
    namespace with only loopback, owned by a user namespace of its own (user_namespace.py). A holder
    process keeps both; each worker joins them, through ``prefix(i)``, before its command runs.

        with UserLoopback() as net:
            net.prefix(i)      # [python, ".../user_namespace.py", "enter", "<holder pid>", "--"]
    """

    addresses = None   # the workers' TF_CONFIG hosts: loopback, as without a namespace
    SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "user_namespace.py")

    def __init__(self):
        self.holder = None

    def name(self, i=0):
        return f"the user namespace held by process {self.holder.pid}"

    def prefix(self, i):
        return [sys.executable, self.SCRIPT, "enter", str(self.holder.pid), "--"]

    def __enter__(self):
        self.holder = subprocess.Popen([sys.executable, self.SCRIPT, "hold"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.holder.stdout.readline().strip() != "ready":
            why = self.holder.stderr.read().strip().splitlines()[-1:]
            self.holder.wait()
            raise NetworkError(f"a user namespace: {why[0] if why else 'the holder ended'}")
        return self

    def __exit__(self, *exc):
        self.holder.stdin.close()
        try:
            self.holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.holder.kill()
            self.holder.wait()
        return False


def private_loopback(stack):
    """A namespace with only loopback for the workers of one machine, entered on STACK: PrivateLoopback as
    root, else UserLoopback; NetworkError (both reasons) where the machine allows neither."""
    reasons = []
    for kind in (PrivateLoopback, UserLoopback):
        try:
            return stack.enter_context(kind())
        except (NetworkError, OSError) as e:
            reasons.append(str(e).strip() or type(e).__name__)
    raise NetworkError("; ".join(reasons))


MAKE_PRIVATE = ("allow user namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0) "
                "or run the harness as root")
EXPOSED_NOTE = ("the workers' TensorFlow servers will be reachable on every interface of this machine while the "
                "trial runs, without authentication ({why}); " + MAKE_PRIVATE + " to keep them in a private network "
                "namespace, or set CROSSBOW_PRIVATE_WORKERS=require to refuse such trials (docs/multiworker.md#security)")


class ExposureRefused(NetworkError):
    """CROSSBOW_PRIVATE_WORKERS=require refuses workers whose servers no private namespace would hide."""


def private_or_exposed(stack):
    """For the workers of one machine: (the private namespace, entered on STACK, None); where the machine
    allows none, (None, the note that their servers will be exposed and how to stop that); under
    CROSSBOW_PRIVATE_WORKERS=require, ExposureRefused instead of that note."""
    try:
        return private_loopback(stack), None
    except NetworkError as e:
        note = EXPOSED_NOTE.format(why=f"no private network namespace here: {e}")
    if os.environ.get("CROSSBOW_PRIVATE_WORKERS", "").strip() == "require":
        raise ExposureRefused(f"CROSSBOW_PRIVATE_WORKERS=require: {note}")
    return None, note


def refusal():
    """None when this machine lets us make namespaces, else why not (one line)."""
    try:
        with Network(2, Limit("1gbit")):
            return None
    except (NetworkError, FileNotFoundError, PermissionError) as e:
        return f"network namespaces are not available here ({e})"


def check_available():
    """None when this machine lets us make namespaces, else the one-line reason (loopback follows)."""
    refused = refusal()
    return None if refused is None else f"{refused}; workers run on loopback only"
