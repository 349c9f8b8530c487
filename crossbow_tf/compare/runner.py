"""Running: one training process per run (``python -m MODULE --config RUN.yaml --results
RUN.json``), one at a time, with progress, ETA and resume; the report directory; the three studies'
run loops.

Every run is its own process: TensorFlow fixes its logical device split once per process, and a
fresh process keeps one run's tracing, caches and threads out of another's timing. Runs go one at a
time for the same reason. Only results files are read (crossbow_tf/results.py); nothing here
imports TensorFlow.
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
        # A run that diverged (exit code 3, its results say where) or collapsed (exit code 5, at chance
        # accuracy) is an outcome, not a failure.
        finished = record.summary is not None and (code == 0 or (code == 3 and record.summary["diverged"])
                                                   or (code == 5 and record.summary["collapsed"]))
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
                   PYTHONPATH=os.pathsep.join([PACKAGE_ROOT, here] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        cmd = [self.python, "-m", module, "--config", paths["yaml"], "--results", paths["json"], *extra_args]
        lines = queue.Queue()
        with open(paths["log"], "w") as log:
            log.write("$ " + " ".join(relative_path(a) for a in cmd) + "\n")   # names no machine's folders
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


def run_study(spec, cells, runner):
    """Point by point, in the order of the global batches given: every cell's search trials at that
    point on the search seeds, then each cell's best trial on every seed. A study stopped part-way
    so has whole points (searched and replicated) before the one it stopped in.

    Returns {(series name, G): outcome dict}. Trials are ranked by fewest median epochs to target,
    then time (best_trial(by="epochs")): the study's question is statistical efficiency.
    """
    outcome = {}

    def do(cell, label, point, seed, note=""):
        exp, opts = next(configs for name, _, configs in cell.trials if name == label)[seed]
        subdir = f"{cell.series.name}/G{cell.global_batch}"
        return runner.run(cell.series.method, exp, opts, subdir, f"{label}_s{seed}",
                          f"{label} {describe(point)}{note}", seed, spec.target, spec.timeout)

    points = list(dict.fromkeys(cell.global_batch for cell in cells))
    for global_batch in points:
        at_point = [cell for cell in cells if cell.global_batch == global_batch]
        for cell in at_point:
            runs = {}
            seeds = sorted(set(spec.seeds) | set(spec.search_seeds)) if cell.series.untuned else spec.search_seeds
            for label, point, _ in cell.trials:
                for seed in seeds:
                    runs[(label, seed)] = do(cell, label, point, seed)
            outcome[(cell.series.name, cell.global_batch)] = dict(cell=cell, runs=runs)
        for cell in at_point:
            o = outcome[(cell.series.name, cell.global_batch)]
            runs = o["runs"]
            search = [[runs[(label, s)].summary for s in spec.search_seeds] for label, _, _ in cell.trials]
            best = 0 if cell.series.untuned else best_trial(search, by="epochs")
            label, point, _ = cell.trials[best]
            for seed in spec.seeds:
                if (label, seed) not in runs:
                    runs[(label, seed)] = do(cell, label, point, seed, " (best)")
            o.update(best=label, best_point=point, final=[runs[(label, s)] for s in spec.seeds])
    return outcome
