"""Running: the training process(es) of one run (``python -m MODULE --config RUN.yaml --results
RUN.json``, or N workers of a multi-worker run, crossbow_tf/compare/launch.py), with progress, ETA,
timeouts, logs and resume; the report directory. The studies' loops over these runs are in
crossbow_tf/compare/loops.py.

Every run is its own process: TensorFlow fixes its logical device split once per process, and a
fresh process keeps one run's tracing, caches and threads out of another's timing. By default runs
go one at a time for the same reason; with --parallel N, N go side by side, each with its share of
the machine (crossbow_tf/compare/trials.py). Only results files are read (crossbow_tf/results.py);
nothing here imports TensorFlow.
"""
import contextlib
import dataclasses
import datetime
import glob
import json
import os
import platform
import re
import shutil
import statistics
import sys
import threading
import time

import yaml

import crossbow_tf
from crossbow_tf import cli
from crossbow_tf.compare import launch, netns, trials as trials_lib
from baselines import METHODS, has_central_loop
from baselines._cli import parse_tf_ssgd_options, split_sections
from crossbow_tf import config as config_lib
from crossbow_tf.compare.report import fmt, relative_path
from crossbow_tf.compare.stats import run_summary
from crossbow_tf.errors import ConfigError, CrossbowError
from crossbow_tf.files import atomic_write_text
from crossbow_tf.results import format_problems

# Where the crossbow_tf package lives (a checkout or site-packages): the runs get it on their path,
# so that a checkout's tools/compare.py works from any folder without an install.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(crossbow_tf.__file__)))
MARKER = ".crossbow_report"   # marks a directory as ours, so --force never empties anyone else's


@dataclasses.dataclass
class RunRecord:
    label: str
    seed: int
    path: str                      # the results JSON
    summary: dict = None           # None: the run failed
    error: str = None
    duration: float = 0.0          # wall time of the whole process
    load_before: tuple = None      # 1/5/15-minute load averages when the run started
    code: int = None               # the exit code of its (chief's) process; None: not run here


@dataclasses.dataclass(frozen=True)
class Job:
    """One run of a study: what it trains and where its files go (runs/SUBDIR/NAME.*)."""
    method: str
    experiment: dict               # the validated experiment mapping
    options: dict                  # tf_ssgd's options (None for the other methods)
    subdir: str
    name: str
    label: str
    seed: int
    workers: int = 1               # worker processes of a multi-worker run (the harness starts them)
    network: netns.Limit = None    # its workers behind this limit (the limits phase); None: the runner's

    @property
    def key(self):
        return f"{self.subdir}/{self.name}"

    def paths(self, out_dir):
        """{yaml, json, log, checkpoints: path} of its files in report directory OUT_DIR."""
        base = os.path.join(out_dir, "runs", self.subdir, self.name)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        return dict({ext: f"{base}.{ext}" for ext in ("yaml", "json", "log")}, checkpoints=f"{base}.checkpoints")


def worker_log(log, index):
    """The log of worker INDEX (> 0) of a multi-worker run whose chief's log is LOG."""
    return f"{log[:-len('.log')]}.worker{index}.log"


def worker_logs(log):
    return sorted(glob.glob(glob.escape(log[:-len(".log")]) + ".worker*.log"))


def study_progress(study):
    """(trials done, trials running, trials planned) of a trials.Study, from its storage: every
    process's, so that workers of one study count alike."""
    from optuna.trial import TrialState
    trials = study.trials()
    pending = {t.user_attrs.get("run") for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)}
    running = sum(1 for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get("run") in study.by_key)
    done = sum(1 for key in study.current(trials) if key not in pending)
    return done, running, len(study.items)


def _normal_form(text):
    """A run's YAML with every default filled in, so that keys added later with their default
    values do not make a finished run look different; None when it no longer validates."""
    try:
        mapping = yaml.safe_load(text) or {}
        experiment, sections = split_sections(mapping)
        algorithm = experiment.setdefault("algorithm", {})
        if has_central_loop(algorithm.get("name", "sma")):   # a rule with allow_unstable
            # Permission to run past the stability bound changes no trajectory: runs written before
            # the guard existed are the same runs.
            algorithm["allow_unstable"] = True
        return (config_lib.to_dict(config_lib.from_dict(experiment)),
                parse_tf_ssgd_options(sections["tf_ssgd"]) if "tf_ssgd" in mapping else None)
    except (ConfigError, yaml.YAMLError, AttributeError, TypeError):
        return None


def same_run(old_text, new_text):
    """True when two run configs describe the same run (equal text, or equal with defaults filled in)."""
    if old_text == new_text:
        return True
    old = _normal_form(old_text)
    return old is not None and old == _normal_form(new_text)


# Config keys every trial's hparams hold (dotted; sections: every key in them), besides the method,
# entry, trial and seed: what grids and fixed settings usually vary.
HPARAM_KEYS = ("model", "data.name", "batch_size", "learners_per_device", "devices.logical_cpu", "epochs",
               "algorithm.", "learning_rate.", "precision")


def trial_hparams(method, experiment, options, entry, trial, seed):
    """{name: value} of one run for TensorBoard's hparams dashboard: the method, its entry, trial and
    seed, the config keys of HPARAM_KEYS and tf_ssgd's options (TensorBoard takes bool, number, str)."""
    flat = {}

    def walk(prefix, node):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                flat[f"{prefix}{key}"] = value
    walk("", experiment)
    walk("tf_ssgd.", options or {})
    chosen = {k: v for k, v in flat.items()
              if k.startswith("tf_ssgd.") or any(k == p or (p.endswith(".") and k.startswith(p)) for p in HPARAM_KEYS)}
    if method == "tf_ssgd":   # stock tf.distribute: one replica per device, no averaging rule
        chosen = {k: v for k, v in chosen.items() if k != "learners_per_device" and not k.startswith("algorithm.")}
    hparams = dict(method=method, entry=entry, trial=trial, seed=seed)
    for key, value in chosen.items():
        hparams[key] = value if isinstance(value, (bool, int, float, str)) else ("null" if value is None else str(value))
    return hparams


def run_text(experiment, options):
    """The YAML a run's process reads."""
    doc = dict(experiment, **({"tf_ssgd": options} if options is not None else {}))
    return yaml.safe_dump(doc, sort_keys=False)


EPOCH_LINE = re.compile(r"^epoch\s+(\d+)/(\d+)\s+test accuracy ([0-9.]+).*?time\s+([0-9.]+)s")


class Runner:
    """Runs training processes one after another, prints progress, keeps every file of a run."""

    def __init__(self, out_dir, total_runs, resume=False, out=sys.stdout, python=None, trials=None):
        # python: the interpreter of the training processes (CROSSBOW_RUN_PYTHON, else this one).
        python = python or os.environ.get("CROSSBOW_RUN_PYTHON") or sys.executable
        self.out_dir, self.total, self.resume, self.out, self.python = out_dir, total_runs, resume, out, python
        self.trials = trials               # trials.Options of the study (None: in memory, one at a time)
        self.study = None                  # the trials.Study of the last loop
        self.offset = 0                    # runs of earlier studies of this command (compare, then sweep)
        # Named machines for multi-worker runs (--hosts/--hostfile, else CROSSBOW_HOSTS/CROSSBOW_HOSTFILE),
        # started through CROSSBOW_LAUNCHER (default: srun on that node); else local workers on free ports.
        self._lock = threading.RLock()
        self.hosts, self.hosts_error = launch.named_hosts(trials.hosts if trials else None)
        self.launcher = os.environ.get("CROSSBOW_LAUNCHER", launch.DEFAULT_LAUNCHER)
        self.network = self._network(os.environ.get("CROSSBOW_NETWORK"))
        self._exposed_noted = False
        self.done, self.started = 0, time.time()
        self.durations = []

    def _network(self, text):
        """The bandwidth limit of local multi-worker runs (CROSSBOW_NETWORK=RATE[/DELAY], e.g.
        100mbit: each worker in a network namespace of its own, crossbow_tf/compare/netns.py), or
        None (loopback); a machine that refuses namespaces says so in one line and runs on loopback."""
        if not text or self.hosts:
            return None
        try:
            limit = netns.Limit.parse(text)
        except ValueError as e:
            self.say(f"note: CROSSBOW_NETWORK {e}; workers run on loopback")
            return None
        refused = netns.check_available()
        if refused:
            self.say(f"note: {refused}")
            return None
        return limit

    def say(self, line):
        with self._lock:
            print(line, file=self.out, flush=True)

    def side_by_side(self):
        return self.trials.parallel if self.trials else 1

    def eta(self):
        if not self.durations:
            return "?"
        left = max(self.total - self.done, 0) * statistics.mean(self.durations) / self.side_by_side()
        return _clock(left)

    def run(self, method, experiment, options, subdir, name, label, seed, target, timeout, slot=None):
        """Runs one training process (in SLOT, a trials.Slot: its share of the machine); returns its
        RunRecord (summary None when it failed)."""
        return self.run_job(Job(method, experiment, options, subdir, name, label, seed), target, timeout, slot)

    def run_job(self, job, target, timeout, slot=None):
        """Runs JOB (its one process, or its workers) unless its finished run can be reused; a trial
        that lost a worker (exit code 4) runs again, up to trials.MAX_RETRY times. Returns its RunRecord."""
        paths = job.paths(self.out_dir)
        text = run_text(job.experiment, job.options)
        head = self._head(job)
        unchanged = False
        if self.resume and os.path.exists(paths["yaml"]):
            with open(paths["yaml"]) as f:
                unchanged = same_run(f.read(), text)
        if unchanged and os.path.exists(paths["json"]):
            record = _as_planned(self._record(job.label, job.seed, paths["json"], target, 0.0, None), job, slot)
            if record.summary is not None:
                self.say(f"{head}: done before, reusing {os.path.relpath(paths['json'], self.out_dir)}")
                return record
        extra = self._fresh_files(job, paths, text, unchanged)
        self.say(f"{head} ... (elapsed {_clock(time.time() - self.started)}, ETA {self.eta()})")
        retries = trials_lib.MAX_RETRY if job.workers > 1 else 0
        for attempt in range(retries + 1):
            if attempt:
                self._keep_failed_logs(paths, attempt)
                self.say(f"      lost a worker ({record.error}); the trial runs again "
                         f"(retry {attempt} of {retries}){self._who(job)}")
            record = self._attempt(job, paths, target, timeout, slot, extra)
            if record.code != launch.LOST_WORKER:
                break
        self._tell(job, record, target)
        return record

    def _head(self, job):
        """'[  n/total] subdir label seed s': n from the study's storage when there is one (trials
        done or running, every process's), else this process's count."""
        with self._lock:
            self.done += 1
            number = self.done
        if self.study is not None:
            done, running, _ = study_progress(self.study)
            number = self.offset + done + max(running, 1)
        return f"[{number:3d}/{self.total}] {job.subdir} {job.label} seed {job.seed}"

    def _fresh_files(self, job, paths, text, unchanged):
        """Clears JOB's old files (keeping the checkpoints of the same run) and writes its config and
        TensorBoard hparams; returns the extra arguments of its process."""
        # An unfinished SMA run continues from its last checkpoint (kept only for the same run).
        if not unchanged:
            shutil.rmtree(paths["checkpoints"], ignore_errors=True)
        resumable = (["--checkpoint-dir", paths["checkpoints"], "--resume"]
                     if METHODS[job.method].module == "crossbow_tf.run" else [])
        # Every run's TensorBoard events in a folder of its own, named as its files under runs/; a
        # run that continues from its checkpoint keeps the epochs it wrote before.
        tensorboard = os.path.join(self.out_dir, "tensorboard", job.subdir, job.name)
        if not (resumable and os.path.isdir(paths["checkpoints"])):
            shutil.rmtree(tensorboard, ignore_errors=True)
            trial = job.name[:-len(f"_s{job.seed}")] if job.name.endswith(f"_s{job.seed}") else job.name
            self._write_hparams(tensorboard, trial_hparams(job.method, job.experiment, job.options, job.subdir,
                                                           trial, job.seed), f"{job.subdir}/{trial}")
        for key in ("yaml", "json", "log"):
            if os.path.exists(paths[key]):
                os.remove(paths[key])
        for old in worker_logs(paths["log"]) + glob.glob(glob.escape(paths["log"][:-len(".log")]) + ".attempt*.log"):
            os.remove(old)
        with open(paths["yaml"], "w") as f:
            f.write(text)
        return ["--tensorboard", tensorboard] + resumable

    def _keep_failed_logs(self, paths, attempt):
        """The logs of a lost attempt stay beside the retry's, as <run>.attempt<N>[.worker<i>].log."""
        base = paths["log"][:-len(".log")]
        for log in [paths["log"]] + worker_logs(paths["log"]):
            if os.path.exists(log):
                os.replace(log, f"{base}.attempt{attempt}{log[len(base):]}")
        if os.path.exists(paths["json"]):
            os.remove(paths["json"])

    def _attempt(self, job, paths, target, timeout, slot, extra):
        """Runs JOB's process(es) once; its RunRecord (summary None unless it finished)."""
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        start = time.time()
        code, error = self._spawn(job, paths, timeout, load, extra, slot)
        duration = time.time() - start
        limit = self._limit(job)
        if limit is not None:   # the results say which network they measured (loopback: no "network")
            _stamp_network(paths["json"], limit)
        with self._lock:
            self.durations.append(duration)
        record = _as_planned(self._record(job.label, job.seed, paths["json"], target, duration, load), job, slot)
        record.code = code
        # A run that diverged (exit code 3, its results say where) or collapsed (exit code 5, at chance
        # accuracy) is an outcome, not a failure.
        summary = record.summary
        finished = summary is not None and (code == 0 or (code == 3 and summary["diverged"])
                                            or (code == 5 and summary["collapsed"]))
        if finished:
            shutil.rmtree(paths["checkpoints"], ignore_errors=True)
        else:
            record.summary = None
            record.error = error or record.error or f"exit code {code}"
        return record

    def _tell(self, job, record, target):
        """Prints RECORD's outcome (and the study's progress from its storage)."""
        summary = record.summary
        if summary is None:
            self.say(f"      FAILED after {record.duration:.0f}s: {record.error} "
                     f"(log: {record.path[:-5]}.log){self._who(job)}")
        else:
            outcome = (f"{target:.2%} at epoch {summary['epochs_to_target']}, {summary['tta']:.2f}s of training"
                       if summary["reached"] else f"target not reached in {summary['epochs_run']} epochs")
            if summary["diverged"]:
                outcome = f"diverged in epoch {summary['epochs_run'] + 1}: target not reached"
            self.say(f"      {outcome}; best {fmt(summary['best_accuracy'], 4)}; "
                     f"{fmt(summary['images_per_second'], 0)} images/s; "
                     f"process {record.duration:.0f}s{self._who(job)}")

    def _private_loopback(self, stack):
        """(a PrivateLoopback entered on STACK, or None, and a refusal or None) for a trial whose workers
        all run here: where the machine refuses namespaces, one note per runner that their servers are
        exposed, or, with CROSSBOW_PRIVATE_WORKERS=require, the trial's refusal."""
        try:
            net, note = netns.private_or_exposed(stack)
        except netns.ExposureRefused as e:
            return None, str(e)
        if note and not self._exposed_noted:
            self._exposed_noted = True
            self.say(f"note: {note}")
        return net, None

    def _limit(self, job):
        """The bandwidth limit JOB's workers run behind (its own, the limits phase's, else the runner's
        CROSSBOW_NETWORK, which is None with hosts); None for loopback or one worker."""
        return (job.network or self.network) if job.workers > 1 else None

    def progress_line(self, finishing=1):
        """'study: n of N trials done (r running)', from the storage (every process's trials), with
        FINISHING trials of this process counted as done (their outcome is being told)."""
        done, running, total = study_progress(self.study)
        return f"      study: {done + finishing} of {total} trials done ({max(running - finishing, 0)} running)"

    def _who(self, job):
        return f" [{job.subdir}/{job.name}]" if self.side_by_side() > 1 else ""

    def _write_hparams(self, logdir, hparams, group):
        from crossbow_tf.tensorboard import write_hparams   # its package: checked by open_study
        write_hparams(logdir, hparams, group)

    def _record(self, label, seed, path, target, duration, load):
        record = RunRecord(label, seed, path, duration=duration, load_before=load)
        if not os.path.exists(path):
            record.error = "no results file"
            return record
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            record.error = f"unreadable results ({e})"
            return record
        problems = format_problems(data)
        if problems:
            record.error = f"malformed results: {problems[0]}"
            return record
        record.summary = run_summary(data, target)
        return record

    def _spawn(self, job, paths, timeout, load=None, extra_args=(), slot=None):
        """Starts JOB's process (or its workers, each with its TF_CONFIG) and waits for them; returns
        (exit code, error or None)."""
        # The run starts in this folder with it on its path, so that a user's model (model:
        # my_models:build or path/to/file.py:build) and data.path resolve as they do here.
        here = os.getcwd()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                   PYTHONPATH=os.pathsep.join([PACKAGE_ROOT, here] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   **(slot.env if slot else {}))
        env.pop("TF_CONFIG", None)
        cmd = [self.python, "-m", METHODS[job.method].module, "--config", paths["yaml"], "--results", paths["json"],
               *extra_args]
        shown = [relative_path(a) for a in cmd]   # names no machine's folders
        tag = f" [{job.subdir}/{job.name}]" if self.side_by_side() > 1 else ""

        def on_line(index, line):
            m = EPOCH_LINE.match(line) if index == 0 else None
            if m:
                self.say(f"      epoch {m.group(1)}/{m.group(2)}  accuracy {float(m.group(3)):.4f}  "
                         f"{float(m.group(4)):.2f}s{tag}")
        logs = [paths["log"]] + [worker_log(paths["log"], i) for i in range(1, job.workers)]
        if job.workers > 1 and self.hosts_error:
            return 2, self.hosts_error
        if self.hosts and len(self.hosts) < job.workers:
            return 2, f"{job.workers} workers need {job.workers} hosts; {launch.HOSTS_GIVEN} name {len(self.hosts)}"
        limit = self._limit(job)
        if job.network is not None and (job.workers == 1 or self.hosts):
            return 2, (f"a run behind {job.network.text()} needs its {job.workers} worker(s) started here in "
                       "namespaces" + (f", not on the hosts of {launch.HOSTS_GIVEN}" if self.hosts else ""))
        with contextlib.ExitStack() as stack:
            try:
                net = stack.enter_context(netns.Network(job.workers, limit)) if limit else None
            except (netns.NetworkError, OSError) as e:   # the machine refused namespaces: a failed trial
                return 2, f"network namespaces behind {limit.text()}: {e}"
            if net is None and job.workers > 1 and not self.hosts:
                net, refused = self._private_loopback(stack)
                if refused:
                    return 2, refused
            configs = (launch.tf_configs(job.workers, net.addresses if net else self.hosts) if job.workers > 1
                       else [None])
            processes = []
            for i, (log_path, tf_config) in enumerate(zip(logs, configs, strict=True)):
                log = stack.enter_context(open(log_path, "w"))
                command, own_env = (cmd, {}) if tf_config is None else launch.worker_command(
                    cmd, tf_config, self.hosts[i] if self.hosts else None, self.launcher)
                if net is not None:
                    command = net.prefix(i) + command
                log.write("$ " + " ".join(command[:len(command) - len(cmd)] + shown) + "\n")
                if load:
                    log.write(f"# load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
                if tf_config is not None:
                    where = (f" in {net.name(i)} ({limit.describe()})" if limit else
                             f" in {net.name(i)} (a private namespace, loopback only)" if net else "")
                    log.write(f"# worker {i} of {job.workers}{where}: TF_CONFIG={tf_config}\n")
                processes.append(launch.start(i, command, dict(env, **own_env), here, log,
                                              slot.cpus if slot is not None else None))
            error = launch.supervise(processes, timeout, on_line)
        return launch.outcome(processes, error)


def _stamp_network(path, limit):
    """Writes into the results file at PATH (when the run wrote one) the limit its workers ran behind:
    ``"network": "100mbit"`` (netns.Limit.text), so that the file says what it measured."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(data, dict):
        data["network"] = limit.text()
        atomic_write_text(path, json.dumps(data, indent=1, allow_nan=False))


def _as_planned(record, job, slot):
    """RECORD, refused (summary None, one line) when its run trained with another k or global batch
    than planned for the devices its SLOT gives it (say, every GPU where a logical CPU split was meant)
    on JOB's workers, or on another number of workers."""
    if record.summary is None:
        return record
    from crossbow_tf.compare.plan import planned_shape
    k, global_batch = planned_shape(job.method, job.experiment, trials_lib.slot_gpus(slot))
    with open(record.path) as f:
        data = json.load(f)
    got = (data.get("num_learners"), data.get("global_batch"))
    workers = data.get("workers", 1)
    if job.network is not None and data.get("network") != job.network.text():
        record.summary = None
        record.error = (f"ran on {data.get('network') or 'loopback'}, planned behind {job.network.text()}: refused")
        return record
    # Results name their global batch since issue 30 (older ones, and stand-ins of tests, are not checked).
    if k is not None and "global_batch" in data and (got != (k * job.workers, global_batch * job.workers)
                                                     or workers != job.workers):
        record.summary = None
        devices = f"{len(data.get('devices') or [])} device(s)"
        shape = devices if workers == job.workers == 1 else f"{workers} worker(s) x {devices}"
        planned = "" if job.workers == 1 else f" on {job.workers} worker(s)"
        record.error = (f"trained with k={got[0]}, global batch {got[1]} on {shape}, planned k={k * job.workers}, "
                        f"global batch {global_batch * job.workers}{planned}: refused")
    return record


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def check_study(args, out, study=None):
    """What open_study checks that needs nothing opened nor written (the --dry-run's checks): the
    flags, the tensorboard package, the --storage URL and its folder; returns trials.Options (STUDY:
    those of trials.options(ARGS, OUT), made already)."""
    study = study or trials_lib.options(args, out)
    cli.require_tensorboard("every run's TensorBoard events")
    if study.storage:
        trials_lib.check_storage(study.storage)
    return study


def open_study(args, out, study=None):
    """The study's storage options (trials.options, or STUDY made already) for the command's ARGS,
    with report directory OUT made ready for it (prepare_out_dir); --force without --resume also
    forgets the storage's old trials."""
    study = check_study(args, out, study)
    trials_lib.open_given_storage(study)   # before the report directory is made
    prepare_out_dir(out, force=args.force, resume=args.resume or trials_lib.joins(args))
    if args.force and not args.resume:
        trials_lib.forget(study)
    return study


def prepare_out_dir(path, force=False, resume=False):
    """Creates report directory PATH; an existing one is refused unless FORCE (emptied) or RESUME (reused)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CrossbowError(f"{path}: exists and is not a directory")
        ours = os.path.exists(os.path.join(path, MARKER))
        if not (force or resume):
            raise CrossbowError(f"{path}: report directory exists; choose another --out, "
                                "or pass --resume to reuse its finished runs or --force to replace it")
        if os.listdir(path) and not ours:
            raise CrossbowError(f"{path}: not a report directory made by these tools; refusing to touch it")
        if force and not resume:
            shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, MARKER), "w") as f:
        f.write("made by crossbow-compare, crossbow-sweep or crossbow-reproduce (crossbow_tf.compare)\n")


def machine_info():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    return dict(host=platform.node(), platform=platform.platform(), cpu=cpu, cpu_count=os.cpu_count(),
                python=platform.python_version(),
                load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))


# The studies' loops live in crossbow_tf/compare/loops.py (they import this module); the commands
# and the package's API take them from here, as before.
from crossbow_tf.compare.loops import run_compare, run_study, run_sweep, study_items  # noqa: E402,F401
