"""A study's runs as the trials of one Optuna study: the storage is the single source of truth of
what is planned, claimed, running and finished, so that any number of processes on any number of
machines can work through one study (docs/distributed_studies.md).

The plan is enumerated explicitly: every run of the study is enqueued as one trial (user attribute
``run``: its key, ``<subdir>/<name>`` of its files under runs/), in the order one process runs them,
so the budgets are exactly the config's. A replication of a group's best trial (the best is known
only once the group's search has finished) is enqueued as ``<group>/best_s<seed>`` and is claimed
only when every search run of its group has a complete trial, by whichever worker comes next.

A worker claims the first waiting trial it may run the way ``optuna.Study.ask`` pops one (the
storage's WAITING -> RUNNING transition, which fails for every process but one), keeps it alive
with the storage's heartbeat while its training process runs, and tells its value (the run's best
accuracy) with the run's outcome in user attributes. A worker that dies leaves a RUNNING trial
whose heartbeat stops: the next worker's ``fail_stale_trials`` marks it failed and Optuna's
retry callback (``RetryHeartbeatStaleTrialCallback``) enqueues it again (same run key), so it runs again and, being one key,
is counted once. On a journal storage, which Optuna gives no heartbeat, the workers beat in a
user attribute of the trial and fail a silent one themselves (``Study.fail_silent_trials``).
Nothing here imports TensorFlow.
"""
import argparse
import dataclasses
import hashlib
import os
import random
import re
import socket
import threading
import time
import warnings

import optuna
from optuna.storages import fail_stale_trials
from optuna.trial import TrialState

from crossbow_tf.compare.launch import read_hostfile
from crossbow_tf.device_choice import visible_gpu_ids
from crossbow_tf.errors import ConfigError

PLAN_ATTR = "crossbow_plan"    # the study's user attribute: the fingerprint of the plan it holds
STORAGE_FILE = "study.db"      # the default storage: an SQLite file inside the report directory
DEFAULT_HEARTBEAT = 30         # seconds; a trial is stale (its worker dead) after 3 heartbeats missed
MAX_RETRY = 3                  # a run whose worker died is taken again at most this many times
BEAT_ATTR = "heartbeat"        # a trial's user attribute on a journal storage: [trial number, time of the last beat]
POLL = 2.0                     # seconds between looks at the storage while waiting for a claimable trial

try:   # Optuna 4.9 renamed the retry of a heartbeat-stale trial
    from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
    RETRY_ARGUMENT = "heartbeat_stale_trial_callback"
except ImportError:
    from optuna.storages import RetryFailedTrialCallback as Retry
    RETRY_ARGUMENT = "failed_trial_callback"

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


@dataclasses.dataclass
class Item:
    """One run of the plan: a search run (its config known now) or a replication of its group's best."""
    key: str                  # search: "<subdir>/<name>"; replication: "<group>/best_s<seed>"
    group: str                # the runs whose search decides a replication (an entry, a cell)
    seed: int
    replicate: bool = False
    config_hash: str = None   # search runs: the hash of the run's config (part of the plan's fingerprint)


def default_storage(out_dir):
    return f"sqlite:///{os.path.abspath(os.path.join(out_dir, STORAGE_FILE))}"


STORAGE_FORMS = "sqlite:///FILE, a database URL (postgresql://, mysql://) or journal:FILE"


_USER_PASSWORD = re.compile(r"(?P<head>//[^/@:]*:)(?P<password>[^/@]*)@")


def _password(url):
    match = _USER_PASSWORD.search(url)
    return match.group("password") if match and match.group("password") else None


def redacted(url):
    """URL with the password of its user:password@ part shown as ***, for every line that names it
    (a database URL may carry one: no error, progress line, log or report prints it)."""
    return _USER_PASSWORD.sub(lambda m: f"{m.group('head')}***@", url)


def check_storage(url):
    """Raises ConfigError (one line naming --storage) unless URL is a storage Optuna can open: its
    form, its database driver and, for a file (SQLite, journal), its folder. Nothing is created."""
    if url.startswith("journal:"):
        _check_storage_file(url, url[len("journal:"):], makes_folder=True)
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError
    try:
        parsed = make_url(url)
        parsed.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError):
        raise ConfigError(f"--storage {redacted(url)}: not a storage URL ({STORAGE_FORMS})") from None
    except ImportError as e:   # a known database whose driver is not installed
        raise ConfigError(f"--storage {redacted(url)}: its database driver is not installed "
                          f"({e.name or e})") from None
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise ConfigError(f"--storage {redacted(url)}: an SQLite storage needs a file (sqlite:///FILE)")
        _check_storage_file(url, parsed.database, makes_folder=False)


def _check_storage_file(url, path, makes_folder):
    """The storage file PATH of URL is a file, or one can be created (its folder exists, unless
    MAKES_FOLDER: the nearest existing one is writable)."""
    if not path:
        raise ConfigError(f"--storage {redacted(url)}: names no file")
    if os.path.isdir(path):
        raise ConfigError(f"--storage {redacted(url)}: {path} is a directory; give a file")
    folder = os.path.dirname(path) or "."
    if makes_folder:
        while not os.path.exists(folder) and os.path.dirname(os.path.abspath(folder)) != os.path.abspath(folder):
            folder = os.path.dirname(os.path.abspath(folder))
    if not os.path.isdir(folder):
        what = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise ConfigError(f"--storage {redacted(url)}: the folder {folder} {what}")
    if not os.access(folder, os.W_OK | os.X_OK) and not os.path.exists(path):
        raise ConfigError(f"--storage {redacted(url)}: no permission to create a file in {folder}")


def open_storage(url, heartbeat=DEFAULT_HEARTBEAT):
    """An Optuna storage for URL: a database URL (sqlite:///file, mysql://, postgresql://) with the
    heartbeat and the retry of dead workers' trials, or ``journal:PATH`` (Optuna's journal file on a
    shared filesystem; Optuna gives it no heartbeat, so the workers keep their own there:
    Study.fail_silent_trials)."""
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage
        path = url[len("journal:"):]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return JournalStorage(JournalFileBackend(path))
    sqlite = url.startswith("sqlite:")
    for attempt in range(5):   # processes starting together may race to create the schema
        try:
            storage = optuna.storages.RDBStorage(
                url, engine_kwargs={"connect_args": {"timeout": 120}} if sqlite else None,
                heartbeat_interval=heartbeat, grace_period=3 * heartbeat, **{RETRY_ARGUMENT: Retry(max_retry=MAX_RETRY)})
            break
        except Exception:   # noqa: BLE001 - sqlalchemy's OperationalError and its kin
            if attempt == 4:
                raise
            time.sleep(0.5 + random.random())
    if sqlite:
        _serialize_sqlite(storage.engine)
    return storage


def _serialize_sqlite(engine):
    """Every transaction on the SQLite file takes its write lock first (BEGIN IMMEDIATE): Python's
    sqlite3 otherwise reads outside any transaction, so two processes could both read a trial as
    WAITING and both claim it. The servers Optuna supports lock the row (SELECT ... FOR UPDATE)."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None   # the driver's own BEGIN off; ours below

    @event.listens_for(engine, "begin")
    def _begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    engine.dispose()   # connections made before the listeners are dropped


def fingerprint(items):
    text = "\n".join(f"{i.key} {i.group} {i.seed} {i.replicate} {i.config_hash}" for i in items)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_hash(text):
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Study:
    """The plan's trials in one Optuna study of STORAGE, and the worker loop that runs them."""

    def __init__(self, storage, name, items, replan=False, worker=False, say=print, heartbeat=DEFAULT_HEARTBEAT):
        self.storage, self.name, self.items, self.say = storage, name, list(items), say
        self.by_key = {i.key: i for i in self.items}
        self.order = {i.key: n for n, i in enumerate(self.items)}
        keys = [i.key for i in self.items]
        if len(set(keys)) != len(keys):
            raise ConfigError("the plan names one run twice")   # a bug in a planner, not a config error
        self.search = {}
        for i in self.items:
            if not i.replicate:
                self.search.setdefault(i.group, []).append(i.key)
        self.poll = min(POLL, max(0.2, heartbeat / 3))
        self.heartbeat = heartbeat
        # Optuna gives its journal storage no heartbeat: the workers keep one of their own there.
        self.own_heartbeat = type(storage).__name__ == "JournalStorage"
        mark = fingerprint(self.items)
        try:
            self.study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            self.study = optuna.load_study(study_name=name, storage=storage)
            created = False
        held = self.study.user_attrs.get(PLAN_ATTR)
        deadline = time.time() + 60
        while not created and not replan and held is None and time.time() < deadline:
            time.sleep(0.5)   # another process created the study and is enqueueing its plan
            held = self.study.user_attrs.get(PLAN_ATTR)
        if replan:
            self.give_back_dead_local()
        if created or replan or (held is None and not worker):
            self.enqueue_missing()
            self.study.set_user_attr(PLAN_ATTR, mark)
        elif held != mark:
            raise ConfigError(f"the study {name!r} in this storage holds another plan (another config or other "
                              "overrides); start every worker with the same command, or rerun the command "
                              "without --worker with --resume to plan it anew")

    # -- the storage's view ---------------------------------------------------------------------

    def trials(self):
        return self.study.get_trials(deepcopy=False)

    def current(self, trials=None):
        """{key: the COMPLETE trial that counts for it} (the last one, should a key finish twice)."""
        done = {}
        for t in trials if trials is not None else self.trials():
            if t.state == TrialState.COMPLETE and t.user_attrs.get("run") in self.by_key:
                done[t.user_attrs["run"]] = t
        return done

    def enqueue_missing(self):
        """Enqueues every run of the plan that has no trial waiting or running. A run finished before
        is taken again and reused from its files by the runner when its settings are unchanged (a
        failed run or a changed config runs again), exactly as --resume always did."""
        trials = self.trials()
        pending = {t.user_attrs.get("run") for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)}
        for item in self.items:
            if item.key not in pending:
                self.study.enqueue_trial({}, user_attrs={"run": item.key})

    def give_back_dead_local(self):
        """Fails (and enqueues again) the running trials of this machine whose worker process is gone:
        a study killed here is resumed at once instead of after the heartbeat's grace period."""
        host = socket.gethostname()
        for t in self.trials():
            where = str(t.user_attrs.get("worker", "")).split(":")
            if t.state != TrialState.RUNNING or len(where) != 3 or where[0] != host:
                continue
            try:
                os.kill(int(where[1]), 0)
                continue   # alive
            except ProcessLookupError:
                pass
            except (PermissionError, ValueError):
                continue
            if self.storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                Retry(max_retry=MAX_RETRY)(self.study, self.storage.get_trial(t._trial_id))

    def fail_silent_trials(self, now=None):
        """fail_stale_trials for a storage without Optuna's heartbeat (the journal): a running trial
        whose worker's own beat (user attribute BEAT_ATTR: [trial number, time]) is older than three
        heartbeats is failed and enqueued again by the retry callback, as Optuna does for a database.
        Returns the run keys given back."""
        now = time.time() if now is None else now
        given_back = []
        for t in self.trials():
            beat = t.user_attrs.get(BEAT_ATTR)
            # A retry copies its trial's attributes: a beat counts only for the trial that made it.
            if t.state != TrialState.RUNNING or not beat or beat[0] != t.number or now - beat[1] <= 3 * self.heartbeat:
                continue
            try:
                failed = self.storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
            except RuntimeError:   # another worker failed it first (UpdateFinishedTrialError)
                continue
            if failed:
                Retry(max_retry=MAX_RETRY)(self.study, self.storage.get_trial(t._trial_id))
                given_back.append(t.user_attrs.get("run"))
        return given_back

    def complete(self):
        return set(self.current()) >= set(self.by_key)

    def counts(self):
        """{state name: trials} of this study, for the report and the tests."""
        out = {}
        for t in self.trials():
            out[t.state.name] = out.get(t.state.name, 0) + 1
        return out

    # -- working ----------------------------------------------------------------------------------

    def _claim(self):
        """(trial, item) of the first waiting trial this worker may run, claimed; (None, None) when
        none may run now; raises StopIteration when nothing is waiting or running."""
        fail_stale_trials(self.study)   # a dead worker's trial: failed, and enqueued again by the callback
        if self.own_heartbeat:
            self.fail_silent_trials()
        trials = self.trials()
        done = self.current(trials)
        # In the plan's order (a retried trial keeps its place), then oldest first.
        waiting = sorted((t for t in trials if t.state == TrialState.WAITING),
                         key=lambda t: (self.order.get(t.user_attrs.get("run"), len(self.order)), t.number))
        if not waiting and not any(t.state == TrialState.RUNNING for t in trials):
            raise StopIteration
        for t in waiting:
            item = self.by_key.get(t.user_attrs.get("run"))
            if item is None:
                continue   # another plan's run: left to the process that planned it
            if item.replicate and not all(k in done for k in self.search[item.group]):
                continue   # its group's search is not finished
            # The claim of Study.ask: WAITING -> RUNNING succeeds for one process only.
            if self.storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                return t, item
        return None, None

    def work(self, run_item, slots):
        """Runs trials until the study has nothing left, in len(SLOTS) threads side by side;
        RUN_ITEM(item, slot) runs one and returns (value, {user attrs})."""
        errors = []

        def loop(slot):
            try:
                while True:
                    try:
                        trial, item = self._claim()
                    except StopIteration:
                        return
                    if trial is None:
                        time.sleep(self.poll * (0.5 + random.random()))
                        continue
                    self._run(trial, item, run_item, slot)
            except BaseException as e:   # noqa: B036 - handed to the main thread
                errors.append(e)
        if len(slots) == 1:
            loop(slots[0])
        else:
            threads = [threading.Thread(target=loop, args=(s,), daemon=True) for s in slots]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        if errors:
            raise errors[0]

    def _run(self, trial, item, run_item, slot):
        tid = trial._trial_id
        stop = threading.Event()
        beat = getattr(self.storage, "get_heartbeat_interval", lambda: None)()
        if self.own_heartbeat:
            beat = self.heartbeat

            def record(tid):
                self.storage.set_trial_user_attr(tid, BEAT_ATTR, [trial.number, time.time()])
        else:
            record = getattr(self.storage, "record_heartbeat", None)
        if beat:
            record(tid)

            def pulse():
                while not stop.wait(beat):
                    try:
                        record(tid)
                    except Exception:   # noqa: BLE001 - a missed beat; the next one tries again
                        pass
            threading.Thread(target=pulse, daemon=True).start()
        try:
            self.storage.set_trial_user_attr(tid, "worker", f"{socket.gethostname()}:{os.getpid()}:{slot.index}")
            value, attrs = run_item(item, slot)
        except BaseException:
            stop.set()
            # Interrupted (Ctrl-C) or broken: the trial is given back at once, not after the heartbeat.
            try:
                self.storage.set_trial_state_values(tid, state=TrialState.FAIL)
                Retry(max_retry=MAX_RETRY)(self.study, self.storage.get_trial(tid))
            except Exception:   # noqa: BLE001 - the heartbeat still gives it back
                pass
            raise
        stop.set()
        try:
            for key, v in attrs.items():
                self.storage.set_trial_user_attr(tid, key, v)
            self.study.tell(trial.number, value)
        except (RuntimeError, ValueError):   # optuna's UpdateFinishedTrialError is a RuntimeError
            # Its heartbeat was missed for so long that another worker took it as dead and runs it
            # again: that one counts (the files are the same run's).
            self.say(f"note: {item.key} was taken over by another worker after missed heartbeats")


# ---------------------------------------------------------------------------------------------
# Slots: what one trial running beside others gets of this machine.


@dataclasses.dataclass
class Slot:
    index: int
    env: dict                 # added to the training process's environment
    cpus: tuple = None        # CPU affinity of the training process (None: the whole machine)


def visible_gpus():
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else nvidia-smi's list, else
    (no nvidia-smi on PATH) TensorFlow's own, so that --parallel never hides GPUs it did not see."""
    return visible_gpu_ids()


def slot_gpus(slot):
    """The GPU ids a trial in SLOT gets (None: those of this process)."""
    if slot is None or "CUDA_VISIBLE_DEVICES" not in slot.env:
        return None
    return visible_gpu_ids(environ=slot.env)


def make_slots(parallel, gpus_per_trial=None):
    """PARALLEL slots. With GPUs, slot i gets its own GPUS_PER_TRIAL of them (default: an equal
    share) through CUDA_VISIBLE_DEVICES; on CPUs, its share of the cores (CPU affinity and
    TensorFlow's intra- and inter-op thread counts), the config's logical devices made inside it.
    One slot (the default) changes nothing: the run gets the machine, as before."""
    check_counts(parallel, gpus_per_trial)
    gpus = visible_gpus()
    if gpus:
        per = gpus_per_trial or max(1, len(gpus) // parallel)
        if per * parallel > len(gpus):
            raise ConfigError(f"--parallel {parallel} with {per} GPU(s) per trial needs {per * parallel} GPUs; "
                              f"{len(gpus)} visible")
        if parallel == 1 and not gpus_per_trial:
            return [Slot(0, {})]
        return [Slot(i, {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])}) for i in range(parallel)]
    if parallel == 1:
        return [Slot(0, {})]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // parallel)
    slots = []
    for i in range(parallel):
        mine = tuple(cores[(i * per + j) % len(cores)] for j in range(per))
        n = str(len(mine))
        slots.append(Slot(i, {"TF_NUM_INTRAOP_THREADS": n, "TF_NUM_INTEROP_THREADS": n, "OMP_NUM_THREADS": n,
                              "CUDA_VISIBLE_DEVICES": ""}, mine))
    return slots


# ---------------------------------------------------------------------------------------------
# The commands' flags.


@dataclasses.dataclass
class Options:
    storage: str = None       # None: the default SQLite file in the report directory
    name: str = None          # the Optuna study's name (default_name: crossbow:<report folder's name>-<config hash>)
    worker: bool = False
    parallel: int = 1
    heartbeat: int = DEFAULT_HEARTBEAT
    gpus_per_trial: int = None
    replan: bool = False      # --resume without --worker: plan anew, rerun what failed
    hosts: tuple = None       # --hosts, or --hostfile's: the machines of multi-worker trials (host or host:port each)


def host_names(text):
    """--hosts's value: comma-separated host or host:port names."""
    names = [h.strip() for h in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty host name; give HOST[,HOST...]")
    return tuple(names)


def add_arguments(parser):
    """--parallel, --storage, --worker, --study-name, --heartbeat, --gpus-per-trial, --hosts, --hostfile."""
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="run N trials side by side on this machine, each in its own process with its share "
                             "of the cores or its own GPUs")
    parser.add_argument("--storage", metavar="URL",
                        help="the study's Optuna storage: sqlite:///FILE, a database URL, or journal:FILE "
                             "(default: sqlite in the report directory)")
    parser.add_argument("--worker", action="store_true",
                        help="join the study in --storage: run its next unclaimed trials until none is left")
    parser.add_argument("--study-name", help="the Optuna study's name (default: crossbow:<report folder's name>-<hash "
                                             "of the config file>, kept in the report directory)")
    parser.add_argument("--heartbeat", type=int, default=DEFAULT_HEARTBEAT, metavar="SECONDS",
                        help="a running trial's heartbeat; after 3 missed, its worker is taken as dead and the "
                             "trial runs again")
    parser.add_argument("--gpus-per-trial", type=int, metavar="D",
                        help="GPUs each trial is pinned to with --parallel (default: an equal share)")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("--hosts", type=host_names, metavar="HOST[,HOST...]",
                       help="machines of multi-worker trials: worker i on the i-th, started through "
                            "CROSSBOW_LAUNCHER (default: srun on that node); default: free ports on this machine "
                            "(or CROSSBOW_HOSTS)")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="the machines of --hosts in a file, one a line (# comments; or CROSSBOW_HOSTFILE)")


def check_counts(parallel, gpus_per_trial=None, heartbeat=None):
    """Raises ConfigError naming the flag and value when --parallel, --heartbeat or --gpus-per-trial is
    below 1 (None: not given)."""
    for flag, value in (("--parallel", parallel), ("--heartbeat", heartbeat), ("--gpus-per-trial", gpus_per_trial)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")


def options(args, out):
    """Options of ARGS for the study in OUT; a bad combination is a ConfigError (exit 2)."""
    if args.worker and not args.storage:
        raise ConfigError("--worker joins the study of a shared --storage URL; pass --storage")
    if args.worker and getattr(args, "force", False):
        raise ConfigError("--worker cannot be combined with --force (a worker never empties the report directory)")
    check_counts(args.parallel, args.gpus_per_trial, args.heartbeat)
    hosts = args.hosts
    if args.hostfile:   # read here once; the runs take the names from Options
        try:
            hosts = tuple(read_hostfile(args.hostfile))
        except OSError as e:
            raise ConfigError(f"--hostfile {args.hostfile}: {e.strerror}") from None
        if not hosts:
            raise ConfigError(f"--hostfile {args.hostfile} names no host")
    return Options(storage=args.storage, name=args.study_name or default_name(out, getattr(args, "config", None)),
                   worker=args.worker, parallel=args.parallel, heartbeat=args.heartbeat,
                   gpus_per_trial=args.gpus_per_trial, replan=bool(getattr(args, "resume", False)) and not args.worker,
                   hosts=hosts)


NAME_FILE = ".crossbow_study"   # in the report directory: the study's default name, for --resume


def default_name(out, config=None):
    """The study's default name: the report folder's name and a hash of its config file's text, so
    that two studies whose folders share a name do not meet in a shared storage, while every worker
    started with the same command computes the same name. A report directory keeps the name it was
    first given (NAME_FILE), so --resume finds its study after the config was edited; one made
    before names were kept (its own study.db, no NAME_FILE) keeps the folder's name alone."""
    folder = os.path.basename(os.path.abspath(out))
    stored = os.path.join(out, NAME_FILE)
    if os.path.isfile(stored):
        with open(stored, encoding="utf-8") as f:
            name = f.read().strip()
        if name:
            return name
    if os.path.exists(os.path.join(out, STORAGE_FILE)):
        return f"crossbow:{folder}"
    try:
        with open(config, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:8]
    except (OSError, TypeError):   # no config file (a test's stand-in): the folder's name alone
        return f"crossbow:{folder}"
    return f"crossbow:{folder}-{digest}"


def remember_name(opts, out):
    """Keeps the study's name in report directory OUT (made by now), for --resume and the workers."""
    path = os.path.join(out, NAME_FILE)
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(opts.name + "\n")


def claim_report(study, out):
    """True for the one worker that writes the report of STUDY (a trials.Study, complete) in OUT:
    the first to create a claim file for the study's plan (O_EXCL, atomic on a local or NFS
    filesystem). The other workers print one line and leave it; the command without --worker
    always writes it."""
    path = os.path.join(out, f".report-{study.name.replace(':', '_')}-{fingerprint(study.items)}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def open_given_storage(opts):
    """Opens the --storage of OPTS (checked first), so that a storage that cannot be opened is one
    line before the report directory is made; None for the default SQLite file (made with it)."""
    if not opts.storage:
        return None
    check_storage(opts.storage)
    try:
        return open_storage(opts.storage, opts.heartbeat)
    except Exception as e:   # noqa: BLE001 - sqlalchemy's and the drivers' errors, as one line
        reason = (str(getattr(e, "orig", None) or e).strip().splitlines() or [type(e).__name__])[0]
        password = _password(opts.storage)
        if password:
            reason = reason.replace(password, "***")
        raise ConfigError(f"--storage {redacted(opts.storage)}: cannot open it: {reason}") from None


def joins(args):
    """True when the report directory may exist already without --resume: a worker, or a command
    given the study's shared storage (it runs what is left and writes the report)."""
    return bool(args.worker or args.storage)


def forget(opts):
    """--force with a storage of its own: the old study goes too (its runs' files have gone)."""
    if opts.storage:
        storage = open_storage(opts.storage, opts.heartbeat)
        for name in (opts.name, opts.name + ":sweep"):
            try:
                optuna.delete_study(study_name=name, storage=storage)
            except KeyError:
                pass
