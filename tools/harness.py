"""Shared code of tools/compare.py and tools/sweep.py: specs, runs in subprocesses, summaries, report.

Every training run is its own process (``python -m MODULE --config RUN.yaml --results RUN.json``):
TensorFlow fixes its logical device split once per process, and a fresh process keeps one run's
tracing, caches and threads out of another's timing. Runs go one at a time for the same reason.
Tools read only the results files (crossbow_tf/results.py); nothing here imports TensorFlow.
"""
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import platform
import queue
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:   # run as `python tools/compare.py` from anywhere, installed or not
    sys.path.insert(0, REPO)

from baselines import METHODS  # noqa: E402
from baselines._cli import parse_tf_ssgd_options, read_yaml, split_sections  # noqa: E402
from crossbow_tf.results import time_to_target  # noqa: E402,F401  (the one TTA rule, used here and by tests)
from crossbow_tf import config as config_lib  # noqa: E402
from crossbow_tf.errors import ConfigError, CrossbowError  # noqa: E402
from crossbow_tf.files import atomic_write_text  # noqa: E402
from crossbow_tf.results import format_problems  # noqa: E402
from crossbow_tf.user_model import locate_model  # noqa: E402

MARKER = ".crossbow_report"   # marks a directory as ours, so --force never empties anyone else's


# ---------------------------------------------------------------------------------------------
# Pure functions: time to target, summaries, statistics over seeds, grids.

def run_summary(results, target):
    """The numbers the report needs from one results mapping (a loaded RunResults file)."""
    evals = results["evaluations"]
    hit = time_to_target(evals, target) if target is not None else None
    last = evals[-1] if evals else {}
    cfg = results.get("config", {})
    k = results.get("num_learners") or 1
    waits = [e.get("epoch_start_time") for e in evals]
    return dict(
        reached=hit is not None,
        tta=hit[0] if hit else None,
        epochs_to_target=hit[1] if hit else None,
        best_accuracy=max((e["accuracy"] for e in evals), default=None),
        epochs_run=len(evals),
        train_time=last.get("wall_time"),
        images_per_second=(last["examples"] / last["wall_time"]) if last and last["wall_time"] > 0 else None,
        trace_time=results.get("trace_time"),
        global_batch=results.get("global_batch") or (cfg.get("batch_size", 0) * k),
        num_learners=k,
        devices=len(results.get("devices") or []) or None,
        epoch_start_wait=sum(w for w in waits if w) if any(w is not None for w in waits) else None,
        collapsed=bool(results.get("collapsed")),
        diverged=bool(results.get("diverged")),   # a NaN or infinity stopped it (exit code 3)
    )


def seed_statistics(values):
    """(median, low, high) of per-seed VALUES where None means "never reached" (counted as infinite).

    The median is None when at least half of the seeds never reached; high is None when any did not.
    """
    if not values:
        return None, None, None
    xs = sorted(math.inf if v is None else float(v) for v in values)
    med = statistics.median(xs)
    finite = [x for x in xs if x != math.inf]

    def clean(x):
        return None if x == math.inf or (isinstance(x, float) and math.isnan(x)) else x
    return clean(med), (finite[0] if finite else None), clean(xs[-1])


def expand_grid(grid):
    """Every combination of a {dotted.key: [values]} grid, in a fixed order (keys as written)."""
    if not grid:
        return [{}]
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def choose_trials(points, budget, seed=0):
    """At most BUDGET of POINTS: all when they fit, else a seeded random subset (grid order kept)."""
    if len(points) <= budget:
        return list(points)
    keep = sorted(random.Random(seed).sample(range(len(points)), budget))
    return [points[i] for i in keep]


def best_trial(trials, by="tta"):
    """Index of the best of TRIALS (each a list of per-seed summaries; None entries are failed runs).

    BY "tta": lowest median time to target; BY "epochs": fewest median epochs to target, then time.
    Trials that never reach rank after those that do, by median best accuracy.
    """
    def key(i):
        ok = [s for s in trials[i] if s is not None]
        if not ok:
            return (2, 0, 0, 0)
        tta = seed_statistics([s["tta"] for s in ok])[0]
        epochs = seed_statistics([s["epochs_to_target"] for s in ok])[0]
        acc = statistics.median([s["best_accuracy"] or 0.0 for s in ok])
        if tta is None:
            return (1, -acc, 0, 0)
        return (0, epochs, tta, -acc) if by == "epochs" else (0, tta, epochs, -acc)
    return min(range(len(trials)), key=key) if trials else None


def describe(point):
    """A short label of a grid point: key=value, last part of each dotted key."""
    return " ".join(f"{k.split('.')[-1]}={'null' if v is None else v}" for k, v in point.items()) or "defaults"


def fmt(x, digits=2):
    """X with DIGITS decimals; DIGITS None: as short as exact (a median of epochs may be 3.5)."""
    if x is None:
        return "–"
    return f"{x:g}" if digits is None else f"{x:.{digits}f}"


def fmt_stat(stat, digits=2, missing="–"):
    """ "median [min–max]"; MISSING when there is no value (e.g. "not reached" for times to target)."""
    med, lo, hi = stat
    if med is None and lo is None:
        return missing
    return (f"{fmt(med, digits) if med is not None else missing} "
            f"[{fmt(lo, digits)}–{fmt(hi, digits) if hi is not None else 'n/r'}]")


# ---------------------------------------------------------------------------------------------
# Specs read from the YAML's compare: and sweep: sections.

@dataclasses.dataclass
class Entry:
    """One row of the comparison: a method with its fixed settings and its search grid."""
    name: str
    method: str
    fixed: dict
    grid: dict


@dataclasses.dataclass
class CompareSpec:
    entries: list
    budget: int
    search_seeds: list
    seeds: list
    target: float
    epochs: int
    timeout: float


@dataclasses.dataclass
class SweepSpec:
    ssgd_method: str
    global_batches: list
    ssgd_fixed: dict
    ssgd_grid: dict
    sma_batch: int
    learners: list
    sma_fixed: dict
    sma_grid: dict
    seeds: list
    target: float
    epochs: int
    timeout: float


def _need(ok, message):
    if not ok:
        raise ConfigError(message)


def _mapping(value, where):
    _need(value is None or isinstance(value, dict), f"{where}: expected a mapping, got {value!r}")
    return dict(value or {})


def _int_list(value, where, minimum=0):
    _need(isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                    and v >= minimum for v in value),
          f"{where}: expected a non-empty list of integers >= {minimum}, got {value!r}")
    return list(value)


def _positive(value, where, kind=float):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    _need(ok and (kind is float or isinstance(value, int)), f"{where}: expected a positive {kind.__name__}, got {value!r}")
    return value


def _grid(value, where):
    grid = _mapping(value, where)
    for k, v in grid.items():
        _need(isinstance(k, str), f"{where}: keys must be dotted config keys, got {k!r}")
        _need(isinstance(v, list) and v, f"{where}.{k}: expected a non-empty list of values, got {v!r}")
    return grid


def _known(mapping, allowed, where):
    unknown = sorted(set(mapping) - set(allowed))
    _need(not unknown, f"{where}.{unknown[0] if unknown else ''}: unknown key; known keys are {', '.join(sorted(allowed))}")


def _target(section, experiment, where):
    target = section.get("target", experiment.get("target_accuracy"))
    _need(isinstance(target, (int, float)) and not isinstance(target, bool) and 0 < target <= 1,
          f"{where}.target: a target accuracy in (0, 1] is needed (here or as target_accuracy), got {target!r}")
    return float(target)


def parse_compare(section, experiment, where="compare"):
    """CompareSpec from the compare: mapping; EXPERIMENT (a mapping) supplies target and epochs."""
    _known(section, ("methods", "budget", "search_seeds", "seeds", "target", "epochs", "timeout"), where)
    methods = section.get("methods")
    _need(isinstance(methods, dict) and methods, f"{where}.methods: expected a mapping of entries "
          f"(name: {{method, fixed, grid}}), got {methods!r}")
    entries = []
    for name, body in methods.items():
        w = f"{where}.methods.{name}"
        body = _mapping(body, w)
        _known(body, ("method", "fixed", "grid"), w)
        method = body.get("method", name)
        _need(method in METHODS, f"{w}.method: unknown method {method!r}; choose one of {', '.join(METHODS)}")
        entries.append(Entry(str(name), method, _mapping(body.get("fixed"), f"{w}.fixed"),
                             _grid(body.get("grid"), f"{w}.grid")))
    _need(any(e.method == "sma" for e in entries) and any(e.method != "sma" for e in entries),
          f"{where}.methods: list sma and at least one baseline ({', '.join(m for m in METHODS if m != 'sma')})")
    budget = _positive(section.get("budget", 4), f"{where}.budget", int)
    epochs = _positive(section.get("epochs", experiment.get("epochs", 10)), f"{where}.epochs", int)
    timeout = _positive(section.get("timeout", 900), f"{where}.timeout")
    return CompareSpec(entries, budget, _int_list(section.get("search_seeds", [0]), f"{where}.search_seeds"),
                       _int_list(section.get("seeds", [0, 1, 2]), f"{where}.seeds"),
                       _target(section, experiment, where), epochs, timeout)


def parse_sweep(section, experiment, where="sweep"):
    _known(section, ("ssgd", "sma", "seeds", "target", "epochs", "timeout"), where)
    ssgd = _mapping(section.get("ssgd"), f"{where}.ssgd")
    sma = _mapping(section.get("sma"), f"{where}.sma")
    _known(ssgd, ("method", "global_batches", "fixed", "grid"), f"{where}.ssgd")
    _known(sma, ("batch_size", "learners", "fixed", "grid"), f"{where}.sma")
    method = ssgd.get("method", "tf_ssgd")
    _need(method in ("tf_ssgd", "crossbow_ssgd"), f"{where}.ssgd.method: choose tf_ssgd or crossbow_ssgd, got {method!r}")
    epochs = _positive(section.get("epochs", experiment.get("epochs", 10)), f"{where}.epochs", int)
    return SweepSpec(
        ssgd_method=method,
        global_batches=_int_list(ssgd.get("global_batches", [16, 64, 256, 1024]), f"{where}.ssgd.global_batches", 1),
        ssgd_fixed=_mapping(ssgd.get("fixed"), f"{where}.ssgd.fixed"),
        ssgd_grid=_grid(ssgd.get("grid"), f"{where}.ssgd.grid"),
        sma_batch=_positive(sma.get("batch_size", 16), f"{where}.sma.batch_size", int),
        learners=_int_list(sma.get("learners", [1, 4, 16, 64]), f"{where}.sma.learners", 1),
        sma_fixed=_mapping(sma.get("fixed"), f"{where}.sma.fixed"),
        sma_grid=_grid(sma.get("grid"), f"{where}.sma.grid"),
        seeds=_int_list(section.get("seeds", [0]), f"{where}.seeds"),
        target=_target(section, experiment, where), epochs=epochs,
        timeout=_positive(section.get("timeout", 900), f"{where}.timeout"))


def load_harness_config(path, data_dir=None):
    """(experiment mapping, tool sections) of the YAML at PATH; the experiment part is validated.

    DATA_DIR, when given, replaces data.data_dir, so that every run of a tool reads it (--data-dir).
    """
    experiment, sections = split_sections(read_yaml(path))
    if data_dir is not None:
        data = experiment.get("data")
        experiment["data"] = dict(data if isinstance(data, dict) else {}, data_dir=data_dir)
    try:
        config_lib.from_dict(experiment)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return experiment, sections


# ---------------------------------------------------------------------------------------------
# One run's configuration.

def set_dotted(mapping, key, value, where):
    parts = key.split(".")
    node = mapping
    for i, part in enumerate(parts[:-1]):
        _need(isinstance(node.get(part), dict),
              f"{where}: unknown key {key!r} ({'.'.join(parts[:i + 1])} is not a section of the config)")
        node = node[part]
    _need(parts[-1] in node, f"{where}: unknown key {key!r}")
    node[parts[-1]] = value


def run_config(experiment, sections, method, overrides, *, seed, target, epochs, where):
    """(validated experiment mapping, tf_ssgd options or None) of one run.

    OVERRIDES are dotted keys; ``tf_ssgd.*`` keys set options of the tf_ssgd baseline.
    """
    full = config_lib.to_dict(config_lib.from_dict(experiment))   # every key present, defaults filled in
    options = dict(sections.get("tf_ssgd") or {})
    for key, value in overrides.items():
        if key.startswith("tf_ssgd."):
            _need(method == "tf_ssgd", f"{where}: {key} applies to the tf_ssgd method only")
            options[key[len("tf_ssgd."):]] = value
        else:
            set_dotted(full, key, value, where)
    full["algorithm"]["name"] = METHODS[method].algorithm
    full.update(seed=seed, target_accuracy=target, epochs=epochs, stop_at_target=True)
    try:
        built = config_lib.from_dict(full)
        if METHODS[method].engine:
            config_lib.check_engine_precision(built)
        opts = parse_tf_ssgd_options(options) if method == "tf_ssgd" else None
        check_user_files(full)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return full, opts


def check_user_files(experiment):
    """A user's model and data file are there (else every run would fail on them alike), checked
    from this folder, where the runs start, without running the user's code (see
    crossbow_tf.user_model)."""
    if ":" in experiment["model"]:
        _locate_model(experiment["model"], os.getcwd())
    path = experiment["data"].get("path")
    if path and not os.path.isfile(path):
        raise ConfigError(f"data.path: {path} not found (paths are relative to the current folder {os.getcwd()})")


@functools.lru_cache(maxsize=None)
def _locate_model(spec, folder):   # once per model and folder: a plan holds hundreds of runs
    locate_model(spec)


# ---------------------------------------------------------------------------------------------
# Running: one subprocess per run, one at a time, with progress.

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
        if algorithm.get("name", "sma") in ("sma", "easgd"):
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
    hparams = dict(method=method, entry=entry, trial=trial, seed=seed)
    for key, value in chosen.items():
        hparams[key] = value if isinstance(value, (bool, int, float, str)) else ("null" if value is None else str(value))
    return hparams


EPOCH_LINE = re.compile(r"^epoch\s+(\d+)/(\d+)\s+test accuracy ([0-9.]+).*?time\s+([0-9.]+)s")


class Runner:
    """Runs training processes one after another, prints progress, keeps every file of a run."""

    def __init__(self, out_dir, total_runs, resume=False, out=sys.stdout, python=sys.executable):
        self.out_dir, self.total, self.resume, self.out, self.python = out_dir, total_runs, resume, out, python
        self.done, self.started = 0, time.time()
        self.durations = []
        self._said_no_tensorboard = False

    def say(self, line):
        print(line, file=self.out, flush=True)

    def eta(self):
        if not self.durations:
            return "?"
        left = max(self.total - self.done, 0) * statistics.mean(self.durations)
        return _clock(left)

    def run(self, method, experiment, options, subdir, name, label, seed, target, timeout):
        """Runs one training process; returns its RunRecord (summary None when it failed)."""
        base = os.path.join(self.out_dir, "runs", subdir, name)
        os.makedirs(os.path.dirname(base), exist_ok=True)
        paths = {ext: f"{base}.{ext}" for ext in ("yaml", "json", "log")}
        doc = dict(experiment, **({"tf_ssgd": options} if options is not None else {}))
        text = yaml.safe_dump(doc, sort_keys=False)
        self.done += 1
        head = f"[{self.done:3d}/{self.total}] {subdir} {label} seed {seed}"
        unchanged = False
        if self.resume and os.path.exists(paths["yaml"]):
            with open(paths["yaml"]) as f:
                unchanged = same_run(f.read(), text)
        if unchanged and os.path.exists(paths["json"]):
            record = self._record(label, seed, paths["json"], target, 0.0, None)
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
                                  ["--tensorboard", tensorboard] + resumable)
        duration = time.time() - start
        self.durations.append(duration)
        record = self._record(label, seed, paths["json"], target, duration, load)
        # A run that diverged (exit code 3, its results say where) is an outcome, not a failure.
        finished = record.summary is not None and (code == 0 or (code == 3 and record.summary["diverged"]))
        if finished:
            shutil.rmtree(checkpoints, ignore_errors=True)
        if not finished:
            record.summary = None
            record.error = error or record.error or f"exit code {code}"
            self.say(f"      FAILED after {duration:.0f}s: {record.error} (log: {paths['log']})")
        else:
            s = record.summary
            outcome = (f"{target:.2%} at epoch {s['epochs_to_target']}, {s['tta']:.2f}s of training"
                       if s["reached"] else f"target not reached in {s['epochs_run']} epochs")
            if s["diverged"]:
                outcome = f"diverged in epoch {s['epochs_run'] + 1}: target not reached"
            self.say(f"      {outcome}; best {fmt(s['best_accuracy'], 4)}; {fmt(s['images_per_second'], 0)} images/s; "
                     f"process {duration:.0f}s")
        return record

    def _write_hparams(self, logdir, hparams, group):
        try:
            from crossbow_tf.tensorboard import write_hparams
            write_hparams(logdir, hparams, group)
        except ImportError:   # tensorboard is not a dependency of training; say it once
            if not self._said_no_tensorboard:
                self.say("note: the tensorboard package is not installed: runs write their curves, but "
                         "no hparams (pip install tensorboard)")
                self._said_no_tensorboard = True

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

    def _spawn(self, module, paths, timeout, load=None, extra_args=()):
        # The run starts in this folder with it on its path, so that a user's model (model:
        # my_models:build or path/to/file.py:build) and data.path resolve as they do here.
        here = os.getcwd()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                   PYTHONPATH=os.pathsep.join([REPO, here] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        cmd = [self.python, "-m", module, "--config", paths["yaml"], "--results", paths["json"], *extra_args]
        lines = queue.Queue()
        with open(paths["log"], "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            if load:
                log.write(f"# load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    bufsize=1, cwd=here)

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
                    self.say(f"      epoch {m.group(1)}/{m.group(2)}  accuracy {float(m.group(3)):.4f}  "
                             f"{float(m.group(4)):.2f}s")
            code = proc.wait()
        if code != 0 and error is None:
            error = f"exit code {code}: " + next((t for t in reversed(tail) if t.strip()), "")
        return code, error


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# ---------------------------------------------------------------------------------------------
# Report directory, machine, tables, plots.

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
        f.write("made by tools/compare.py, tools/sweep.py or tools/reproduce.py\n")


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


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def load_curves(records):
    """[(seed, evaluations)] of the successful RECORDS."""
    out = []
    for r in records:
        if r.summary is not None:
            with open(r.path) as f:
                out.append((r.seed, json.load(f)["evaluations"]))
    return out


def plot_curves(curves_by_name, target, path_time, path_epochs):
    """Accuracy against training time and against epochs, one colour per method, one line per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for path, xkey, xlabel in ((path_time, "wall_time", "training time (s, evaluation excluded)"),
                               (path_epochs, "epoch", "epoch")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (name, curves) in enumerate(curves_by_name.items()):
            color = f"C{i}"
            for j, (seed, evals) in enumerate(curves):
                ax.plot([e[xkey] for e in evals], [e["accuracy"] for e in evals], "o-", color=color,
                        markersize=3, linewidth=1.2, alpha=0.85, label=name if j == 0 else None)
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.0%}")
        low = min([e["accuracy"] for curves in curves_by_name.values() for _, ev in curves for e in ev] + [target])
        ax.set_ylim(max(0.0, min(low, target - 0.1) - 0.02), 1.0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def plot_sweep(series, epochs_cap, target, path):
    """Epochs to target against global batch; SERIES {label: [(global_batch, epochs or None)]}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, points) in enumerate(series.items()):
        xs = [b for b, _ in points]
        ys = [e if e is not None else epochs_cap for _, e in points]
        # Distinct line styles: equal values would otherwise hide one series under the other.
        ax.plot(xs, ys, ["-", "--"][i % 2], color=f"C{i}", label=label, linewidth=1.5)
        for x, (_, e), y in zip(xs, points, ys):
            ax.plot([x], [y], ("o" if i % 2 == 0 else "s") if e is not None else "^", color=f"C{i}",
                    markersize=8 - 3 * (i % 2), markerfacecolor=f"C{i}" if e is not None else "white")
    ax.set_ylim(bottom=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (S-SGD: batch; SMA: k x b)")
    ax.set_ylabel(f"epochs to {target:.0%} test accuracy")
    ax.set_title(f"statistical efficiency (open triangles: not reached in {epochs_cap} epochs)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The two studies, shared by compare.py and sweep.py.

def plan_compare(spec, experiment, sections):
    """[(entry, [(label, point, {seed: (experiment, options)})])] with every run's config validated."""
    plan = []
    for entry in spec.entries:
        points = choose_trials(expand_grid(entry.grid), spec.budget)
        trials = []
        for i, point in enumerate(points):
            overrides = dict(entry.fixed, **point)
            where = f"compare.methods.{entry.name} ({describe(point)})"
            configs = {seed: run_config(experiment, sections, entry.method, overrides, seed=seed, target=spec.target,
                                        epochs=spec.epochs, where=where)
                       for seed in sorted(set(spec.search_seeds) | set(spec.seeds))}
            trials.append((f"t{i:02d}", point, configs))
        plan.append((entry, trials))
    return plan


def count_compare_runs(spec, plan):
    extra = len(set(spec.seeds) - set(spec.search_seeds))
    return sum(len(trials) * len(spec.search_seeds) + extra for _, trials in plan)


def run_compare(spec, plan, runner):
    """Search (every trial on the search seeds), then the best trial on every seed; returns the outcome."""
    outcome = {}
    for entry, trials in plan:
        runs = {}
        for label, point, configs in trials:
            for seed in spec.search_seeds:
                exp, opts = configs[seed]
                runs[(label, seed)] = runner.run(entry.method, exp, opts, entry.name, f"{label}_s{seed}",
                                                 f"{label} {describe(point)}", seed, spec.target, spec.timeout)
        search = [[runs[(label, s)].summary for s in spec.search_seeds] for label, _, _ in trials]
        best = best_trial(search)
        label, point, configs = trials[best]
        for seed in spec.seeds:
            if (label, seed) not in runs:
                exp, opts = configs[seed]
                runs[(label, seed)] = runner.run(entry.method, exp, opts, entry.name, f"{label}_s{seed}",
                                                 f"{label} {describe(point)} (best)", seed, spec.target, spec.timeout)
        outcome[entry.name] = dict(entry=entry, trials=trials, runs=runs, best=label, best_point=point,
                                   final=[runs[(label, s)] for s in spec.seeds])
    return outcome


def compare_rows(spec, outcome):
    """Per entry: its statistics over the final seeds (a dict), in entry order."""
    rows = []
    for name, o in outcome.items():
        ok = [r.summary for r in o["final"] if r.summary is not None]
        rows.append(dict(
            name=name, method=o["entry"].method, best=describe(o["best_point"]), trials=len(o["trials"]),
            seeds=len(o["final"]), failed=sum(r.summary is None for r in o["final"]),
            reached=sum(s["reached"] for s in ok),
            epochs=seed_statistics([s["epochs_to_target"] for s in ok]),
            tta=seed_statistics([s["tta"] for s in ok]),
            images_per_second=seed_statistics([s["images_per_second"] for s in ok]),
            best_accuracy=seed_statistics([s["best_accuracy"] for s in ok]),
            trace_time=seed_statistics([s["trace_time"] for s in ok]),
            epoch_start_wait=seed_statistics([s["epoch_start_wait"] for s in ok])
            if any(s["epoch_start_wait"] is not None for s in ok) else (None, None, None),
            global_batch=ok[0]["global_batch"] if ok else None))
    return rows


def tta_ratio(rows):
    """(ratio, sma row name, best baseline row name): median TTA of the best SMA entry over that of
    the best baseline entry; ratio None when either never reached the target."""
    def best(rows_):
        reached = [r for r in rows_ if r["tta"][0] is not None]
        return min(reached, key=lambda r: r["tta"][0]) if reached else None
    sma = best([r for r in rows if r["method"] == "sma"])
    base = best([r for r in rows if r["method"] != "sma"])
    if sma is None or base is None:
        return None, sma and sma["name"], base and base["name"]
    return sma["tta"][0] / base["tta"][0], sma["name"], base["name"]


def compare_markdown(spec, rows, outcome):
    ratio, sma, base = tta_ratio(rows)
    headers = ["method", "best of trials", "global batch", "seeds reached", "epochs to target",
               "TTA (s)", "images/s", "best accuracy", "trace (s)", "epoch-start wait (s)"]
    table = markdown_table(headers, [
        [r["name"] + ("" if r["name"] == r["method"] else f" ({r['method']})"), f"{r['best']} ({r['trials']} tried)",
         r["global_batch"] if r["global_batch"] is not None else "–", f"{r['reached']}/{r['seeds']}",
         fmt_stat(r["epochs"], None, "not reached"), fmt_stat(r["tta"], 2, "not reached"), fmt_stat(r["images_per_second"], 0),
         fmt_stat(r["best_accuracy"], 4), fmt_stat(r["trace_time"]), fmt_stat(r["epoch_start_wait"])]
        for r in rows])
    if ratio is None:
        ratio_line = (f"TTA ratio SMA / best baseline: not available ({'SMA' if sma is None else 'no baseline'} "
                      f"reached {spec.target:.0%} in at least half of its seeds).")
    else:
        ratio_line = (f"**TTA ratio SMA / best baseline = {ratio:.2f}** ({sma} against {base}; "
                      f"below 1 means SMA reaches {spec.target:.0%} sooner).")
    trials = []
    for name, o in outcome.items():
        for label, point, _ in o["trials"]:
            for seed in spec.search_seeds:
                r = o["runs"][(label, seed)]
                s = r.summary
                trials.append([name, label + (" **best**" if label == o["best"] else ""), describe(point), seed,
                               f"{r.load_before[0]:.1f}" if r.load_before else "–",
                               "failed: " + (r.error or "") if s is None else
                               (f"{s['tta']:.2f}" if s["reached"] else "not reached"),
                               "–" if s is None or not s["reached"] else s["epochs_to_target"],
                               "–" if s is None else f"{s['best_accuracy']:.4f}"])
    return "\n\n".join([
        f"Target: {spec.target:.0%} test accuracy, at most {spec.epochs} epochs per run. Each method: "
        f"at most {spec.budget} trial(s) from its grid on search seed(s) {spec.search_seeds}; the best trial "
        f"(lowest median time to target) then ran on seeds {spec.seeds}. Cells: median [min–max] over those "
        "seeds (n/r: some seed did not reach the target). TTA counts training time only (evaluation "
        "excluded; tracing included, and also shown as *trace*).",
        table, ratio_line, "### Search trials",
        markdown_table(["method", "trial", "settings", "seed", "load at start", "TTA (s)", "epochs", "best accuracy"],
                       trials)])


def plan_sweep(spec, experiment, sections):
    """[(series, global batch, label, point, {seed: (experiment, options)})], every config validated."""
    plan = []
    for g in spec.global_batches:
        for i, point in enumerate(expand_grid(spec.ssgd_grid)):
            overrides = dict(spec.ssgd_fixed, **point)
            configs = {}
            for seed in spec.seeds:
                where = f"sweep.ssgd (global batch {g}, {describe(point)})"
                exp, opts = run_config(experiment, sections, spec.ssgd_method, overrides, seed=seed,
                                       target=spec.target, epochs=spec.epochs, where=where)
                devices = exp["devices"]["logical_cpu"] or 1
                per = devices * (exp["learners_per_device"] if spec.ssgd_method != "tf_ssgd" else 1)
                _need(isinstance(per, int) and g % per == 0,
                      f"{where}: global batch {g} is not a multiple of the {per} replicas")
                exp["batch_size"] = g // per
                configs[seed] = (exp, opts)
            plan.append(("ssgd", g, f"B{g}_t{i:02d}", point, configs))
    for k in spec.learners:
        for i, point in enumerate(expand_grid(spec.sma_grid)):
            overrides = dict(spec.sma_fixed, **point)
            configs = {}
            for seed in spec.seeds:
                where = f"sweep.sma (k={k}, {describe(point)})"
                exp, opts = run_config(experiment, sections, "sma", overrides, seed=seed,
                                       target=spec.target, epochs=spec.epochs, where=where)
                devices = exp["devices"]["logical_cpu"] or 1
                _need(k % devices == 0, f"{where}: k={k} learners do not spread evenly over {devices} devices")
                exp["learners_per_device"] = k // devices
                exp["batch_size"] = spec.sma_batch
                configs[seed] = (exp, opts)
            plan.append(("sma", k * spec.sma_batch, f"k{k}_t{i:02d}", point, configs))
    return plan


def run_sweep(spec, plan, runner):
    """Runs every sweep point; returns {series: [(global batch, epochs to target or None, best point, records)]}."""
    by = {}
    for series, g, label, point, configs in plan:
        method = spec.ssgd_method if series == "ssgd" else "sma"
        records = [runner.run(method, *configs[s], f"sweep_{series}", f"{label}_s{s}", f"{label} {describe(point)}",
                              s, spec.target, spec.timeout) for s in spec.seeds]
        by.setdefault((series, g), []).append((point, records))
    out = {"ssgd": [], "sma": []}
    for (series, g), trials in by.items():
        best = best_trial([[r.summary for r in records] for _, records in trials], by="epochs")
        point, records = trials[best]
        epochs = seed_statistics([r.summary["epochs_to_target"] for r in records if r.summary is not None])[0]
        out[series].append((g, epochs, point, records))
    return out


def sweep_markdown(spec, result):
    rows = []
    for series, name in (("ssgd", f"S-SGD ({spec.ssgd_method})"), ("sma", f"SMA (b={spec.sma_batch})")):
        for g, epochs, point, records in result[series]:
            ok = [r.summary for r in records if r.summary is not None]
            rows.append([name, g, (f"k={g // spec.sma_batch}" if series == "sma" else f"batch {g}"), describe(point),
                         "not reached" if epochs is None else f"{epochs:g}",
                         fmt(seed_statistics([s["tta"] for s in ok])[0]),
                         fmt(seed_statistics([s["best_accuracy"] for s in ok])[0], 4)])
    largest = {}
    for series in ("ssgd", "sma"):
        if result[series]:
            g, epochs, _, _ = max(result[series], key=lambda t: t[0])
            largest[series] = (g, epochs)
    notes = [f"at the largest global batch: S-SGD {_epochs_text(largest.get('ssgd'), spec.epochs)}, "
             f"SMA {_epochs_text(largest.get('sma'), spec.epochs)}."]
    return "\n\n".join([
        f"Epochs to {spec.target:.0%} test accuracy (median over seeds {spec.seeds}, at most {spec.epochs} epochs) "
        "with the best setting of each grid per point (fewest epochs).",
        markdown_table(["series", "global batch", "point", "best setting", "epochs to target", "TTA (s)",
                        "best accuracy"], rows), "Epochs to target " + notes[0]])


def _epochs_text(item, cap):
    if item is None:
        return "not run"
    g, epochs = item
    return f"{'not reached in ' + str(cap) if epochs is None else f'{epochs:g}'} epochs (global batch {g})"


def sweep_series(spec, result):
    return {f"S-SGD ({spec.ssgd_method}, best lr per batch)": [(g, e) for g, e, _, _ in sorted(result["ssgd"])],
            f"SMA (b={spec.sma_batch}, k learners)": [(g, e) for g, e, _, _ in sorted(result["sma"])]}


def header_markdown(title, command, machine, config_path):
    load = machine["load_average"]
    return "\n".join([
        f"# {title}", "",
        f"- command: `{command}`",
        f"- config: `{config_path}`",
        f"- machine: {machine['cpu']}, {machine['cpu_count']} CPU cores, {machine['platform']}, "
        f"Python {machine['python']}",
        f"- started: {machine['date']}" + (f", load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
                                           if load else ""),
        "- every run is its own process, one at a time; per-run logs, configs and results are under `runs/`.",
        "- fairness choices: see docs/harness.md."])


def software_line(records):
    for r in records:
        if r.summary is not None:
            with open(r.path) as f:
                env = json.load(f).get("environment", {})
            return f"- software: TensorFlow {env.get('tensorflow')}, Keras {env.get('keras')}"
    return "- software: (no run finished)"


def write_json(path, data):
    atomic_write_text(path, json.dumps(
        data, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)))


def command_line():
    return " ".join(["python"] + [os.path.relpath(sys.argv[0]) if i == 0 else a for i, a in enumerate(sys.argv)])


def copy_config(src, out_dir):
    shutil.copyfile(src, os.path.join(out_dir, "config.yaml"))

