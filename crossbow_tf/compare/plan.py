"""Planning: grids expanded into trials within their budgets, and every run's configuration built
and validated before anything runs (compare, the one-grid sweep, the reproduction study).

The reproduction study is a ``sweep:`` section with a ``series:`` mapping:

    sweep:
      global_batches: [128, 2048, 512]   # points, run in this order (so early ones finish first)
      budget: 3                          # trials per searched series per point, the same for all
      point_budgets: {2048: 6}           # a point where every searched series gets a larger budget
      order: interleaved                 # the series take turns run by run (default: series, one after another)
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
import itertools
import math
import random
import re
import zlib

from crossbow_tf.compare.spec import LEARNER_METHODS, Series, _need, run_config
from crossbow_tf.device_choice import choose_devices, visible_gpu_ids

_IN_K = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)?\s*/\s*(k|sqrt\(k\))\s*$")


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


def describe(point):
    """A short label of a grid point: key=value, last part of each dotted key."""
    return " ".join(f"{k.split('.')[-1]}={'null' if v is None else v}" for k, v in point.items()) or "defaults"


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


def trial_devices(experiment, gpus=None):
    """The devices a trial of EXPERIMENT (a run config) trains on when it is given GPUS (GPU ids;
    default: the GPUs this process may use), chosen as the trial itself will choose them
    (crossbow_tf.device_choice): every GPU, else devices.logical_cpu, else 1."""
    logical_cpu = (experiment.get("devices") or {}).get("logical_cpu")
    return choose_devices(visible_gpu_ids() if gpus is None else gpus, logical_cpu).count


def trial_gpus(parallel=1, gpus_per_trial=None):
    """The GPU ids each trial gets under --parallel PARALLEL and --gpus-per-trial GPUS_PER_TRIAL (every
    slot gets as many; None: those of this process): the GPUS to plan with (plan_sweep, plan_study), so
    that the plan's k is the k the trials will train, which the runner checks per slot."""
    # Imported here: trials brings Optuna, which planning alone does not need.
    from crossbow_tf.compare import trials as trials_lib
    return trials_lib.slot_gpus(trials_lib.make_slots(parallel, gpus_per_trial)[0])


def planned_shape(method, experiment, gpus=None):
    """(k, global batch) of a run of METHOD with EXPERIMENT given GPUS: learners (engine methods) or
    replicas (tf_ssgd); None for what the machine decides (learners_per_device: auto)."""
    per_device = experiment.get("learners_per_device", 1) if method in LEARNER_METHODS else 1
    if not isinstance(per_device, int) or not isinstance(experiment.get("batch_size"), int):
        return None, None
    devices = trial_devices(experiment, gpus)
    return devices * per_device, devices * per_device * experiment["batch_size"]


def plan_sweep(spec, experiment, sections, gpus=None):
    """[(series, global batch, label, point, {seed: (experiment, options)})], every config validated;
    GPUS: the GPU ids each trial gets (default: those of this process)."""
    plan = []
    for g in spec.global_batches:
        for i, point in enumerate(expand_grid(spec.ssgd_grid)):
            overrides = dict(spec.ssgd_fixed, **point)
            configs = {}
            for seed in spec.seeds:
                where = f"sweep.ssgd (global batch {g}, {describe(point)})"
                exp, opts = run_config(experiment, sections, spec.ssgd_method, overrides, seed=seed,
                                       target=spec.target, epochs=spec.epochs, where=where)
                devices = trial_devices(exp, gpus)
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
                devices = trial_devices(exp, gpus)
                _need(k % devices == 0, f"{where}: k={k} learners do not spread evenly over {devices} devices")
                exp["learners_per_device"] = k // devices
                exp["batch_size"] = spec.sma_batch
                configs[seed] = (exp, opts)
            plan.append(("sma", k * spec.sma_batch, f"k{k}_t{i:02d}", point, configs))
    return plan


# ---------------------------------------------------------------------------------------------
# The reproduction study.


@dataclasses.dataclass
class Cell:
    """One series at one global batch: its trials, each with its validated run configs by seed."""
    series: Series
    global_batch: int
    k: int                     # learners (LEARNER_METHODS) or replicas (tf_ssgd)
    trials: list               # [(label, point, {seed: (experiment, options)})]


def in_k(value, k):
    """VALUE with expressions in k (``1/k``, ``0.5/sqrt(k)``) evaluated; other values unchanged."""
    if not isinstance(value, str):
        return value
    match = _IN_K.match(value)
    if not match:
        return value
    numerator = float(match.group(1) or 1.0)
    return float(f"{numerator / (k if match.group(2) == 'k' else math.sqrt(k)):.4g}")   # readable in configs and reports


def point_settings(series, g):
    """(fixed, grid) of SERIES at global batch G: the point's own replace the series' keys."""
    over = series.points.get(g, {})
    fixed = dict(series.fixed, **over.get("fixed", {}))
    grid = over["grid"] if over.get("grid") is not None else series.grid
    return fixed, grid


def _trial_points(series, g, budget, where):
    fixed, grid = point_settings(series, g)
    if series.untuned:
        return fixed, [{}]
    points = list(grid) if isinstance(grid, list) else expand_grid(grid)
    # Equal budgets: a searched series with fewer grid points than the budget would get less tuning.
    _need(len(points) >= budget, f"{where}: the grid has {len(points)} point(s), fewer than the budget of "
          f"{budget} trials that every searched series gets; add values or lower sweep.budget")
    return fixed, choose_trials(points, budget, seed=zlib.crc32(f"{series.name}/{g}".encode()))


def plan_study(spec, experiment, sections, gpus=None):
    """[Cell] in run order (points in the order given, series in the order written); every run's
    configuration is built and validated here, before anything runs. GPUS: the GPU ids each trial
    gets (default: those of this process); k counts the devices the trials will really have."""
    cells = []
    seeds = sorted(set(spec.search_seeds) | set(spec.seeds))
    for g in spec.global_batches:
        for series in spec.series:
            if series.global_batches is not None and g not in series.global_batches:
                continue
            where = f"sweep.series.{series.name} (global batch {g})"
            fixed, points = _trial_points(series, g, spec.budget_at(g), where)
            base, _ = run_config(experiment, sections, series.method, fixed, seed=0, target=spec.target,
                                 epochs=spec.epochs, where=where)
            devices = trial_devices(base, gpus) * series.workers   # G spans every worker's devices
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
                    exp, opts = run_config(experiment, sections, series.method,
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
