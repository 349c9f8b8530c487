"""A multi-worker study's time to accuracy projected beyond this machine: a projection, not a measurement.

    python tools/project_across_workers.py --study docs/results/lenet_fashion_mnist_2workers
    python tools/project_across_workers.py --study DIR --bandwidths 1 10 100 --workers 2 8 32 --out /tmp/p

From each series of the study (its best trial's seeds, chosen as the study's report chooses them;
while the search runs, the best trial finished so far, marked provisional) it takes the measured
inputs: the median epochs to target E, the iterations per epoch I, the compute time per iteration
c measured on W0 workers, the all-reduce's payload P (bytes) and the rule's synchronisation
schedule. The time to target on W workers joined at B bit/s is then

    T(W, B) = E * I * c * W0 / W  +  S * (2 (W - 1) / W * 8 P / B  +  2 (W - 1) * alpha)

with S the all-reduces up to the target (the rule's own schedule over E * I iterations: every
iteration, every H-th, or every iteration for the first epochs of post-local SGD, then every H-th)
and alpha the per-message latency (--alpha-us). A ring all-reduce over W workers sends
2 (W - 1) / W x P bytes per worker in 2 (W - 1) messages (crossbow_tf/distribute/traffic.py).
Assumed, not measured: per-worker compute proportional to G / W at a fixed global batch G, the
epochs to target independent of W, the link used at its full rate, no overlap of transfer and
compute. The crossover against tuned S-SGD is solved in closed form: writing T = a + b / B,
a series and S-SGD take equal times at B* = (b_x - b_s) / (a_s - a_x).

Writes OUT/projection.md (the formula, every measured input with the files it came from, the
tables, the crossovers, and a check against the runs the study measured behind real bandwidth
limits, runs/<series>/G<g>/net-<limit>/, when it has them) and OUT/projection.png (time to target
against bandwidth, one line per series, one panel per worker count). OUT defaults to the study's
folder. Reads no TensorFlow.
"""
import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # a checkout's crossbow_tf
from crossbow_tf.cli import OneLineParser, fail, path_argument  # noqa: E402
from crossbow_tf.compare import across_workers, study_report  # noqa: E402
from crossbow_tf.compare.plan import describe, plan_study  # noqa: E402
from crossbow_tf.compare.report import fmt, markdown_table  # noqa: E402
from crossbow_tf.compare.spec import is_study, load_harness_config, parse_study  # noqa: E402
from crossbow_tf.compare.stats import best_trial, over_seeds  # noqa: E402
from crossbow_tf.config import make_rule  # noqa: E402
from crossbow_tf.distribute.traffic import ring_bytes  # noqa: E402
from crossbow_tf.errors import ConfigError, CrossbowError  # noqa: E402
from crossbow_tf.files import atomic_write, atomic_write_text, check_creatable, recorded_path  # noqa: E402

PROG = "project_across_workers"
GBIT = 1e9
HEADING = "Beyond this machine: a projection, not a measurement"


# ---------------------------------------------------------------------------------------------- the model

@dataclasses.dataclass(frozen=True)
class Inputs:
    """One series' measured inputs to the projection (medians over its chosen runs)."""
    name: str
    method: str
    trial: str                  # the chosen trial's label (t00 ...)
    setting: str
    choice: str                 # how its runs were chosen (the study's best trial, or provisional)
    runs: int
    reached: int
    epochs: float               # median epochs to target; the cap when not reached (then a lower bound)
    reached_target: bool
    iterations_per_epoch: int
    workers: int                # W0: the workers the compute was measured on
    compute_ms: float           # per iteration on W0 workers
    compute_source: str
    step_ms: float
    payload_bytes: float        # one all-reduce's vector
    syncs: int                  # all-reduces in the E * I iterations
    schedule: str
    measured_tta: float         # median measured time to target (s); None when not reached
    files: tuple

    @property
    def iterations(self):
        return int(round(self.epochs * self.iterations_per_epoch))


def ring_seconds(payload_bytes, workers, bits_per_second, alpha_seconds):
    """One ring all-reduce of PAYLOAD_BYTES over WORKERS: 2(W-1)/W x payload per worker on the link
    and 2(W-1) messages of latency ALPHA_SECONDS."""
    return 8 * ring_bytes(payload_bytes, workers) / bits_per_second + 2 * (workers - 1) * alpha_seconds


def projected_time(inputs, workers, bits_per_second, alpha_seconds):
    """Seconds to target (to the cap, a lower bound, when INPUTS did not reach) on WORKERS workers at
    BITS_PER_SECOND: compute scaled from W0 workers at a fixed global batch, plus every all-reduce."""
    compute = inputs.iterations * inputs.compute_ms / 1000 * inputs.workers / workers
    return compute + inputs.syncs * ring_seconds(inputs.payload_bytes, workers, bits_per_second, alpha_seconds)


def time_terms(inputs, workers, alpha_seconds):
    """(a, b): the projected time is a + b / B at B bit/s (a: compute and latency, b: bits on the link)."""
    a = (inputs.iterations * inputs.compute_ms / 1000 * inputs.workers / workers
         + inputs.syncs * 2 * (workers - 1) * alpha_seconds)
    return a, inputs.syncs * 8 * ring_bytes(inputs.payload_bytes, workers)


def crossover(series_terms, reference_terms):
    """(B*, how): where a series with time a_x + b_x / B meets the reference a_s + b_s / B.

    HOW is "sooner below" (the series is sooner at every B < B*: its fewer bits pay for its extra
    compute there), "sooner above", "always sooner", "never sooner" or "equal" (B* None for the last three)."""
    (a_x, b_x), (a_s, b_s) = series_terms, reference_terms
    extra_compute, extra_bits = a_x - a_s, b_x - b_s
    if extra_compute == 0 and extra_bits == 0:
        return None, "equal"
    if extra_compute > 0 and extra_bits < 0:
        return -extra_bits / extra_compute, "sooner below"
    if extra_compute < 0 and extra_bits > 0:
        return -extra_bits / extra_compute, "sooner above"
    return (None, "always sooner") if extra_compute <= 0 and extra_bits <= 0 else (None, "never sooner")


# -------------------------------------------------------------------------------------- reading the study

def open_study(folder, global_batch=None):
    """(spec, cells at the projected global batch, that G) of the study in FOLDER (its config.yaml)."""
    if not os.path.isdir(folder):
        raise ConfigError(f"{folder}: no such study folder")
    config = os.path.join(folder, "config.yaml")
    if not os.path.isfile(config):
        raise ConfigError(f"{folder}: not a study folder (no config.yaml; crossbow-reproduce writes one)")
    experiment, sections = load_harness_config(config, None)
    if not is_study(sections.get("sweep") or {}):
        raise ConfigError(f"{config}: the sweep: section has no series: (not a crossbow-reproduce study)")
    try:
        spec = parse_study(sections["sweep"], experiment)
        cells = plan_study(spec, experiment, sections, gpus=study_gpus(folder))
    except ConfigError as e:
        raise ConfigError(f"{config}: {e}") from None
    g = max(spec.global_batches) if global_batch is None else global_batch
    if g not in spec.global_batches:
        raise ConfigError(f"--global-batch {g}: the study's global batches are {sorted(spec.global_batches)}")
    cells = [c for c in cells if c.global_batch == g and not c.series.untuned]
    multi = [c for c in cells if (c.series.workers or 1) > 1]
    if not multi:
        raise ConfigError(f"{config}: no series runs on several workers (workers: N), so there is no network to project")
    return spec, multi, g


def study_gpus(folder):
    """The GPU ids the study's machine had (its machine.json: a count or names; none without the file):
    planned with those, the cells are the study's, and no process starts TensorFlow to count this
    machine's."""
    try:
        with open(os.path.join(folder, "machine.json")) as f:
            gpus = json.load(f).get("gpus") or 0
    except (OSError, ValueError, AttributeError):
        return []
    return list(range(len(gpus) if isinstance(gpus, list) else int(gpus)))


def chosen_runs(folder, spec, cell):
    """(trial, [(summary, evaluations, results, path)], how chosen) of CELL, or None when no trial has
    finished: the study's best trial and its seeds once the search is done; before, the best trial
    finished so far (the study's own choice, stats.best_trial by epochs), marked provisional."""
    state = study_report.cell_state(folder, spec, cell)
    if state["searched"]:
        trial, runs = state["best"], state["final"]
        how = f"the study's best trial ({len([r for r in runs.values() if r])} of {len(spec.seeds)} seeds finished)"
    else:
        done = [t for t in state["trials"] if all(r is not None for r in t["runs"].values())]
        if not done:
            return None
        trial = done[best_trial([[t["runs"][s][0] for s in spec.search_seeds] for t in done], by="epochs")]
        runs = trial["runs"]
        how = f"**provisional**: best of the {len(done)} of {len(state['trials'])} search trials finished"
    found = [(*r, study_report.run_path(folder, cell, trial["label"], s)) for s, r in sorted(runs.items()) if r]
    return trial, found, how


def loopback_ms_per_byte(raw):
    """Median over the engine's runs of the measured all-reduce time per byte sent at loopback (ms), from
    the series that synchronise every iteration (all engine series when none does); None without any."""
    def rates(every_iteration_only):
        return [r[2]["cross_worker"]["collective_ms_per_iteration"] / r[2]["cross_worker"]["bytes_per_iteration"]
                for _, runs, _, rule in raw.values() for r in runs
                if r[2]["cross_worker"].get("collective_ms_per_iteration") is not None
                and r[2]["cross_worker"]["bytes_per_iteration"]
                and (rule.synchronises_every_iteration or not every_iteration_only)]
    found = rates(True) or rates(False)
    return statistics.median(found) if found else None


def schedule_words(rule):
    period, after = rule.sync_period, getattr(rule, "local_after_epochs", None)
    then = "every iteration" if period == 1 else f"once every {period} iterations"
    return f"every iteration for the first {after} epoch(s), then {then}" if after else then


def series_inputs(folder, cell, spec, chosen, rule, per_byte_ms):
    """Inputs of CELL from its CHOSEN runs (files named relative to the study's FOLDER). PER_BYTE_MS: the
    loopback transfer rate that turns a stock step (compute and transfer, not timed apart) into its compute."""
    trial, runs, how = chosen
    over = over_seeds([r[0] for r in runs], len(runs))
    cross = [r[2]["cross_worker"] for r in runs]
    epochs = over["epochs"][0]
    iterations_per_epoch = int(statistics.median(r[2]["iterations_per_epoch"] for r in runs))
    reached = epochs is not None
    effective = epochs if reached else spec.epochs
    step = statistics.median(c["step_ms_per_iteration"] for c in cross)
    measured = [c["compute_ms_per_iteration"] for c in cross if c.get("compute_ms_per_iteration") is not None]
    if measured:
        compute, source = statistics.median(measured), "measured (step minus the timed all-reduce)"
    elif per_byte_ms is not None:
        transfer = statistics.median(c["bytes_per_iteration"] for c in cross) * per_byte_ms
        compute = max(step - transfer, 0.0)
        source = (f"estimated: its step {step:.1f} ms minus {transfer:.1f} ms of loopback transfer at the engine "
                  f"series' measured {per_byte_ms * 1e6:.2f} ms/MB (its all-reduce is not timed apart)")
    else:
        compute, source = step, "its whole step (all-reduce not timed apart, no engine series to estimate it)"
    iterations = int(round(effective * iterations_per_epoch))
    return Inputs(
        name=cell.series.name, method=cell.series.method, trial=trial["label"],
        setting=describe(trial["point"]) if trial["point"] else "fixed",
        choice=how, runs=len(runs), reached=over["reached"], epochs=effective,
        reached_target=reached, iterations_per_epoch=iterations_per_epoch, workers=cross[0]["workers"],
        compute_ms=compute, compute_source=source, step_ms=step,
        payload_bytes=statistics.median(c["payload_bytes"] for c in cross),
        syncs=sum(rule.synchronises(t, iterations_per_epoch) for t in range(iterations)),
        schedule=schedule_words(rule), measured_tta=over["tta"][0],
        files=tuple(os.path.relpath(r[3], folder) for r in runs))


def rule_of(results):
    """The update rule a run trained with (TensorFlow-free): its synchronisation schedule."""
    return make_rule(types.SimpleNamespace(**results["config"]["algorithm"]))


CROSS_WORKER_KEYS = ("workers", "payload_bytes", "bytes_per_iteration", "step_ms_per_iteration")


def projectable(results):
    """Whether a run's results hold what the projection reads: a multi-worker run's cross_worker figures,
    its iterations per epoch and a rule that can be rebuilt (older or foreign files may lack them)."""
    cross = results.get("cross_worker")
    if not isinstance(cross, dict) or any(cross.get(k) is None for k in CROSS_WORKER_KEYS):
        return False
    if not results.get("iterations_per_epoch"):
        return False
    try:
        rule_of(results)
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
    return True


def read_study(folder, spec, cells):
    """(Inputs per series with finished runs, in the config's order; names of series with none)."""
    raw, missing = {}, []
    for cell in cells:
        chosen = chosen_runs(folder, spec, cell)
        usable = chosen and [r for r in chosen[1] if projectable(r[2])]
        if not usable:
            missing.append(cell.series.name)
            continue
        raw[cell.series.name] = (cell, usable, chosen, rule_of(usable[0][2]))
    per_byte = loopback_ms_per_byte({n: found for n, found in raw.items() if found[0].series.method != "tf_ssgd"})
    inputs = [series_inputs(folder, cell, spec, (chosen[0], runs, chosen[2]), rule, per_byte)
              for cell, runs, chosen, rule in raw.values()]
    return inputs, missing, per_byte


def reference_series(inputs):
    """The tuned S-SGD series the others are compared with: the stock baseline's series with the fewest
    median epochs to target (then the shortest measured time); None when the study has none yet."""
    stock = [i for i in inputs if i.method == "tf_ssgd"]
    return min(stock, key=lambda i: (not i.reached_target, i.epochs, i.measured_tta or math.inf)) if stock else None


# --------------------------------------------------------------------------------- the measured limits

_RATE = re.compile(r"^net-(\d+(?:\.\d+)?)([kmg]?)bit")


def limit_bits_per_second(folder_name):
    """tc's rate in a limits folder's name (net-1gbit, net-100mbit...) in bit/s (tc's k, m, g are 10^3,
    10^6, 10^9); None when the name holds no rate."""
    m = _RATE.match(folder_name)
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] if m else None


def limit_runs(folder, spec, cell, trial):
    """{limit folder name: [(summary, evaluations, results, path)]} of the runs of CELL's TRIAL (its label)
    behind the study's limits (sweep.network_limits; the limits phase's files, found as the report
    finds them); a run counts only where its results say it ran behind that limit (the runner's
    "network")."""
    found = {}
    for limit in spec.network_limits:
        runs = []
        for seed in spec.seeds:
            path = across_workers.limit_run_path(folder, cell, limit, trial, seed)
            run = study_report.load_run(path, spec.target)
            if run is not None and projectable(run[2]) and run[2].get("network") == limit.text():
                runs.append((*run, path))
        if runs:
            found[os.path.basename(os.path.dirname(path))] = runs
    return found


def relative_error(projected, measured):
    return None if projected is None or not measured else (projected - measured) / measured


@dataclasses.dataclass(frozen=True)
class LimitCheck:
    """One series behind one real limit: the projection at its measured workers against the runs."""
    name: str
    limit: str                  # tc's rate as the folder names it: 1gbit, 100mbit
    bits_per_second: float
    projected_step_ms: float
    measured_step_ms: float
    projected_tta: float        # None when the series did not reach the target on loopback
    measured_tta: float         # median; None when most runs did not reach
    measured_epochs: float
    reached: int
    runs: int
    files: tuple


def limit_checks(folder, spec, cells, inputs, alpha):
    """[LimitCheck] for every series and real limit the study measured, in the config's order."""
    by_name = {i.name: i for i in inputs}
    checks = []
    for cell in cells:
        i = by_name.get(cell.series.name)
        for limit, runs in (limit_runs(folder, spec, cell, i.trial).items() if i else ()):
            rate = limit_bits_per_second(limit)
            if rate is None:
                continue
            per_iteration = i.compute_ms + 1000 * i.syncs / max(i.iterations, 1) * ring_seconds(
                i.payload_bytes, i.workers, rate, alpha)
            over = over_seeds([r[0] for r in runs], len(runs))
            checks.append(LimitCheck(
                name=i.name, limit=limit[len("net-"):], bits_per_second=rate, projected_step_ms=per_iteration,
                measured_step_ms=statistics.median(r[2]["cross_worker"]["step_ms_per_iteration"] for r in runs),
                projected_tta=projected_time(i, i.workers, rate, alpha) if i.reached_target else None,
                measured_tta=over["tta"][0], measured_epochs=over["epochs"][0], reached=over["reached"], runs=len(runs),
                files=tuple(os.path.relpath(r[3], folder) for r in runs)))
    return checks


def check_rows(checks):
    return [[c.name, c.limit, fmt(c.projected_step_ms, 1), fmt(c.measured_step_ms, 1),
             percent(relative_error(c.projected_step_ms, c.measured_step_ms)),
             fmt(c.projected_tta, 0) if c.projected_tta is not None else "not reached on loopback",
             fmt(c.measured_tta, 0) if c.measured_tta is not None else f"not reached ({c.reached}/{c.runs})",
             percent(relative_error(c.projected_tta, c.measured_tta)),
             fmt(c.measured_epochs, None) if c.measured_epochs is not None else "not reached",
             "<br>".join(c.files)] for c in checks]


def percent(x):
    return "–" if x is None else f"{x:+.0%}"


# ------------------------------------------------------------------------------------------- the report

def time_text(inputs, workers, rate, alpha, reference):
    """ "812 s (1.23x)": the projected time and tuned S-SGD's time over it (above 1: sooner than S-SGD);
    ">" marks a lower bound (the target not reached within the cap)."""
    t = projected_time(inputs, workers, rate, alpha)
    text = ("> " if not inputs.reached_target else "") + f"{t:,.0f} s"
    if reference is None or reference is inputs:
        return text
    ref = projected_time(reference, workers, rate, alpha)
    if inputs.reached_target and reference.reached_target:
        return text + f" ({ref / t:.2f}x)"
    if inputs.reached_target:
        return text + f" (> {ref / t:.2f}x)"
    return text + (" (S-SGD's ratio unknown)" if not reference.reached_target else f" (< {ref / t:.2f}x)")


def bandwidth_words(bits_per_second):
    """ "1 Gbit/s", "0.43 Gbit/s", "35.2 Mbit/s": three significant digits at most."""
    if bits_per_second >= GBIT / 10:
        return f"{float(f'{bits_per_second / GBIT:.3g}'):g} Gbit/s"
    return f"{float(f'{bits_per_second / 1e6:.3g}'):g} Mbit/s"


def crossover_text(inputs, reference, workers, alpha):
    """The crossover of INPUTS against tuned S-SGD at WORKERS in words (bounds when either did not reach)."""
    if inputs is reference:
        return "(the reference)"
    if not inputs.reached_target:
        return "not reached on this machine: no crossover"
    rate, how = crossover(time_terms(inputs, workers, alpha), time_terms(reference, workers, alpha))
    exact = reference.reached_target
    if how == "sooner below":
        return f"sooner below {'' if exact else 'at least '}{bandwidth_words(rate)}"
    if how == "sooner above":
        return f"sooner above {'' if exact else 'at most '}{bandwidth_words(rate)}"
    if how == "always sooner":
        return "sooner at every bandwidth"
    return ("never sooner" if exact else "unknown (S-SGD did not reach the target)") if how == "never sooner" \
        else "equal at every bandwidth"


def inputs_rows(inputs):
    return [[i.name, i.setting, i.choice, f"{i.reached}/{i.runs}",
             fmt(i.epochs, None) if i.reached_target else f"not reached (cap {i.epochs:g}: a lower bound)",
             i.iterations_per_epoch, i.workers, fmt(i.step_ms, 1), f"{fmt(i.compute_ms, 1)}: {i.compute_source}",
             f"{i.payload_bytes / 1e6:.2f}", i.schedule, i.syncs, fmt(i.measured_tta, 0),
             "<br>".join(i.files)] for i in inputs]


def formula_lines(alpha, g, workers):
    per_worker = ", ".join(f"{g / w:g} at W = {w}" for w in workers)
    return [
        "## The formula", "",
        "    T(W, B) = E * I * c * W0 / W  +  S * (2 (W - 1) / W * 8 P / B  +  2 (W - 1) * alpha)", "",
        "- E: median epochs to target over the series' chosen runs; I: iterations per epoch; c: compute "
        "milliseconds per iteration measured on W0 workers; P: one all-reduce's payload (bytes); S: the "
        "all-reduces in the E x I iterations, from the rule's own schedule; B: the bandwidth between "
        "workers (bit/s); W: the workers; alpha: the per-message latency, "
        f"{alpha * 1e6:g} us here (`--alpha-us`).",
        "- The ring all-reduce: each worker sends 2 (W - 1) / W x P bytes in 2 (W - 1) messages per all-reduce "
        "(`crossbow_tf/distribute/traffic.py`, the counter every run's `cross_worker` record uses).",
        "- **Assumed, not measured**: per-worker compute proportional to G / W at the fixed global batch G (so "
        "c x W0 / W); the epochs to target independent of W; the link used at its full rate (the measured "
        "loopback rate below says how far TensorFlow's gRPC ring on a CPU is from that); no overlap of "
        "transfer with compute; no straggler waits beyond those inside the measured c. Each worker holds G / W "
        f"examples per iteration ({per_worker}): the fewer, the more a step's fixed costs (op dispatch, the "
        "input pipeline) weigh, so the scaled compute is optimistic at large W.",
        "- Crossover against tuned S-SGD: with T = a + b / B (a = E I c W0 / W + 2 S (W - 1) alpha, "
        "b = 8 S x 2 (W - 1) / W x P), a series and S-SGD take equal times at "
        "B* = (b_x - b_s) / (a_s - a_x); where the series sends fewer bits (b_x < b_s) but computes longer "
        "(a_x > a_s: its extra epochs), it is sooner below B*: its period pays for its extra epochs there.",
        "- A series that did not reach the target within the cap is projected at the cap: a lower bound (>).", ""]


def projection_tables(inputs, reference, workers, rates, alpha):
    parts = []
    for w in workers:
        parts += [f"### {w} workers", "", markdown_table(
            ["series"] + [bandwidth_words(b) for b in rates] + ["crossover against tuned S-SGD"],
            [[i.name] + [time_text(i, w, b, alpha, reference) for b in rates]
             + [crossover_text(i, reference, w, alpha) if reference else "no tuned S-SGD series yet"]
             for i in inputs]), ""]
    return parts


def markdown(study, spec, g, inputs, missing, per_byte, checks, workers, rates, alpha):
    """projection.md's text."""
    reference = reference_series(inputs)
    loopback = (f"At loopback on this machine, the engine's all-reduce took {per_byte * 1e6:.2f} ms per MB sent "
                f"(median over its runs; {8e-6 / per_byte:.2f} Gbit/s effective)." if per_byte else
                "The all-reduce rate at loopback is not known yet: no run of the engine's series has timed it.")
    return "\n".join([
        f"# {HEADING}", "",
        f"**A projection, not a measurement**: the time to {spec.target:.0%} test accuracy of the series of "
        f"`{recorded_path(study)}` (G = {g}) on W workers joined at B, computed from what the study measured "
        "on this machine.",
        f"Generated by `python tools/project_across_workers.py --study {recorded_path(study)} --bandwidths "
        f"{' '.join(f'{b / GBIT:g}' for b in rates)} --workers {' '.join(map(str, workers))} "
        f"--alpha-us {alpha * 1e6:g}`.",
        "",
        *formula_lines(alpha, g, workers),
        "## Measured inputs", "",
        "Per series: the chosen trial's runs (medians over them), each run file named. " + loopback, "",
        markdown_table(["series", "setting", "chosen", "reached", "E (epochs)", "I", "W0", "step ms", "c (compute ms)",
                        "P (MB)", "synchronises", "S", "measured TTA (s)", "files"], inputs_rows(inputs)), "",
        *([f"No finished run yet: {', '.join(missing)}.", ""] if missing else []),
        "## Projected time to target", "",
        (f"Seconds (projected), and in brackets tuned S-SGD's projected time over the series' ({reference.name}; "
         "above 1: sooner than S-SGD)." if reference else "No tuned S-SGD series has finished a run yet."), "",
        *projection_tables(inputs, reference, workers, rates, alpha),
        "![projected time to target against bandwidth](projection.png)", "",
        "## Checked against the measured limits", "",
        *(["The projection at the measured workers against the study's runs behind real `tc` limits "
           "(runs/<series>/G<g>/net-<limit>/): ms per iteration and time to target, projected and measured, "
           "relative error (projected - measured) / measured. The projected time to target uses the loopback "
           "runs' epochs.", "",
           markdown_table(["series", "limit", "projected ms/iteration", "measured ms/iteration", "error",
                           "projected TTA (s)", "measured TTA (s)", "error", "measured epochs", "files"],
                          check_rows(checks))]
          if checks else ["Not measured yet: the study has no runs behind real limits (runs/<series>/G<g>/net-<limit>/)."]),
        ""])


def _draw_panel(ax, w, inputs, reference, checks, grid, rates, alpha):
    """One worker count: a line per series, dots at the tabled bandwidths, a cross where a series meets
    tuned S-SGD, and (on the measured worker count) hollow squares at the times measured behind real limits."""
    for n, i in enumerate(inputs):
        color = "black" if i is reference else f"C{n}"
        label = i.name + (" (tuned S-SGD)" if i is reference else "") + ("" if i.reached_target else " (cap: lower bound)")
        ax.plot([b / GBIT for b in grid], [projected_time(i, w, b, alpha) for b in grid], linewidth=1.4, color=color,
                linestyle="-" if i.reached_target else "--", label=label)
        ax.plot([b / GBIT for b in rates], [projected_time(i, w, b, alpha) for b in rates], "o", markersize=3, color=color)
        meets = crossover(time_terms(i, w, alpha), time_terms(reference, w, alpha))[0] \
            if reference is not None and i is not reference and i.reached_target else None
        if meets is not None and grid[0] <= meets <= grid[-1]:
            ax.plot([meets / GBIT], [projected_time(i, w, meets, alpha)], "x", markersize=8, color=color)
        measured = [c for c in checks if c.name == i.name and c.measured_tta is not None and i.workers == w]
        ax.plot([c.bits_per_second / GBIT for c in measured], [c.measured_tta for c in measured], "s", markersize=7,
                markerfacecolor="none", color=color, label=f"{i.name}: measured behind a tc limit" if measured else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"{w} workers")
    ax.set_xlabel("bandwidth between workers (Gbit/s)")
    ax.grid(alpha=0.3, which="both")


def draw(path, inputs, reference, checks, workers, rates, alpha):
    """projection.png: projected time to target against bandwidth, a line per series, a panel per W."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    every = list(rates) + [c.bits_per_second for c in checks]
    low, high = math.log10(min(every) / 10), math.log10(max(every) * 10)
    grid = [10 ** (low + (high - low) * j / 200) for j in range(201)]
    fig, axes = plt.subplots(1, len(workers), figsize=(4.2 * len(workers), 4.4), squeeze=False)
    for ax, w in zip(axes[0], workers, strict=True):
        _draw_panel(ax, w, inputs, reference, checks, grid, rates, alpha)
    axes[0][0].set_ylabel("projected time to target (s)")
    labelled = {}
    for ax in axes[0]:   # the measured points are on the measured worker count's panel only
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    axes[0][-1].legend(list(labelled.values()), list(labelled), fontsize=6)
    fig.suptitle("Projection, not a measurement: ring all-reduce model from this machine's measured runs "
                 "(x: crossover with tuned S-SGD)", fontsize=9)
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    finally:
        plt.close(fig)


# -------------------------------------------------------------------------------------------- the command

def positive(kind, what):
    """argparse type: a positive finite KIND (a text that is no KIND gets argparse's own "invalid" line)."""
    def convert(text):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text}")
        return value
    convert.__name__ = kind.__name__
    return convert


def parse_args(argv):
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--study", required=True, type=path_argument, help="the study's folder (crossbow-reproduce --out)")
    p.add_argument("--bandwidths", type=positive(float, "a bandwidth"), nargs="+", default=[1.0, 10.0, 100.0],
                   help="Gbit/s between workers (default 1 10 100)")
    p.add_argument("--workers", type=positive(int, "a worker count"), nargs="+", default=[2, 8, 32],
                   help="worker counts, each at least 2 (default 2 8 32)")
    p.add_argument("--alpha-us", type=float, default=50.0, help="per-message latency in microseconds (default 50)")
    p.add_argument("--global-batch", type=positive(int, "--global-batch"),
                   help="the study's global batch to project (default its largest)")
    p.add_argument("--out", type=path_argument, help="folder for projection.md and .png (default the study's folder)")
    args = p.parse_args(argv)
    if any(w < 2 for w in args.workers):
        p.error(f"--workers: every count must be at least 2 (one worker has no network), got {args.workers}")
    if not (args.alpha_us >= 0 and math.isfinite(args.alpha_us)):
        p.error(f"--alpha-us must be zero or positive, got {args.alpha_us:g}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or args.study
    rates, alpha = sorted(b * GBIT for b in args.bandwidths), args.alpha_us * 1e-6
    workers = sorted(set(args.workers))
    try:
        if os.path.exists(out) and not os.path.isdir(out):
            raise ConfigError(f"--out {out}: is a file, not a folder")
        spec, cells, g = open_study(args.study, args.global_batch)
        inputs, missing, per_byte = read_study(args.study, spec, cells)
        if not inputs:
            raise ConfigError(f"{args.study}: no finished multi-worker run yet (runs/<series>/G{g}/*.json), "
                              "nothing to project")
        check_creatable(out, out, "projection folder")
        checks = limit_checks(args.study, spec, cells, inputs, alpha)
    except CrossbowError as e:
        return fail(PROG, e)
    text = markdown(args.study, spec, g, inputs, missing, per_byte, checks, workers, rates, alpha)
    os.makedirs(out, exist_ok=True)
    atomic_write_text(os.path.join(out, "projection.md"), text)
    draw(os.path.join(out, "projection.png"), inputs, reference_series(inputs), checks, workers, rates, alpha)
    print(text[text.index("## Projected time to target"):text.index("![projected")].rstrip())
    print(f"\nwrote {os.path.join(out, 'projection.md')} and projection.png (a projection, not a measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
