"""Running: one training process per run (``python -m MODULE --config RUN.yaml --results
RUN.json``), with progress, ETA and resume; the report directory; the three studies' run loops.

Every run is its own process: TensorFlow fixes its logical device split once per process, and a
fresh process keeps one run's tracing, caches and threads out of another's timing. By default runs
go one at a time for the same reason; with --parallel N, N go side by side, each with its share of
the machine (crossbow_tf/compare/trials.py). Every run of a study is a trial of one Optuna study
(trials.py): the loops below plan the trials, let the workers run them, and read the outcome back
from the storage and the run folders. Only results files are read (crossbow_tf/results.py);
nothing here imports TensorFlow.
"""
import dataclasses
import datetime
import json
import os
import platform
import queue
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

import yaml

import crossbow_tf
from crossbow_tf import cli
from crossbow_tf.compare import trials as trials_lib
from baselines import METHODS
from baselines._cli import parse_tf_ssgd_options, split_sections
from crossbow_tf import config as config_lib
from crossbow_tf.compare.plan import describe
from crossbow_tf.compare.report import fmt, relative_path
from crossbow_tf.compare.stats import best_trial, run_summary, seed_statistics
from crossbow_tf.errors import ConfigError, CrossbowError
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


def _normal_form(text):
    """A run's YAML with every default filled in, so that keys added later with their default
    values do not make a finished run look different; None when it no longer validates."""
    try:
        mapping = yaml.safe_load(text) or {}
        experiment, sections = split_sections(mapping)
        algorithm = experiment.setdefault("algorithm", {})
        if __import__("baselines").has_central_loop(algorithm.get("name", "sma")):   # a rule with allow_unstable
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


EPOCH_LINE = re.compile(r"^epoch\s+(\d+)/(\d+)\s+test accuracy ([0-9.]+).*?time\s+([0-9.]+)s")


class Runner:
    """Runs training processes one after another, prints progress, keeps every file of a run."""

    def __init__(self, out_dir, total_runs, resume=False, out=sys.stdout, python=None, trials=None):
        # python: the interpreter of the training processes (CROSSBOW_RUN_PYTHON, else this one).
        python = python or os.environ.get("CROSSBOW_RUN_PYTHON") or sys.executable
        self.out_dir, self.total, self.resume, self.out, self.python = out_dir, total_runs, resume, out, python
        self.trials = trials               # trials.Options of the study (None: in memory, one at a time)
        self.study = None                  # the trials.Study of the last loop
        self.done, self.started = 0, time.time()
        self.durations = []
        self._lock = threading.RLock()

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
        base = os.path.join(self.out_dir, "runs", subdir, name)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        paths = {ext: f"{base}.{ext}" for ext in ("yaml", "json", "log")}
        text = run_text(experiment, options)
        with self._lock:
            self.done += 1
            number = self.done
        head = f"[{number:3d}/{self.total}] {subdir} {label} seed {seed}"
        unchanged = False
        if self.resume and os.path.exists(paths["yaml"]):
            with open(paths["yaml"]) as f:
                unchanged = same_run(f.read(), text)
        if unchanged and os.path.exists(paths["json"]):
            record = _as_planned(self._record(label, seed, paths["json"], target, 0.0, None), method, experiment, slot)
            if record.summary is not None:
                self.say(f"{head}: done before, reusing {os.path.relpath(paths['json'], self.out_dir)}")
                return record
        # An unfinished SMA run continues from its last checkpoint (kept only for the same run).
        checkpoints = f"{base}.checkpoints"
        if not unchanged:
            shutil.rmtree(checkpoints, ignore_errors=True)
        resumable = ["--checkpoint-dir", checkpoints, "--resume"] if METHODS[method].module == "crossbow_tf.run" else []
        # Every run's TensorBoard events in a folder of its own, named as its files under runs/; a
        # run that continues from its checkpoint keeps the epochs it wrote before.
        tensorboard = os.path.join(self.out_dir, "tensorboard", subdir, name)
        if not (resumable and os.path.isdir(checkpoints)):
            shutil.rmtree(tensorboard, ignore_errors=True)
            trial = name[:-len(f"_s{seed}")] if name.endswith(f"_s{seed}") else name
            self._write_hparams(tensorboard, trial_hparams(method, experiment, options, subdir, trial, seed),
                                f"{subdir}/{trial}")
        for p in paths.values():
            if os.path.exists(p):
                os.remove(p)
        with open(paths["yaml"], "w") as f:
            f.write(text)
        self.say(f"{head} ... (elapsed {_clock(time.time() - self.started)}, ETA {self.eta()})")
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        start = time.time()
        code, error = self._spawn(METHODS[method].module, paths, timeout, load,
                                  ["--tensorboard", tensorboard] + resumable, slot=slot)
        duration = time.time() - start
        with self._lock:
            self.durations.append(duration)
        record = _as_planned(self._record(label, seed, paths["json"], target, duration, load), method, experiment, slot)
        # A run that diverged (exit code 3, its results say where) or collapsed (exit code 5, at chance
        # accuracy) is an outcome, not a failure.
        finished = record.summary is not None and (code == 0 or (code == 3 and record.summary["diverged"])
                                                   or (code == 5 and record.summary["collapsed"]))
        if finished:
            shutil.rmtree(checkpoints, ignore_errors=True)
        if not finished:
            record.summary = None
            record.error = error or record.error or f"exit code {code}"
            self.say(f"      FAILED after {duration:.0f}s: {record.error} "
                     f"(log: {paths['log']}){self._who(subdir, name)}")
        else:
            s = record.summary
            outcome = (f"{target:.2%} at epoch {s['epochs_to_target']}, {s['tta']:.2f}s of training"
                       if s["reached"] else f"target not reached in {s['epochs_run']} epochs")
            if s["diverged"]:
                outcome = f"diverged in epoch {s['epochs_run'] + 1}: target not reached"
            self.say(f"      {outcome}; best {fmt(s['best_accuracy'], 4)}; {fmt(s['images_per_second'], 0)} images/s; "
                     f"process {duration:.0f}s{self._who(subdir, name)}")
        return record

    def _who(self, subdir, name):
        return f" [{subdir}/{name}]" if self.side_by_side() > 1 else ""

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

    def _spawn(self, module, paths, timeout, load=None, extra_args=(), slot=None):
        # The run starts in this folder with it on its path, so that a user's model (model:
        # my_models:build or path/to/file.py:build) and data.path resolve as they do here.
        here = os.getcwd()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                   PYTHONPATH=os.pathsep.join([PACKAGE_ROOT, here] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   **(slot.env if slot else {}))
        cmd = [self.python, "-m", module, "--config", paths["yaml"], "--results", paths["json"], *extra_args]
        lines = queue.Queue()
        with open(paths["log"], "w") as log:
            log.write("$ " + " ".join(relative_path(a) for a in cmd) + "\n")   # names no machine's folders
            if load:
                log.write(f"# load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    bufsize=1, cwd=here, preexec_fn=_die_with_parent if _LIBC else None)
            if slot is not None and slot.cpus and hasattr(os, "sched_setaffinity"):
                try:   # its share of the cores (its threads, made after this, inherit it)
                    os.sched_setaffinity(proc.pid, slot.cpus)
                except OSError:
                    pass

            def pump():
                for line in proc.stdout:
                    lines.put(line)
                lines.put(None)
            threading.Thread(target=pump, daemon=True).start()
            deadline = time.time() + timeout
            tail, error = [], None
            while True:
                try:
                    line = lines.get(timeout=max(0.1, min(5.0, deadline - time.time())))
                except queue.Empty:
                    if time.time() > deadline:
                        proc.kill()   # our own child, by its handle
                        error = f"timed out after {timeout:.0f}s"
                        break
                    continue
                if line is None:
                    break
                log.write(line)
                log.flush()
                tail = (tail + [line.rstrip()])[-5:]
                m = EPOCH_LINE.match(line)
                if m:
                    tag = f" [{os.path.relpath(paths['json'], self.out_dir)[5:-5]}]" if self.side_by_side() > 1 else ""
                    self.say(f"      epoch {m.group(1)}/{m.group(2)}  accuracy {float(m.group(3)):.4f}  "
                             f"{float(m.group(4)):.2f}s{tag}")
            code = proc.wait()
        if code != 0 and error is None:
            error = f"exit code {code}: " + next((t for t in reversed(tail) if t.strip()), "")
        return code, error


def _as_planned(record, method, experiment, slot):
    """RECORD, refused (summary None, one line) when its run trained with another k or global batch
    than planned for the devices its SLOT gives it (say, every GPU where a logical CPU split was meant)."""
    if record.summary is None:
        return record
    from crossbow_tf.compare.plan import planned_shape
    k, global_batch = planned_shape(method, experiment, trials_lib.slot_gpus(slot))
    with open(record.path) as f:
        data = json.load(f)
    got = (data.get("num_learners"), data.get("global_batch"))
    # Results name their global batch since issue 30 (older ones, and stand-ins of tests, are not checked).
    if k is not None and "global_batch" in data and got != (k, global_batch):
        record.summary = None
        record.error = (f"trained with k={got[0]}, global batch {got[1]} on {len(data.get('devices') or [])} "
                        f"device(s), planned k={k}, global batch {global_batch}: refused")
    return record


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def check_study(args, out):
    """What open_study checks that needs nothing opened nor written (the --dry-run's checks): the
    flags, the tensorboard package, the --storage URL and its folder; returns trials.Options."""
    study = trials_lib.options(args, out)
    cli.require_tensorboard("every run's TensorBoard events")
    if study.storage:
        trials_lib.check_storage(study.storage)
    return study


def open_study(args, out):
    """The study's storage options (trials.options) for the command's ARGS, with report directory
    OUT made ready for it (prepare_out_dir); --force without --resume also forgets the storage's
    old trials."""
    study = check_study(args, out)
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


# ---------------------------------------------------------------------------------------------
# The studies' run loops.


def _item(key, group, seed, configs=None):
    """A search run's trials.Item (its config hashed into the plan's fingerprint)."""
    digest = trials_lib.config_hash(run_text(*configs)) if configs else None
    return trials_lib.Item(key, group, seed, config_hash=digest)


def execute(runner, items, resolve, target, timeout):
    """Runs ITEMS (trials.Item) as the trials of the runner's study until none is left, in the
    runner's slots; RESOLVE(item) gives (method, experiment, options, subdir, name, label, seed) of
    an item's run (for a replication, once its group's search has finished). Returns {run key:
    user attributes of the trial that counts for it} ("resolved": a replication's run key)."""
    opts = runner.trials or trials_lib.Options()
    if opts.storage is None and runner.trials is None:
        import optuna
        storage = optuna.storages.InMemoryStorage()   # a library call without a study of its own
    else:
        storage = trials_lib.open_storage(opts.storage or trials_lib.default_storage(runner.out_dir), opts.heartbeat)
    study = trials_lib.Study(storage, opts.name or "crossbow", items, replan=opts.replan, worker=opts.worker,
                             say=runner.say, heartbeat=opts.heartbeat)
    runner.study = study

    def run_item(item, slot):
        method, exp, options, subdir, name, label, seed = resolve(item)
        record = runner.run(method, exp, options, subdir, name, label, seed, target, timeout, slot=slot)
        s = record.summary
        attrs = dict(status="finished" if s is not None else "failed", resolved=f"{subdir}/{name}",
                     duration=round(record.duration, 3), error=record.error,
                     load=list(record.load_before) if record.load_before else None,
                     epochs_to_target=s["epochs_to_target"] if s else None, tta=s["tta"] if s else None)
        best = s["best_accuracy"] if s else None
        return (best if isinstance(best, (int, float)) and best == best else 0.0), attrs
    study.work(run_item, trials_lib.make_slots(opts.parallel, opts.gpus_per_trial))
    return current_attrs(runner)


def current_attrs(runner):
    """{run key: user attributes of the trial that counts for it}, by plan key and by run key."""
    attrs = {}
    for key, trial in runner.study.current().items():
        attrs[key] = attrs[trial.user_attrs.get("resolved", key)] = dict(trial.user_attrs)
    return attrs


def _load(runner, attrs, subdir, name, label, seed, target):
    """The RunRecord of runs/SUBDIR/NAME from its results file and its trial's attributes."""
    a = attrs.get(f"{subdir}/{name}", {})
    load = tuple(a["load"]) if a.get("load") else None
    record = runner._record(label, seed, os.path.join(runner.out_dir, "runs", subdir, f"{name}.json"), target,
                            a.get("duration") or 0.0, load)
    if a.get("status") == "failed" and record.summary is not None:
        record.summary, record.error = None, a.get("error") or "failed"
    elif a.get("status") == "failed":
        record.error = a.get("error") or record.error
    return record


def run_compare(spec, plan, runner):
    """Search (every trial on the search seeds), then the best trial on every seed; returns the outcome."""
    entries, jobs, items = {}, {}, []
    for entry, trials in plan:
        entries[entry.name] = (entry, trials)
        for label, point, configs in trials:
            for seed in spec.search_seeds:
                key = f"{entry.name}/{label}_s{seed}"
                jobs[key] = (entry.method, *configs[seed], entry.name, f"{label}_s{seed}",
                             f"{label} {describe(point)}", seed)
                items.append(_item(key, entry.name, seed, configs[seed]))
        for seed in spec.seeds:
            if seed not in spec.search_seeds:
                items.append(trials_lib.Item(f"{entry.name}/best_s{seed}", entry.name, seed, replicate=True))

    def best_of(name, attrs):
        _, trials = entries[name]
        search = [[_load(runner, attrs, name, f"{label}_s{s}", label, s, spec.target).summary
                   for s in spec.search_seeds] for label, _, _ in trials]
        return trials[best_trial(search)]

    def resolve(item):
        if not item.replicate:
            return jobs[item.key]
        entry, _ = entries[item.group]
        label, point, configs = best_of(item.group, current_attrs(runner))
        return (entry.method, *configs[item.seed], entry.name, f"{label}_s{item.seed}",
                f"{label} {describe(point)} (best)", item.seed)
    attrs = execute(runner, items, resolve, spec.target, spec.timeout)
    outcome = {}
    for entry, trials in plan:
        runs = {(label, s): _load(runner, attrs, entry.name, f"{label}_s{s}", f"{label} {describe(point)}", s,
                                  spec.target)
                for label, point, _ in trials for s in spec.search_seeds}
        label, point, _ = best_of(entry.name, attrs)
        for seed in spec.seeds:
            if (label, seed) not in runs:
                runs[(label, seed)] = _load(runner, attrs, entry.name, f"{label}_s{seed}",
                                            f"{label} {describe(point)} (best)", seed, spec.target)
        outcome[entry.name] = dict(entry=entry, trials=trials, runs=runs, best=label, best_point=point,
                                   final=[runs[(label, s)] for s in spec.seeds])
    return outcome


def run_sweep(spec, plan, runner):
    """Runs every sweep point; returns {series: [(global batch, epochs to target or None, best point, records)]}."""
    jobs, items = {}, []
    for series, g, label, point, configs in plan:
        method = spec.ssgd_method if series == "ssgd" else "sma"
        for s in spec.seeds:
            key = f"sweep_{series}/{label}_s{s}"
            jobs[key] = (method, *configs[s], f"sweep_{series}", f"{label}_s{s}", f"{label} {describe(point)}", s)
            items.append(_item(key, key, s, configs[s]))
    attrs = execute(runner, items, lambda item: jobs[item.key], spec.target, spec.timeout)
    by = {}
    for series, g, label, point, configs in plan:
        records = [_load(runner, attrs, f"sweep_{series}", f"{label}_s{s}", f"{label} {describe(point)}", s,
                         spec.target) for s in spec.seeds]
        by.setdefault((series, g), []).append((point, records))
    out = {"ssgd": [], "sma": []}
    for (series, g), trials in by.items():
        best = best_trial([[r.summary for r in records] for _, records in trials], by="epochs")
        point, records = trials[best]
        epochs = seed_statistics([r.summary["epochs_to_target"] for r in records if r.summary is not None])[0]
        out[series].append((g, epochs, point, records))
    return out


def study_items(spec, cells):
    """(items, jobs, cells by group) of the reproduction study: its trials in the order one process
    runs them (point by point: every cell's search, then every cell's replications), each search
    run's job (method, experiment, options, subdir, name, label, seed), and {group: cell}."""
    by_group, jobs, items = {}, {}, []

    def seeds_of(cell):
        return sorted(set(spec.seeds) | set(spec.search_seeds)) if cell.series.untuned else spec.search_seeds

    points = list(dict.fromkeys(cell.global_batch for cell in cells))
    for global_batch in points:
        at_point = [cell for cell in cells if cell.global_batch == global_batch]
        for cell in at_point:
            group = f"{cell.series.name}/G{cell.global_batch}"
            by_group[group] = cell
            for label, point, configs in cell.trials:
                for seed in seeds_of(cell):
                    key = f"{group}/{label}_s{seed}"
                    jobs[key] = (cell.series.method, *configs[seed], group, f"{label}_s{seed}",
                                 f"{label} {describe(point)}", seed)
                    items.append(_item(key, group, seed, configs[seed]))
        for cell in at_point:
            group = f"{cell.series.name}/G{cell.global_batch}"
            for seed in spec.seeds:
                if seed not in seeds_of(cell):
                    items.append(trials_lib.Item(f"{group}/best_s{seed}", group, seed, replicate=True))
    return items, jobs, by_group


def run_study(spec, cells, runner):
    """Point by point, in the order of the global batches given: every cell's search trials at that
    point on the search seeds, then each cell's best trial on every seed (the order of the trials in
    the study; one process runs them in this order, so a study stopped part-way has whole points,
    searched and replicated, before the one it stopped in; side by side, a replication starts once
    its cell's search has finished).

    Returns {(series name, G): outcome dict}. Trials are ranked by fewest median epochs to target,
    then time (best_trial(by="epochs")): the study's question is statistical efficiency.
    """
    items, jobs, by_group = study_items(spec, cells)

    def seeds_of(cell):
        return sorted(set(spec.seeds) | set(spec.search_seeds)) if cell.series.untuned else spec.search_seeds

    def best_of(cell, attrs):
        group = f"{cell.series.name}/G{cell.global_batch}"
        if cell.series.untuned:
            return cell.trials[0]
        search = [[_load(runner, attrs, group, f"{label}_s{s}", label, s, spec.target).summary
                   for s in spec.search_seeds] for label, _, _ in cell.trials]
        return cell.trials[best_trial(search, by="epochs")]

    def resolve(item):
        if not item.replicate:
            return jobs[item.key]
        cell = by_group[item.group]
        label, point, configs = best_of(cell, current_attrs(runner))
        return (cell.series.method, *configs[item.seed], item.group, f"{label}_s{item.seed}",
                f"{label} {describe(point)} (best)", item.seed)
    attrs = execute(runner, items, resolve, spec.target, spec.timeout)
    outcome = {}
    for group, cell in by_group.items():
        runs = {(label, s): _load(runner, attrs, group, f"{label}_s{s}", f"{label} {describe(point)}", s, spec.target)
                for label, point, _ in cell.trials for s in seeds_of(cell)}
        label, point, _ = best_of(cell, attrs)
        for seed in spec.seeds:
            if (label, seed) not in runs:
                runs[(label, seed)] = _load(runner, attrs, group, f"{label}_s{seed}",
                                            f"{label} {describe(point)} (best)", seed, spec.target)
        outcome[(cell.series.name, cell.global_batch)] = dict(cell=cell, runs=runs, best=label, best_point=point,
                                                             final=[runs[(label, s)] for s in spec.seeds])
    return outcome
