"""The reproduction study's specification and plan (tools/reproduce.py): statistical efficiency per
global batch G, with every method's grid stated per point and equal search budgets enforced.

The ``sweep:`` section of a config describes it when it has a ``series:`` mapping (the older form,
one grid for every batch, is tools/harness.py's parse_sweep):

    sweep:
      global_batches: [128, 2048, 512]   # points, run in this order (so early ones finish first)
      budget: 3                          # trials per searched series per point, the same for all
      point_budgets: {2048: 6}           # a point where every searched series gets a larger budget
      search_seeds: [0]
      seeds: [0, 1, 2]                   # the best trial per point runs on these
      target: 0.89
      epochs: 12
      notes: ["what the report must say about the protocol, e.g. a grid changed after a first look"]
      series:
        ssgd_linear:                     # a searched series
          method: tf_ssgd
          fixed: {tf_ssgd.lr_scaling: linear}
          grid: {learning_rate.base: [0.02, 0.05, 0.1]}
        ssgd_unscaled:                   # untuned: one setting, every seed, not searched
          method: tf_ssgd
          untuned: true
          fixed: {learning_rate.base: 0.05}
        sma_b16:
          method: sma
          batch_size: 16                 # per learner: k = G / (16 x devices) learners per device
          grid: {algorithm.alpha: [0.1, 1/k], learning_rate.base: [0.02, 0.05]}
          points:                        # per-point grids and fixed keys replace the series' own
            2048: {grid: {algorithm.alpha: [0.05, 1/k, 0.5/sqrt(k)], learning_rate.base: [0.05]}}

Grid values of SMA-like series may be written in k, the point's number of learners: ``1/k``,
``0.5/k``, ``1/sqrt(k)``. Nothing here imports TensorFlow.
"""
import dataclasses
import math
import re
import zlib

import harness
from baselines import METHODS
from crossbow_tf.errors import ConfigError

_need = harness._need
LEARNER_METHODS = ("sma", "easgd", "crossbow_ssgd", "localsgd")     # the global batch is k learners x b
_IN_K = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)?\s*/\s*(k|sqrt\(k\))\s*$")


@dataclasses.dataclass
class Series:
    name: str
    method: str
    batch_size: int            # per learner for LEARNER_METHODS; None for tf_ssgd (G / devices)
    fixed: dict
    grid: dict
    points: dict               # G -> {"fixed": {...}, "grid": {...}}
    untuned: bool
    global_batches: list       # None: every point of the study
    # Not one of the paper's methods (an averaging method beyond Crossbow's SMA): judged in the
    # report's own verdict row, kept out of the rows about the paper's claims.
    beyond_crossbow: bool = False


@dataclasses.dataclass
class StudySpec:
    global_batches: list
    series: list
    budget: int
    search_seeds: list
    seeds: list
    target: float
    epochs: int
    timeout: float
    notes: list = dataclasses.field(default_factory=list)   # protocol notes the report prints
    point_budgets: dict = dataclasses.field(default_factory=dict)   # G -> budget, where not `budget`

    def budget_at(self, g):
        return self.point_budgets.get(g, self.budget)

    def describe_budget(self):
        """'4 trials per searched series per point (8 at G=2048)'."""
        extra = ", ".join(f"{n} at G={g}" for g, n in self.point_budgets.items())
        return f"{self.budget} trials per searched series per point" + (f" ({extra})" if extra else "")


@dataclasses.dataclass
class Cell:
    """One series at one global batch: its trials, each with its validated run configs by seed."""
    series: Series
    global_batch: int
    k: int                     # learners (LEARNER_METHODS) or replicas (tf_ssgd)
    trials: list               # [(label, point, {seed: (experiment, options)})]


def is_study(section):
    return isinstance(section, dict) and "series" in section


def in_k(value, k):
    """VALUE with expressions in k (``1/k``, ``0.5/sqrt(k)``) evaluated; other values unchanged."""
    if not isinstance(value, str):
        return value
    match = _IN_K.match(value)
    if not match:
        return value
    numerator = float(match.group(1) or 1.0)
    return float(f"{numerator / (k if match.group(2) == 'k' else math.sqrt(k)):.4g}")   # readable in configs and reports


def _series(name, body, where, points):
    body = harness._mapping(body, where)
    harness._known(body, ("method", "batch_size", "fixed", "grid", "points", "untuned", "global_batches",
                          "beyond_crossbow"), where)
    method = body.get("method", name)
    _need(method in METHODS, f"{where}.method: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    untuned = body.get("untuned", False)
    _need(isinstance(untuned, bool), f"{where}.untuned: expected true or false, got {untuned!r}")
    beyond = body.get("beyond_crossbow", method not in ("sma", "tf_ssgd"))
    _need(isinstance(beyond, bool), f"{where}.beyond_crossbow: expected true or false, got {beyond!r}")
    if method in LEARNER_METHODS:
        batch = harness._positive(body.get("batch_size"), f"{where}.batch_size (per learner)", int)
    else:
        _need("batch_size" not in body, f"{where}.batch_size: {method} takes its batch from the global batch "
              "(G / devices); leave it out")
        batch = None
    own = body.get("global_batches")
    own = harness._int_list(own, f"{where}.global_batches", 1) if own is not None else None
    if own is not None:
        extra = [g for g in own if g not in points]
        if extra:
            raise ConfigError(f"{where}.global_batches: {extra[0]} is not a point of the study ({points})")
    per_point = {}
    for g, over in harness._mapping(body.get("points"), f"{where}.points").items():
        w = f"{where}.points.{g}"
        if g not in points:
            raise ConfigError(f"{w}: {g!r} is not a point of the study ({points})")
        over = harness._mapping(over, w)
        harness._known(over, ("fixed", "grid"), w)
        per_point[g] = {"fixed": harness._mapping(over.get("fixed"), f"{w}.fixed"),
                        "grid": _trials_grid(over.get("grid"), f"{w}.grid") if "grid" in over else None}
    grid = _trials_grid(body.get("grid"), f"{where}.grid") if body.get("grid") is not None else {}
    if untuned:
        _need(not grid and not any(p["grid"] for p in per_point.values()),
              f"{where}: an untuned series runs one setting (fixed only), not a grid")
    return Series(str(name), method, batch, harness._mapping(body.get("fixed"), f"{where}.fixed"), grid,
                  per_point, untuned, own, beyond)


def parse_study(section, experiment, where="sweep"):
    """StudySpec from a sweep: mapping with series (see the module doc)."""
    harness._known(section, ("global_batches", "series", "budget", "search_seeds", "seeds", "target", "epochs",
                             "timeout", "notes", "point_budgets"), where)
    notes = section.get("notes", [])
    _need(isinstance(notes, list) and all(isinstance(n, str) and n.strip() for n in notes),
          f"{where}.notes: expected a list of sentences, got {notes!r}")
    points = harness._int_list(section.get("global_batches"), f"{where}.global_batches", 1)
    _need(len(set(points)) == len(points), f"{where}.global_batches: a point is listed twice ({points})")
    series = section.get("series")
    _need(isinstance(series, dict) and series, f"{where}.series: expected a mapping of series, got {series!r}")
    spec = StudySpec(
        global_batches=points,
        series=[_series(name, body, f"{where}.series.{name}", points) for name, body in series.items()],
        budget=harness._positive(section.get("budget", 3), f"{where}.budget", int),
        search_seeds=harness._int_list(section.get("search_seeds", [0]), f"{where}.search_seeds"),
        seeds=harness._int_list(section.get("seeds", [0, 1, 2]), f"{where}.seeds"),
        target=harness._target(section, experiment, where),
        epochs=harness._positive(section.get("epochs", experiment.get("epochs", 10)), f"{where}.epochs", int),
        timeout=harness._positive(section.get("timeout", 1800), f"{where}.timeout"),
        notes=[" ".join(n.split()) for n in notes],
        point_budgets=_point_budgets(section.get("point_budgets"), points, f"{where}.point_budgets"))
    _need(any(not s.untuned for s in spec.series), f"{where}.series: at least one series must be searched")
    return spec


def _point_budgets(value, points, where):
    """{G: budget}: a point where every searched series gets the same, larger or smaller, budget (for
    example a second round of trials at a point whose first round left a series at a grid's edge)."""
    budgets = {}
    for g, n in harness._mapping(value, where).items():
        _need(g in points, f"{where}: {g!r} is not a point of the study ({points})")
        budgets[g] = harness._positive(n, f"{where}.{g}", int)
    return budgets


def point_settings(series, g):
    """(fixed, grid) of SERIES at global batch G: the point's own replace the series' keys."""
    over = series.points.get(g, {})
    fixed = dict(series.fixed, **over.get("fixed", {}))
    grid = over["grid"] if over.get("grid") is not None else series.grid
    return fixed, grid


def _trials_grid(value, where):
    """A grid: {dotted key: [values]} (every combination), or a list of explicit trial points."""
    if isinstance(value, list):
        _need(value and all(isinstance(p, dict) and p for p in value),
              f"{where}: a list of trials must hold non-empty mappings of dotted keys, got {value!r}")
        return value
    return harness._grid(value, where)


def _trial_points(series, g, budget, where):
    fixed, grid = point_settings(series, g)
    if series.untuned:
        return fixed, [{}]
    points = list(grid) if isinstance(grid, list) else harness.expand_grid(grid)
    # Equal budgets: a searched series with fewer grid points than the budget would get less tuning.
    _need(len(points) >= budget, f"{where}: the grid has {len(points)} point(s), fewer than the budget of "
          f"{budget} trials that every searched series gets; add values or lower sweep.budget")
    return fixed, harness.choose_trials(points, budget, seed=zlib.crc32(f"{series.name}/{g}".encode()))


def plan_study(spec, experiment, sections):
    """[Cell] in run order (points in the order given, series in the order written); every run's
    configuration is built and validated here, before anything runs."""
    cells = []
    seeds = sorted(set(spec.search_seeds) | set(spec.seeds))
    for g in spec.global_batches:
        for series in spec.series:
            if series.global_batches is not None and g not in series.global_batches:
                continue
            where = f"sweep.series.{series.name} (global batch {g})"
            fixed, points = _trial_points(series, g, spec.budget_at(g), where)
            base, _ = harness.run_config(experiment, sections, series.method, fixed, seed=0, target=spec.target,
                                         epochs=spec.epochs, where=where)
            devices = base["devices"]["logical_cpu"] or 1
            if series.method in LEARNER_METHODS:
                per = series.batch_size * devices
                _need(g % per == 0, f"{where}: {g} is not a multiple of batch_size {series.batch_size} "
                      f"x {devices} device(s)")
                k, shape = g // series.batch_size, {"learners_per_device": g // per, "batch_size": series.batch_size}
            else:
                _need(g % devices == 0, f"{where}: {g} is not a multiple of the {devices} replicas")
                k, shape = devices, {"batch_size": g // devices}
            trials = []
            for i, point in enumerate(points):
                resolved = {key: in_k(value, k) for key, value in point.items()}
                configs = {}
                for seed in seeds:
                    exp, opts = harness.run_config(experiment, sections, series.method,
                                                   dict(fixed, **resolved, **shape), seed=seed,
                                                   target=spec.target, epochs=spec.epochs, where=where)
                    configs[seed] = (exp, opts)
                trials.append((f"t{i:02d}", resolved, configs))
            cells.append(Cell(series, g, k, trials))
    return cells


def count_runs(spec, cells):
    extra = len(set(spec.seeds) - set(spec.search_seeds))
    total = 0
    for cell in cells:
        if cell.series.untuned:
            total += len(set(spec.seeds) | set(spec.search_seeds))
        else:
            total += len(cell.trials) * len(spec.search_seeds) + extra
    return total


def searched_budgets(cells):
    """{(series, G): trials} of the searched cells: the equal-budget check's evidence for the report."""
    return {(c.series.name, c.global_batch): len(c.trials) for c in cells if not c.series.untuned}


def run_study(spec, cells, runner):
    """Point by point, in the order of the global batches given: every cell's search trials at that
    point on the search seeds, then each cell's best trial on every seed. A study stopped part-way
    so has whole points (searched and replicated) before the one it stopped in.

    Returns {(series name, G): outcome dict}. Trials are ranked by fewest median epochs to target,
    then time (harness.best_trial(by="epochs")): the study's question is statistical efficiency.
    """
    outcome = {}

    def do(cell, label, point, seed, note=""):
        exp, opts = next(configs for name, _, configs in cell.trials if name == label)[seed]
        subdir = f"{cell.series.name}/G{cell.global_batch}"
        return runner.run(cell.series.method, exp, opts, subdir, f"{label}_s{seed}",
                          f"{label} {harness.describe(point)}{note}", seed, spec.target, spec.timeout)

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
            best = 0 if cell.series.untuned else harness.best_trial(search, by="epochs")
            label, point, _ = cell.trials[best]
            for seed in spec.seeds:
                if (label, seed) not in runs:
                    runs[(label, seed)] = do(cell, label, point, seed, " (best)")
            o.update(best=label, best_point=point, final=[runs[(label, s)] for s in spec.seeds])
    return outcome
