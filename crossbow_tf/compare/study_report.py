"""The reproduction study's report, built from the files in its directory alone (so a partial or
resumed study reports what has finished): tables, plots and the verdict of crossbow-reproduce."""
import dataclasses
import glob
import json
import os

from crossbow_tf.compare import across_workers, plan, plots
from crossbow_tf.compare.plan import describe
from crossbow_tf.compare.report import fmt, fmt_stat, markdown_table, relative_path, write_json
from crossbow_tf.compare.runner import machine_info
from crossbow_tf.compare.stats import best_trial, over_seeds, run_summary, seed_statistics
from crossbow_tf.results import format_problems


NEAR_SMALL_BATCH = 1.5      # "SMA's epochs stay near small-batch training": within this factor
ABOUT_ONE_MODEL = 0.8       # "k learners cost about one model at k*b": at least this images/s ratio
# The paper's smallest TTA gain, also issue 29's threshold across workers: one number, in across_workers.
CLAIMED_SPEEDUP = across_workers.CLAIMED_SPEEDUP


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The study's machine as its report words it: from machine.json, else from its runs' results."""
    cpu: str = None
    cores: int = None
    gpus: int = 0
    gpu_names: tuple = ()
    load: float = None         # the 1-minute load average when the study started

    @property
    def devices(self):
        """ "this CPU" or "these 8 GPUs": what the verdict was measured on."""
        return "this CPU" if not self.gpus else f"these {self.gpus} GPU{'s' if self.gpus > 1 else ''}"

    def described(self):
        """ "AMD EPYC, 2 CPU cores" or "8 x GPU (A100), 64 CPU cores"."""
        cores = f"{self.cores} CPU cores" if self.cores else "CPU cores unknown"
        gpus = f"{self.gpus} x GPU" + (f" ({', '.join(self.gpu_names)})" if self.gpu_names else "") + ", "
        return (gpus if self.gpus else "") + (f"{self.cpu}, " if self.cpu and not self.gpus else "") + cores

    def load_words(self):
        """ ", load average 6.46 when the study started" (how busy the machine was), or ""."""
        return f", load average {self.load:.2f} when the study started" if self.load is not None else ""


def hardware(machine, runs=()):
    """Hardware of MACHINE (machine.json) and RUNS (results mappings): machine.json's "gpus" (a count
    or a list of names) when it has one, else the most GPUs any run's TensorFlow saw."""
    gpus = machine.get("gpus")
    names = tuple(gpus) if isinstance(gpus, list) else ()
    if gpus is None:
        gpus = max((r.get("environment", {}).get("physical_gpus") or 0 for r in runs), default=0)
    load = machine.get("load_average")
    return Hardware(cpu=machine.get("cpu"), cores=machine.get("cpu_count"),
                    gpus=len(gpus) if isinstance(gpus, list) else int(gpus), gpu_names=tuple(sorted(set(names))),
                    load=load[0] if load else None)


def _devices_phrase(counts, device_type):
    """How the stock baseline's runs were placed: "one CPU device, so plain Keras", "8 GPU devices"."""
    if not counts:
        return "with one device, plain Keras"
    if counts == {1}:
        return f"this study: one {device_type} device, so plain Keras"
    return f"this study: {' or '.join(map(str, sorted(counts)))} {device_type} devices"


def fidelity(stock_devices):
    """The report's notes on the baselines; STOCK_DEVICES: how the stock baseline's runs were placed."""
    return f"""\
- **What a Keras user would run** is `tf_ssgd` (baselines/tf_ssgd.py): the model built under
  `tf.distribute.MirroredStrategy` over the devices, or with no strategy on one device
  ({stock_devices}), `model.compile` with the stock `keras.optimizers.SGD(momentum=0.9)`
  and `model.fit` fed by one `tf.data` iterator over all epochs. No crossbow engine, strategy or
  algorithm code is loaded in its process (each results file lists the crossbow modules it loaded).
  It shares with SMA's runs only the model definition and initial weights (same seed), the per-epoch
  example order (crossbow's pipeline, padding removed), the evaluation after every epoch on the whole
  test split with the clock stopped, and the results format.
- **Its tuning** is Goyal et al.'s: the base rate (the rate at batch 128) scaled linearly with G,
  ramped up over the first epoch from the unscaled rate, and the base rate searched per G with the
  same number of trials as each SMA series. `ssgd_unscaled` is the same optimizer with the batch-128
  rate at G unchanged and no warm-up: what a user who does not retune gets, a reference outside the
  verdict.
- **Where Crossbow's S-SGD differs** (`baselines/crossbow_ssgd.py`, not in this study): it runs
  through our engine with k learners of b whose gradients at z are averaged into one momentum step,
  i.e. S-SGD at batch k*b with the engine's placement and reduction instead of Keras's; the
  optimizer update is the same equation. Crossbow's paper compared against TensorFlow's own
  S-SGD, which is what `tf_ssgd` is.
- **Both sides, same TensorFlow settings**: oneDNN on (crossbow_tf sets `TF_ENABLE_ONEDNN_OPTS=1` before
  TensorFlow starts, in SMA's and the baselines' processes alike, where TensorFlow's own default
  depends on the CPU), no XLA."""


def load_run(path, target):
    """(summary, evaluations, extra) of one results file, or None when it is missing or unusable."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if format_problems(data):
        return None
    return run_summary(data, target), data["evaluations"], data


def outcome_word(summary, otherwise="n/r"):
    """How a run that did not reach the target ended: "diverged" (a NaN), "collapsed" (at chance)."""
    return "diverged" if summary["diverged"] else "collapsed" if summary["collapsed"] else otherwise


def run_path(out, cell, label, seed):
    return os.path.join(out, "runs", cell.series.name, f"G{cell.global_batch}", f"{label}_s{seed}.json")


def cell_state(out, spec, cell):
    """What has finished of CELL: its search trials, the best one, and the best one's seeds."""
    seeds = sorted(set(spec.seeds) | set(spec.search_seeds)) if cell.series.untuned else spec.search_seeds
    trials = []
    for label, point, _ in cell.trials:
        runs = {seed: load_run(run_path(out, cell, label, seed), spec.target) for seed in seeds}
        trials.append(dict(label=label, point=point, runs=runs))
    searched = all(r is not None for t in trials for r in t["runs"].values())
    state = dict(cell=cell, trials=trials, searched=searched, best=None, final={})
    if not searched:
        return state
    if cell.series.untuned:
        best = 0
    else:
        best = best_trial([[t["runs"][seed][0] for seed in spec.search_seeds] for t in trials], by="epochs")
    label = trials[best]["label"]
    state["best"] = trials[best]
    state["final"] = {seed: load_run(run_path(out, cell, label, seed), spec.target) for seed in spec.seeds}
    return state


def cell_stats(spec, state):
    """Median [range] statistics of a cell over its best trial's seeds (None when not finished)."""
    final = [r for r in state["final"].values() if r is not None]
    if not state["searched"] or not final:
        return None
    summaries = [r[0] for r in final]
    return dict(
        over_seeds(summaries, len(spec.seeds)),
        collapsed=sum(summary["collapsed"] for summary in summaries),
        diverged=sum(summary["diverged"] for summary in summaries),
        images_per_second=seed_statistics([summary["images_per_second"] for summary in summaries]),
        setting=describe(state["best"]["point"]) if state["best"]["point"] else "fixed setting")


def search_progress(spec, state):
    """ "search 2/4 done: best so far ..." for a cell whose search has not finished, else None."""
    done = [t for t in state["trials"] if all(r is not None for r in t["runs"].values())]
    if state["searched"] or not done:
        return None
    best = done[best_trial([[t["runs"][seed][0] for seed in spec.search_seeds] for t in done], by="epochs")]
    summary = best["runs"][spec.search_seeds[0]][0]
    so_far = (f"{summary['epochs_to_target']} epochs" if summary["reached"] else
              f"not reached ({outcome_word(summary, 'best acc ' + fmt(summary['best_accuracy'], 4))})")
    return f"searching, {len(done)}/{len(state['trials'])} trials done: best so far {so_far}"


def _cell_text(stats, cap, what="epochs", progress=None):
    if stats is None:
        return progress or "not run yet"
    med, lo, hi = stats[what]
    n = f"{stats['reached']}/{stats['seeds']}" + ("" if stats["complete"] else f" of {stats['of']} seeds")
    if med is None:
        best = stats["best_accuracy"][0]
        return f"not reached in {cap} ({n}; best acc {best:.4f})" if best is not None else f"not reached ({n})"
    digits = None if what == "epochs" else 1
    return f"{fmt_stat(stats[what], digits, 'n/r')} ({n})"


from baselines import METHOD_WORDS  # noqa: E402  (each engine method's rule's title, from the registry)


def _series_label(series):
    if series.method in METHOD_WORDS and series.batch_size:
        beyond = " beyond Crossbow" if series.beyond_crossbow and series.method == "sma" else ""
        return f"{series.name} ({METHOD_WORDS[series.method]}{beyond}, b={series.batch_size})"
    if series.untuned:
        return f"{series.name} ({series.method}, untuned reference)"
    return f"{series.name} ({series.method})"


def load_bench(out):
    bench = {}
    for path in sorted(glob.glob(os.path.join(out, "bench", "b*.json"))):
        with open(path) as f:
            data = json.load(f)
        for row in data["rows"]:
            bench[(row["batch_size"], row["global_batch"])] = dict(row, spread=data["spread"], rounds=data["rounds"],
                                                                  examples=data["examples"])
    return bench


INF = float("inf")


def _show_epochs(e):
    return "not reached" if e == INF else ("–" if e is None else f"{e:g}")


class _Standings:
    """The finished cells' epochs and accuracies, read by series group: the tuned S-SGD series, Crossbow's
    SMA series and every tuned series within Crossbow."""

    def __init__(self, cells, stats):
        self.stats = stats
        self.ssgd = list(dict.fromkeys(c.series.name for c in cells
                                       if c.series.method == "tf_ssgd" and not c.series.untuned))
        # The paper's claims are about Crossbow's SMA: the methods beyond it have their own verdict row.
        self.sma = list(dict.fromkeys(c.series.name for c in cells
                                      if c.series.method == "sma" and not c.series.beyond_crossbow))
        self.names = sorted({c.series.name for c in cells if not c.series.untuned and not c.series.beyond_crossbow})

    def epochs_of(self, name, g):
        stat = self.stats.get((name, g))
        if stat is None:
            return None
        return stat["epochs"][0] if stat["epochs"][0] is not None else INF

    def best(self, names, g):
        """(fewest median epochs to target, its series) among NAMES at G ((None, None): none finished)."""
        values = [(self.epochs_of(n, g), n) for n in names if self.epochs_of(n, g) is not None]
        return min(values) if values else (None, None)

    def accuracy_at_cap(self, names, g):
        """ "name median best accuracy [range]" of the series at G that have finished, best first."""
        stats = self.stats
        found = sorted(((stats[(n, g)]["best_accuracy"], n) for n in names if stats.get((n, g))
                        and stats[(n, g)]["best_accuracy"][0] is not None), reverse=True)
        return ", ".join(f"{n} {fmt_stat(a, 4)}" for a, n in found) or "–"

    def reached_ttas(self, names, g):
        """[(median TTA, series)] of NAMES at G that reached the target."""
        stats = self.stats
        return [(stats[(n, g)]["tta"][0], n) for n in names
                if stats.get((n, g)) and stats[(n, g)]["tta"][0] is not None]


def _one_point(claim, g):
    """The row of a claim that compares a small G with a large one, in a study of one G."""
    return (claim, "not measured", f"one global batch: G={g}",
            "the claim compares a small G with a large one; this study runs one (its sweep's global_batches)")


def _ssgd_growth_row(standing, small, large, cap):
    claim = "S-SGD's epochs to target grow with G (its rate tuned)"
    if small == large:
        return _one_point(claim, small)
    s_small, _ = standing.best(standing.ssgd, small)
    s_large, _ = standing.best(standing.ssgd, large)
    if s_small is None or s_large is None:
        return (claim, "not yet measured", f"G={small}: {_show_epochs(s_small)}, G={large}: {_show_epochs(s_large)}",
                "the study has not finished these points")
    return (claim, "reproduced" if s_large > s_small else "not reproduced",
            f"best S-SGD epochs: G={small}: {_show_epochs(s_small)}, G={large}: {_show_epochs(s_large)} (cap {cap})",
            "linear scaling + warm-up, base rate searched with the same budget as SMA")


def _near_small_batch_row(standing, small, large, cap):
    claim = "SMA's epochs stay near small-batch training at large G"
    if small == large:
        return _one_point(claim, small)
    ref, ref_name = standing.best(standing.names, small)
    m_large, m_name = standing.best(standing.sma, large)
    if ref is None or m_large is None:
        return (claim, "not yet measured",
                f"small-batch reference {_show_epochs(ref)}, SMA at G={large}: {_show_epochs(m_large)}",
                "points not finished")
    s_large, _ = standing.best(standing.ssgd, large)
    at_cap = (f"; best accuracy in {cap} epochs at G={large}, median [range] over seeds: SMA "
              f"{standing.accuracy_at_cap(standing.sma, large)}; S-SGD {standing.accuracy_at_cap(standing.ssgd, large)}"
              if m_large == INF else "")
    return (claim, "reproduced" if m_large <= NEAR_SMALL_BATCH * ref else "not reproduced",
            f"SMA at G={large}: {_show_epochs(m_large)} ({m_name if m_large != INF else 'no series'}); "
            f"small-batch reference (best method at G={small}): {_show_epochs(ref)} epochs ({ref_name}); S-SGD at "
            f"G={large}: {_show_epochs(s_large)}" + at_cap,
            f"'near' means at most {NEAR_SMALL_BATCH}x the reference")


def _one_model_cost_row(bench, machine, on):
    claim = "k learners of b cost about one model at k*b"
    ratios = [(row["sma"] / row["keras_global"], b, g) for (b, g), row in sorted(bench.items())]
    if not ratios:
        return (claim, "not yet measured", "–", "bench not run")
    ok = all(r >= ABOUT_ONE_MODEL for r, _, _ in ratios)
    return (claim,
            f"reproduced {on}" if ok else f"not reproduced {on}" + (
                "" if machine.gpus else "; GPU claim not testable here"),
            ", ".join(f"b={b} G={g}: {r:.2f}x" for r, b, g in ratios),
            f"'about' means at least {ABOUT_ONE_MODEL}x Keras's images/s at batch k*b; the paper's argument is "
            "about GPUs that one small batch leaves idle"
            + ("" if machine.gpus else ", and there is no GPU here"))


def _tta_points(standing, points):
    """[(G, measured S-SGD/SMA TTA ratio, projected (epochs) ratio, best S-SGD epochs, best SMA epochs)]."""
    tta = []
    for g in points:
        s_tta, m_tta = standing.reached_ttas(standing.ssgd, g), standing.reached_ttas(standing.sma, g)
        e_s, _ = standing.best(standing.ssgd, g)
        e_m, _ = standing.best(standing.sma, g)
        measured = min(s_tta)[0] / min(m_tta)[0] if s_tta and m_tta else None
        projected = (e_s / e_m if e_s not in (None, INF) and e_m not in (None, INF) else None)
        tta.append((g, measured, projected, e_s, e_m))
    return tta


def _tta_ratios_text(tta):
    return "; ".join(f"G={g}: measured S-SGD/SMA {fmt(m)}, projected (epochs ratio) {fmt(p)}"
                     for g, m, p, _, _ in tta)


def _tta_row(spec, cells, standing, tta, machine, on):
    claim = f"TTA {CLAIMED_SPEEDUP}-4x sooner than S-SGD at equal G"
    stats, large, cap = standing.stats, max(spec.global_batches), spec.epochs
    ssgd, sma = standing.ssgd, standing.sma
    have = [t for t in tta if t[1] is not None or t[2] is not None]
    large_done = all(stats.get((n, large)) and stats[(n, large)]["complete"] for n in ssgd + sma
                     if any(c.series.name == n and c.global_batch == large for c in cells))
    if large_done and standing.best(ssgd, large)[0] == INF and standing.best(sma, large)[0] == INF:
        speed = ", ".join(f"{n} {fmt(stats[(n, large)]['images_per_second'][0], 0)}"
                          for n in ssgd + sma if stats.get((n, large)))
        return (claim, f"not reproduced at G={large} {on}; no projection",
                f"at G={large} neither method reaches {spec.target:.0%} in {cap} epochs; best accuracy, median "
                f"[range]: SMA {standing.accuracy_at_cap(sma, large)}; S-SGD {standing.accuracy_at_cap(ssgd, large)}; "
                f"images/s (median): {speed}; elsewhere: {_tta_ratios_text(have) or '–'}",
                "SMA is not sooner to any accuracy when it ends lower than S-SGD at the cap and each of its "
                "epochs takes longer; an epochs ratio needs both to reach the target")
    if not large_done:
        # Decided by the largest G alone: a ratio there may be missing because a method never reached.
        return (claim, "not yet measured", _tta_ratios_text(have) or "–",
                f"the claim is about large G; G={large} has not finished")
    measured_ok = any(m is not None and m >= CLAIMED_SPEEDUP for _, m, _, _, _ in tta)
    projected_ok = any(p is not None and p >= CLAIMED_SPEEDUP for _, _, p, _, _ in tta)
    unreached = [g for g, m, p, e_s, e_m in tta if e_s == INF and e_m not in (None, INF)]
    verdict_text = (f"reproduced {on}" if measured_ok else f"not reproduced {on}") + (
        "; projected where half 2 holds: reproduced" if projected_ok or unreached else
        "; projected where half 2 holds: not reproduced")
    return (claim, verdict_text,
            _tta_ratios_text(tta) + (f"; S-SGD never reached the target at G={unreached} while SMA did"
                                     if unreached else ""),
            f"measured: median TTA of the best S-SGD over the best SMA series (training time on "
            f"{machine.described()}); projected: the epochs ratio, what TTA would be where k learners cost "
            "one model")


def verdict(spec, cells, stats, bench, machine=Hardware()):
    """([(claim, verdict, numbers, reason)], TTA points of _tta_points) from what has finished, on MACHINE
    (a Hardware)."""
    on = f"on {machine.devices}"
    points = sorted(spec.global_batches)
    small, large = points[0], points[-1]
    standing = _Standings(cells, stats)
    tta = _tta_points(standing, points)
    rows = [_ssgd_growth_row(standing, small, large, spec.epochs),
            _near_small_batch_row(standing, small, large, spec.epochs),
            _one_model_cost_row(bench, machine, on),
            _tta_row(spec, cells, standing, tta, machine, on)]
    return rows, tta


from baselines import AVERAGING_METHODS, restarts_learners  # noqa: E402  (from the rule registry)
BEYOND_CLAIM = ("an averaging method reaches the target (or a higher best accuracy within the cap) sooner than "
                "tuned S-SGD")


def final_distance(state):
    """Median over the best trial's finished seeds of the learners' mean distance to z at the last epoch."""
    values = [r[1][-1].get("learner_distance") for r in state["final"].values() if r is not None and r[1]]
    values = [v for v in values if v is not None]
    return seed_statistics(values)[0] if values else None


RESTARTED = "0: the epoch ended on a synchronisation, which restarts every learner from z"


def distance_text(method, distance, spec="{:.3f}"):
    """The distance to z as the report prints it. Local SGD's learners restart from z at every
    synchronisation, so a 0 there says when the epoch ended, not how far the learners drift."""
    if distance is None:
        return None
    return RESTARTED if restarts_learners(method) and distance == 0 else spec.format(distance)


def beyond_crossbow(spec, cells, stats, states):
    """(verdict rows, {G: table rows}) of the averaging methods against tuned S-SGD at the points
    where a method beyond Crossbow ran. A method is sooner when its median epochs to target are
    fewer than S-SGD's; where S-SGD does not reach the target, when it reaches it or ends with a
    higher median best accuracy within the cap."""
    points = sorted({c.global_batch for c in cells if c.series.beyond_crossbow})
    ssgd = list(dict.fromkeys(c.series.name for c in cells if c.series.method == "tf_ssgd" and not c.series.untuned))
    averaging = list(dict.fromkeys(c.series.name for c in cells
                                   if c.series.method in AVERAGING_METHODS and not c.series.untuned))
    series = {c.series.name: c.series for c in cells}
    rows, tables = [], {}
    for g in points:
        at = [n for n in ssgd + averaging if (n, g) in states]
        table = []
        for n in at:
            st, stat = states[(n, g)], stats.get((n, g))
            table.append([_series_label(series[n]), _cell_text(stat, spec.epochs, progress=search_progress(spec, st)),
                          fmt_stat(stat["best_accuracy"], 4) if stat else "–",
                          (distance_text(series[n].method, final_distance(st)) or "–")
                          if series[n].method != "tf_ssgd" else "",
                          stat["setting"] if stat else "–"])
        tables[g] = table
        complete = all(stats.get((n, g)) and stats[(n, g)]["complete"] for n in at)
        s_name = min((n for n in ssgd if stats.get((n, g))), default=None,
                     key=lambda n: (stats[(n, g)]["epochs"][0] or float("inf"), -(stats[(n, g)]["best_accuracy"][0] or 0)))
        if s_name is None or not complete:
            rows.append((f"{BEYOND_CLAIM} at G={g}", "not yet measured",
                         f"{sum(1 for n in at if stats.get((n, g)) and stats[(n, g)]['complete'])} of {len(at)} series "
                         "finished (searched and replicated)", "the point has not finished"))
            continue
        s_epochs, s_acc = stats[(s_name, g)]["epochs"][0], stats[(s_name, g)]["best_accuracy"][0]

        def sooner(n):
            e, a = stats[(n, g)]["epochs"][0], stats[(n, g)]["best_accuracy"][0]
            if s_epochs is not None:
                return e is not None and e < s_epochs
            return e is not None or (a is not None and a > s_acc)
        winners = [n for n in averaging if (n, g) in stats and sooner(n)]

        def said(n):
            st = stats[(n, g)]
            reach = f"{fmt_stat(st['epochs'], None, 'n/r')} epochs" if st["epochs"][0] is not None else "not reached"
            distance = distance_text(series[n].method, final_distance(states[(n, g)]), "{:.3g}")
            return (f"{n} {reach}, best acc {fmt_stat(st['best_accuracy'], 4)}"
                    + (f", distance to z {distance}" if distance is not None else "") + f" ({st['setting']})")
        rows.append((f"{BEYOND_CLAIM} at G={g}", ("yes: " + ", ".join(winners)) if winners else "no",
                     f"tuned S-SGD {said(s_name)}; " + "; ".join(said(n) for n in averaging if (n, g) in stats),
                     "epochs to target (median over seeds), or where S-SGD does not reach it in "
                     f"{spec.epochs} epochs, reaching it or a higher median best accuracy; every series had the "
                     "same search budget at this point"))
    return rows, tables


def _trial_rows(states):
    """The search trials table: one row per (series, G, trial, seed)."""
    rows = []
    for (name, g), st in states.items():
        for t in st["trials"]:
            for seed, r in t["runs"].items():
                if r is None:
                    rows.append([name, g, t["label"], describe(t["point"]), seed, "not run yet", "", "", ""])
                    continue
                summary = r[0]
                rows.append([name, g, t["label"] + (" **best**" if st["best"] is t else ""),
                             describe(t["point"]), seed,
                             summary["epochs_to_target"] if summary["reached"] else outcome_word(summary),
                             fmt(summary["best_accuracy"], 4), summary["epochs_run"], fmt(summary["tta"])])
    return rows


def _budget_line(spec, cells):
    budgets = plan.searched_budgets(cells)
    found = ", ".join(f"{n} at G={g}" for g, n in sorted({(g, n) for (_, g), n in budgets.items()}))
    return (f"Search budget: {spec.describe_budget()}, the same for every searched series "
            f"(found in the plan: {found}; "
            f"{len(budgets)} searched cells), each on search seed(s) {spec.search_seeds}; the best trial "
            f"(fewest median epochs to target, then time) ran on seeds {spec.seeds}.")


def _why_rows(states):
    """z against its learners at the last epoch of each averaging series' best trial, first seed."""
    why = []
    for (name, g), st in states.items():
        if st["cell"].series.method not in AVERAGING_METHODS or not st["final"]:
            continue
        run = next((r for r in st["final"].values() if r is not None and r[1]), None)
        if run is None:
            continue
        evals = run[1]
        last = evals[-1]
        peak = max(evals, key=lambda e: e.get("learner_accuracy") or 0)
        why.append([name, g, st["cell"].k, describe(st["best"]["point"]), len(evals),
                    f"{last['accuracy']:.4f}", fmt(last.get("learner_accuracy"), 4),
                    distance_text(st["cell"].series.method, last.get("learner_distance")) or "–",
                    fmt(peak.get("learner_accuracy"), 4),
                    outcome_word(run[0], "no")])
    return why


def _half2_rows(bench):
    return [[f"b={b}", g, g // b, f"{row['sma']:.0f}", f"{row['keras_global']:.0f}", f"{row['keras_small']:.0f}",
             f"{row['sma'] / row['keras_global']:.2f}", f"{row['sma'] / row['keras_small']:.2f}",
             f"{row['update_share']:.0%}", f"{row['spread']:.0%}"] for (b, g), row in sorted(bench.items())]


def _batchnorm_rows(out):
    """(table rows, note) of the BatchNorm run under OUT/runs/bn ([], "not run yet" before it ran)."""
    bn_files = sorted(glob.glob(os.path.join(out, "runs", "bn", "*.json")))
    if not bn_files:
        return [], "not run yet"
    with open(bn_files[0]) as f:
        bn = json.load(f)
    rows = [[e["epoch"], f"{e['accuracy']:.4f}", fmt(e.get("accuracy_bn_recomputed"), 4),
             fmt(e.get("bn_recompute_time"), 2), f"{e['epoch_time']:.1f}"] for e in bn["evaluations"]]
    diffs = [e["accuracy_bn_recomputed"] - e["accuracy"] for e in bn["evaluations"] if "accuracy_bn_recomputed" in e]
    cfg = bn["config"]
    note = (f"LeNet with BatchNorm, SMA with k={bn['num_learners']} learners of {cfg['batch_size']}, "
            f"lr {cfg['learning_rate']['base']}, alpha 1/k, {len(bn['evaluations'])} epochs, seed 0; "
            f"recomputed on {cfg['batchnorm_batches']} training batches of {cfg['eval_batch_size']}. "
            f"Recomputed minus averaged accuracy: mean {sum(diffs) / len(diffs):+.4f}, "
            f"min {min(diffs):+.4f}, max {max(diffs):+.4f}." if diffs else "")
    return rows, note


def _draw_plots(out, spec, cells, stats, states, series, where):
    """The report's plots from what has finished."""
    points = sorted(spec.global_batches)
    epochs_series = {}
    for s in series:
        pts = [(g, stats[(s.name, g)]["epochs"][0]) for g in points if stats.get((s.name, g))]
        if pts:
            epochs_series[_series_label(s)] = pts
    if epochs_series:
        plots.plot_sweep(epochs_series, spec.epochs, spec.target, os.path.join(out, "epochs_vs_G.png"))
    plots.plot_tta(stats, cells, spec, os.path.join(out, "tta_vs_G.png"), where.devices)
    plots.plot_largest(states, spec, max(points), os.path.join(out, "accuracy_vs_epochs_largest_G.png"))
    plots.plot_best_accuracy(stats, series, points, spec, os.path.join(out, "best_accuracy_vs_G.png"), _series_label)


def _beyond_section(beyond_md, beyond_rows, beyond_tables):
    """The report's lines on the methods beyond Crossbow ([] when none ran)."""
    if not beyond_rows:
        return []
    parts = [
        "## Beyond Crossbow: averaging methods whose pull is not capped by the central loop", "",
        "Crossbow's SMA couples the learners' pull alpha and the central step beta = k*alpha, and its central "
        "loop is stable only while beta < (1 + mu_z)(2 - alpha), so at large k alpha cannot pass about 3.6/k. "
        "Decoupled SMA takes Delta = beta * mean_j (s_j - z) with beta below that bound and alpha free; local "
        "SGD restarts every learner from z after each synchronisation (period H; an outer optimizer on "
        "z - mean_j w_j, DiLoCo's with outer momentum). Same budgets as every searched series.", "",
        beyond_md, ""]
    for g, table in beyond_tables.items():
        parts += [f"At G={g}:", "", markdown_table(
            ["series", "epochs to target", "best accuracy, median [range]", "learners' distance to z (last epoch)",
             "best coupling / setting"], table), ""]
    return parts + ["![best accuracy within the cap against G](best_accuracy_vs_G.png)", ""]


def _finished_runs(states):
    """Search runs plus the best trials' runs on the seeds it was not searched on, that have finished."""
    return sum(1 for st in states.values() for t in st["trials"] for r in t["runs"].values() if r is not None) + \
        sum(1 for st in states.values() for s, r in st["final"].items() if r is not None and
            (st["best"] is None or s not in st["best"]["runs"]))


def training_time(out, phase=None):
    """(runs, seconds): the finished runs under OUT/runs (the limits phase's too), or under
    OUT/runs/PHASE only, and the sum of their total_time, each run's wall time from its first step to
    its end, evaluations included."""
    times = []
    for path in glob.glob(os.path.join(out, "runs", *([phase] if phase else []), "**", "*.json"), recursive=True):
        with open(path, encoding="utf-8") as f:
            total = json.load(f).get("total_time")
        if isinstance(total, (int, float)):
            times.append(total)
    return len(times), sum(times)


def _duration_line(out):
    runs, seconds = training_time(out)
    if not runs:
        return []
    hours, minutes = divmod(round(seconds / 60), 60)
    # The BatchNorm phase's run is not one of the progress line's planned runs: say it is counted here.
    batchnorm, _ = training_time(out, "bn")
    counted = f"{runs} runs" + (f" (the BatchNorm phase's {batchnorm} included)" if batchnorm else "")
    return [f"- measured duration: {counted} trained for {hours} h {minutes:02d} min in all (the sum of each "
            "run's wall time from its first step to its end, evaluations included; process start-up and "
            "the time between runs not counted)"]


def _header_lines(out, experiment, args, machine, where, finished, planned):
    software = next((json.load(open(p)).get("environment", {}) for p in
                     glob.glob(os.path.join(out, "runs", "*", "*", "*.json"))[:1]), {})
    return [
        f"# Reproduction study: {experiment.get('name', '')}", "",
        f"- command: `{machine.get('command')}`",
        f"- config: `{relative_path(args.config)}` (copied to `config.yaml`)",
        f"- machine: {machine['cpu']}, {machine['cpu_count']} CPU cores, "
        + (f"{where.gpus} GPU(s){' (' + ', '.join(where.gpu_names) + ')' if where.gpu_names else ''}, " if where.gpus
           else "no GPU, ") + f"{machine['platform']}, Python {machine['python']}{where.load_words()}",
        f"- software: TensorFlow {software.get('tensorflow', '?')}, Keras {software.get('keras', '?')}",
        f"- started: {machine['date']}; report written {machine_info()['date']}",
        f"- progress: {finished} of {planned} training runs finished" +
        ("" if finished >= planned else " (**partial**: resume with the command above plus `--resume`)"),
        *_duration_line(out),
        "- every run is its own process, one at a time; each run's config, log and results are under `runs/`; "
        "the load average at each run's start is in its log.", ""]


def _grid_table(spec, stats, states, series, what):
    """Series against G: epochs to target (with the search's progress) or TTA per cell."""
    points = sorted(spec.global_batches)
    return markdown_table(["series"] + [f"G={g}" for g in points], [
        [_series_label(s)] + [_cell_text(stats.get((s.name, g)), spec.epochs, what,
                                         search_progress(spec, states[(s.name, g)]) if what == "epochs" else None)
                              if (s.name, g) in stats else "–" for g in points] for s in series])


def _half1_lines(spec, cells, stats, states, series):
    points = sorted(spec.global_batches)
    best_rows = [[_series_label(s)] + [(stats[(s.name, g)]["setting"] if stats.get((s.name, g)) else "–")
                                       if (s.name, g) in stats else "–" for g in points] for s in series]
    why = _why_rows(states)
    return [
        "## Half 1: statistical efficiency (epochs to target)", "",
        f"Target {spec.target:.0%} test accuracy on the whole test split, at most {spec.epochs} epochs per run. "
        + _budget_line(spec, cells) + " Cells: median [min–max] epochs over the seeds (reached/seeds); a series "
        "that does not reach shows its best accuracy. Runs at chance accuracy for 2 epochs after the first stop as "
        "collapsed; a run whose loss, learners or z became NaN or infinite stops as diverged.", "",
        _grid_table(spec, stats, states, series, "epochs"), "",
        *([f"Protocol notes (from the config): {' '.join(spec.notes)}", ""] if spec.notes else []),
        "Best setting per point:", "",
        markdown_table(["series"] + [f"G={g}" for g in points], best_rows), "",
        "![epochs to target against G](epochs_vs_G.png)", "",
        f"![accuracy against epochs at G={max(points)}](accuracy_vs_epochs_largest_G.png)", "",
        "### Why: z against its learners (SMA, best trial, first seed, last epoch)", "",
        markdown_table(["series", "G", "k", "setting", "epochs", "z accuracy", "learner 0 accuracy",
                        "mean distance to z", "best learner 0 accuracy", "collapsed or diverged"], why)
        if why else "not run yet", ""]


def _half2_and_tta_lines(spec, stats, states, series, bench, tta, where):
    half2 = _half2_rows(bench)
    tta_rows = [[g, fmt(m), fmt(p), "not reached" if e_s == INF else fmt(e_s, None),
                 "not reached" if e_m == INF else fmt(e_m, None)] for g, m, p, e_s, e_m in tta]
    return [
        f"## Half 2: hardware efficiency ({where.devices})", "",
        ("Images/s of fused SMA with k learners of b against one plain Keras model at batch k*b and at batch b, "
         "measured side by side in one process, interleaved rounds, median (tools/bench_throughput.py, "
         "random MNIST-shaped images; `bench/` holds each command and log). Update share: the SMA update's "
         "share of an iteration; spread: (max-min)/median over the rounds of the noisiest configuration "
         "of that bench run, a measure of how busy the machine was.") if half2 else "not run yet", "",
        markdown_table(["series", "G", "k", "SMA images/s", "Keras at G", "Keras at b", "SMA / Keras(G)",
                        "SMA / Keras(b)", "update share", "spread of that bench run"], half2)
        if half2 else "", "",
        "## The product: time to accuracy", "",
        f"Median training time to target (evaluation excluded) on {where.devices}, per series and point:", "",
        _grid_table(spec, stats, states, series, "tta"), "",
        "S-SGD over SMA at equal G (above 1: SMA sooner). Measured: the best S-SGD's median TTA over the best SMA "
        "series'. Projected (**a projection, not a measurement**): the ratio of epochs, which is the TTA ratio "
        "on hardware where k learners of b cost what one model at k*b costs (half 2 holding).", "",
        markdown_table(["G", "measured TTA ratio", "projected (epochs) ratio", "best S-SGD epochs",
                        "best SMA epochs"], tta_rows), "",
        "![TTA against G](tta_vs_G.png)", ""]


def _closing_lines(out, states, runs, where):
    """BatchNorm, the baselines' fidelity and the search trials."""
    bn_rows, bn_note = _batchnorm_rows(out)
    stock = [r.get("devices") or [] for r in runs if r.get("method") == "tf_ssgd"]
    stock_devices = _devices_phrase({len(d) for d in stock if d}, "GPU" if where.gpus and any(
        "GPU" in name for d in stock for name in d) else "CPU")
    return [
        "## BatchNorm: averaged against recomputed statistics", "", bn_note, "",
        markdown_table(["epoch", "z accuracy (averaged statistics)", "z accuracy (recomputed)",
                        "recompute time (s)", "epoch time (s)"], bn_rows) if bn_rows else "", "",
        "## Fidelity of the baselines", "", fidelity(stock_devices), "",
        "## Search trials", "",
        markdown_table(["series", "G", "trial", "setting", "seed", "epochs to target", "best accuracy",
                        "epochs run", "TTA (s)"], _trial_rows(states)), ""]


def _summary(machine, finished, planned, stats, rows, beyond_rows, tta, bench):
    """summary.json's content."""
    row_keys = ("claim", "verdict", "numbers", "reason")
    return dict(machine=machine, finished_runs=finished, planned_runs=planned,
                cells={f"{n}@{g}": s for (n, g), s in stats.items()},
                verdict=[dict(zip(row_keys, r)) for r in rows],
                beyond_crossbow=[dict(zip(row_keys, r)) for r in beyond_rows],
                tta=[dict(zip(("global_batch", "measured_ratio", "projected_ratio", "ssgd_epochs", "sma_epochs"),
                              (g, m, p, None if e_s == INF else e_s, None if e_m == INF else e_m)))
                     for g, m, p, e_s, e_m in tta],
                bench={f"b{b}@{g}": row for (b, g), row in bench.items()})


def build_report(out, spec, cells, experiment, args):
    """Writes OUT/report.md, OUT/summary.json and the plots from what has finished; the verdict's and the
    beyond-Crossbow section's markdown and the summary."""
    states = {(c.series.name, c.global_batch): cell_state(out, spec, c) for c in cells}
    stats = {key: cell_stats(spec, st) for key, st in states.items()}
    bench = load_bench(out)
    with open(os.path.join(out, "machine.json")) as f:
        machine = json.load(f)
    runs = [r[2] for st in states.values() for t in st["trials"] for r in t["runs"].values() if r is not None]
    where = hardware(machine, runs)
    rows, tta = verdict(spec, cells, stats, bench, where)
    series = list({c.series.name: c.series for c in cells}.values())   # in the config's order
    _draw_plots(out, spec, cells, stats, states, series, where)
    beyond_rows, beyond_tables = beyond_crossbow(spec, cells, stats, states)
    beyond_md = markdown_table(["claim", "verdict", "numbers", "how measured"], [list(r) for r in beyond_rows])
    finished, planned = _finished_runs(states), plan.count_runs(spec, cells)
    verdict_md = markdown_table(["claim of the paper", "verdict", "numbers", "how measured / why"],
                                [list(r) for r in rows])
    workers_lines, workers_summary = across_workers.across_workers(out, spec, cells, states, load_run)
    if workers_summary is not None:   # the limits phase's runs are part of the study's plan
        finished += workers_summary["limit_runs"]["finished"]
        planned += workers_summary["limit_runs"]["planned"]
    parts = [
        *_header_lines(out, experiment, args, machine, where, finished, planned),
        "## Verdict", "", verdict_md, "", *workers_lines,
        *(["Read the verdict with the protocol notes under Half 1: they say where the protocol was not "
           "what it was planned to be.", ""] if spec.notes else []),
        *_beyond_section(beyond_md, beyond_rows, beyond_tables),
        *_half1_lines(spec, cells, stats, states, series),
        *_half2_and_tta_lines(spec, stats, states, series, bench, tta, where),
        *_closing_lines(out, states, runs, where)]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(parts) + "\n")
    summary = _summary(machine, finished, planned, stats, rows, beyond_rows, tta, bench)
    if workers_summary is not None:   # a multi-worker study's (no other study's summary changes)
        summary["across_workers"] = workers_summary
    write_json(os.path.join(out, "summary.json"), summary)
    return dict(verdict_markdown=verdict_md + ("\n\n" + "\n".join(workers_lines[:-1]) if workers_lines else ""),
                beyond_markdown=beyond_md if beyond_rows else "", summary=summary)
