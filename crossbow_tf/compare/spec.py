"""Reading and validating a harness spec: the ``compare:`` and ``sweep:`` sections of a YAML
experiment (a ``sweep:`` with ``series:`` is the reproduction study's, see
crossbow_tf/compare/plan.py), and each run's validated configuration. Nothing here imports
TensorFlow.
"""
import dataclasses
import functools
import os

from baselines import METHODS
from baselines._cli import parse_tf_ssgd_options, read_yaml, split_sections
from crossbow_tf import config as config_lib
from crossbow_tf.compare import netns
from crossbow_tf.compare.launch import MULTI_WORKER_METHODS
from crossbow_tf.errors import ConfigError
from crossbow_tf.user_model import locate_model

from baselines import LEARNER_METHODS  # noqa: E402,F401  (the global batch is k learners x b; from the rule registry)


@dataclasses.dataclass
class Entry:
    """One row of the comparison: a method with its fixed settings and its search grid."""
    name: str
    method: str
    fixed: dict
    grid: dict
    workers: int = 1          # worker processes per run (a multi-worker run the harness launches)


@dataclasses.dataclass
class SearchProtocol:
    """What a comparison and a study share: trials per searched setting (BUDGET), the seeds of the
    search and of the replication, the target accuracy, and one run's epochs and timeout."""
    budget: int
    search_seeds: list
    seeds: list
    target: float
    epochs: int
    timeout: float


def _protocol(section, experiment, where, budget, timeout):
    """SearchProtocol's fields from SECTION, with BUDGET and TIMEOUT the defaults; EXPERIMENT (a
    mapping) supplies the target and the epochs."""
    return dict(budget=_positive(section.get("budget", budget), f"{where}.budget", int),
                search_seeds=_int_list(section.get("search_seeds", [0]), f"{where}.search_seeds"),
                seeds=_int_list(section.get("seeds", [0, 1, 2]), f"{where}.seeds"),
                target=_target(section, experiment, where),
                epochs=_positive(section.get("epochs", experiment.get("epochs", 10)), f"{where}.epochs", int),
                timeout=_positive(section.get("timeout", timeout), f"{where}.timeout"))


@dataclasses.dataclass
class CompareSpec(SearchProtocol):
    entries: list


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
    workers: dict = dataclasses.field(default_factory=dict)   # {"ssgd"/"sma": worker processes per run}


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


def _workers(body, method, where):
    """The worker processes of each run of METHOD (``workers:``, default 1)."""
    workers = _positive(body.get("workers", 1), f"{where}.workers", int)
    _need(workers == 1 or method in MULTI_WORKER_METHODS,
          f"{where}.workers: {method} runs on one worker; several workers run {', '.join(MULTI_WORKER_METHODS)}")
    return workers


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
        _known(body, ("method", "fixed", "grid", "workers"), w)
        method = body.get("method", name)
        _need(method in METHODS, f"{w}.method: unknown method {method!r}; choose one of {', '.join(METHODS)}")
        entries.append(Entry(str(name), method, _mapping(body.get("fixed"), f"{w}.fixed"),
                             _grid(body.get("grid"), f"{w}.grid"),
                             _workers(body, method, w)))
    _need(any(e.method == "sma" for e in entries) and any(e.method != "sma" for e in entries),
          f"{where}.methods: list sma and at least one baseline ({', '.join(m for m in METHODS if m != 'sma')})")
    return CompareSpec(entries=entries, **_protocol(section, experiment, where, budget=4, timeout=900))


def parse_sweep(section, experiment, where="sweep"):
    _known(section, ("ssgd", "sma", "seeds", "target", "epochs", "timeout"), where)
    ssgd = _mapping(section.get("ssgd"), f"{where}.ssgd")
    sma = _mapping(section.get("sma"), f"{where}.sma")
    _known(ssgd, ("method", "global_batches", "fixed", "grid", "workers"), f"{where}.ssgd")
    _known(sma, ("batch_size", "learners", "fixed", "grid", "workers"), f"{where}.sma")
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
        timeout=_positive(section.get("timeout", 900), f"{where}.timeout"),
        workers={name: _workers(part, m, f"{where}.{name}") for name, part, m in (("ssgd", ssgd, method),
                                                                                   ("sma", sma, "sma"))})


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
        raise ConfigError(f"data.path: {path} not found{_relative_to_here(path)}")


def check_data_directory(experiment, where):
    """The data set's directory is there (else every run would fail on it alike), checked from this
    folder without reading it; by the commands about to train, not by one that only writes a report
    of runs made elsewhere."""
    data = config_lib.from_dict(experiment).data   # validated by load_harness_config: defaults filled in
    problem = config_lib.data_directory_problem(data.name, data.data_dir)
    if problem:
        raise ConfigError(f"{where}: data.data_dir: {problem}{_relative_to_here(data.data_dir)}")


def _relative_to_here(path):
    return f" (paths are relative to the current folder {os.getcwd()})" if path and not os.path.isabs(path) else ""


@functools.lru_cache(maxsize=None)
def _locate_model(spec, folder):   # once per model and folder: a plan holds hundreds of runs
    locate_model(spec)


# ---------------------------------------------------------------------------------------------
# The reproduction study's sweep: section (series:).


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
    workers: int = 1           # worker processes per run (a multi-worker run the harness launches)


@dataclasses.dataclass
class StudySpec(SearchProtocol):
    global_batches: list
    series: list
    notes: list = dataclasses.field(default_factory=list)   # protocol notes the report prints
    point_budgets: dict = dataclasses.field(default_factory=dict)   # G -> budget, where not `budget`
    # "series": each series' trials one after another; "interleaved": the series take turns, trial
    # by trial, so that a drift in the machine's load falls on every series alike.
    order: str = "series"
    # The limits phase: every multi-worker series' best trial again on every seed, each worker behind
    # each of these (netns.Limit; crossbow-reproduce --phases ... limits).
    network_limits: list = dataclasses.field(default_factory=list)

    def budget_at(self, g):
        return self.point_budgets.get(g, self.budget)

    def describe_budget(self):
        """'4 trials per searched series per point (8 at G=2048)'."""
        extra = ", ".join(f"{n} at G={g}" for g, n in self.point_budgets.items())
        return f"{self.budget} trials per searched series per point" + (f" ({extra})" if extra else "")


def is_study(section):
    return isinstance(section, dict) and "series" in section


def _series(name, body, where, points):
    body = _mapping(body, where)
    _known(body, ("method", "batch_size", "fixed", "grid", "points", "untuned", "global_batches",
                  "beyond_crossbow", "workers"), where)
    method = body.get("method", name)
    _need(method in METHODS, f"{where}.method: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    untuned = body.get("untuned", False)
    _need(isinstance(untuned, bool), f"{where}.untuned: expected true or false, got {untuned!r}")
    beyond = body.get("beyond_crossbow", method not in ("sma", "tf_ssgd"))
    _need(isinstance(beyond, bool), f"{where}.beyond_crossbow: expected true or false, got {beyond!r}")
    if method in LEARNER_METHODS:
        batch = _positive(body.get("batch_size"), f"{where}.batch_size (per learner)", int)
    else:
        _need("batch_size" not in body, f"{where}.batch_size: {method} takes its batch from the global batch "
              "(G / devices); leave it out")
        batch = None
    own = body.get("global_batches")
    own = _int_list(own, f"{where}.global_batches", 1) if own is not None else None
    if own is not None:
        extra = [g for g in own if g not in points]
        if extra:
            raise ConfigError(f"{where}.global_batches: {extra[0]} is not a point of the study ({points})")
    per_point = {}
    for g, over in _mapping(body.get("points"), f"{where}.points").items():
        w = f"{where}.points.{g}"
        if g not in points:
            raise ConfigError(f"{w}: {g!r} is not a point of the study ({points})")
        over = _mapping(over, w)
        _known(over, ("fixed", "grid"), w)
        per_point[g] = {"fixed": _mapping(over.get("fixed"), f"{w}.fixed"),
                        "grid": _trials_grid(over.get("grid"), f"{w}.grid") if "grid" in over else None}
    grid = _trials_grid(body.get("grid"), f"{where}.grid") if body.get("grid") is not None else {}
    if untuned:
        _need(not grid and not any(p["grid"] for p in per_point.values()),
              f"{where}: an untuned series runs one setting (fixed only), not a grid")
    return Series(str(name), method, batch, _mapping(body.get("fixed"), f"{where}.fixed"), grid,
                  per_point, untuned, own, beyond, _workers(body, method, where))


def parse_study(section, experiment, where="sweep"):
    """StudySpec from a sweep: mapping with series (see the module doc)."""
    _known(section, ("global_batches", "series", "budget", "search_seeds", "seeds", "target", "epochs",
                     "timeout", "notes", "point_budgets", "order", "network_limits"), where)
    notes = section.get("notes", [])
    _need(isinstance(notes, list) and all(isinstance(n, str) and n.strip() for n in notes),
          f"{where}.notes: expected a list of sentences, got {notes!r}")
    points = _int_list(section.get("global_batches"), f"{where}.global_batches", 1)
    _need(len(set(points)) == len(points), f"{where}.global_batches: a point is listed twice ({points})")
    series = section.get("series")
    _need(isinstance(series, dict) and series, f"{where}.series: expected a mapping of series, got {series!r}")
    spec = StudySpec(
        global_batches=points,
        series=[_series(name, body, f"{where}.series.{name}", points) for name, body in series.items()],
        **_protocol(section, experiment, where, budget=3, timeout=1800),
        notes=[" ".join(n.split()) for n in notes],
        point_budgets=_point_budgets(section.get("point_budgets"), points, f"{where}.point_budgets"),
        order=section.get("order", "series"),
        network_limits=_network_limits(section.get("network_limits"), f"{where}.network_limits"))
    _need(spec.order in ("series", "interleaved"),
          f"{where}.order: expected series or interleaved, got {spec.order!r}")
    _need(any(not s.untuned for s in spec.series), f"{where}.series: at least one series must be searched")
    return spec


def _network_limits(value, where):
    """[netns.Limit] of a list of RATE[/DELAY] texts ([1gbit, 100mbit/1ms]); [] when not given."""
    if value is None:
        return []
    _need(isinstance(value, list) and value and all(isinstance(v, str) for v in value),
          f"{where}: expected a list of limits RATE[/DELAY] such as [1gbit, 100mbit], got {value!r}")
    limits = []
    for text in value:
        try:
            limits.append(netns.Limit.parse(text))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    labels = [limit.label() for limit in limits]
    _need(len(set(labels)) == len(labels), f"{where}: a limit is listed twice ({value})")
    return limits


def _point_budgets(value, points, where):
    """{G: budget}: a point where every searched series gets the same, larger or smaller, budget (for
    example a second round of trials at a point whose first round left a series at a grid's edge)."""
    budgets = {}
    for g, n in _mapping(value, where).items():
        _need(g in points, f"{where}: {g!r} is not a point of the study ({points})")
        budgets[g] = _positive(n, f"{where}.{g}", int)
    return budgets


def _trials_grid(value, where):
    """A grid: {dotted key: [values]} (every combination), or a list of explicit trial points."""
    if isinstance(value, list):
        _need(value and all(isinstance(p, dict) and p for p in value),
              f"{where}: a list of trials must hold non-empty mappings of dotted keys, got {value!r}")
        return value
    return _grid(value, where)
