"""The study report's words on a multi-worker study (issue 29): whether an averaging method with a
synchronisation period reaches the target at least 1.3x sooner in wall time than tuned synchronous
SGD on the same workers, per network (loopback: the sweep's own runs; each of sweep.network_limits:
the limits phase's runs under runs/<series>/G<g>/net-<limit>/), and the figures behind it. Read
from the report directory's files alone; nothing here imports TensorFlow."""
import os

from baselines import AVERAGING_METHODS
from crossbow_tf.compare.report import fmt, markdown_table
from crossbow_tf.compare.stats import cross_worker_statistics, over_seeds

CLAIMED_SPEEDUP = 1.3     # the paper's smallest TTA gain; the threshold across workers
LOOPBACK = "loopback"


def networks(spec):
    """The report's networks in column order: loopback, then each limit as the config writes it."""
    return [LOOPBACK] + [limit.text() for limit in spec.network_limits]


def limit_run_path(out, cell, limit, label, seed):
    return os.path.join(out, "runs", cell.series.name, f"G{cell.global_batch}", f"net-{limit.label()}",
                        f"{label}_s{seed}.json")


def network_runs(out, spec, state, load):
    """{network: [loaded run (load's (summary, evaluations, data)) or None, per seed of spec.seeds]} of
    a multi-worker cell's best trial (STATE: study_report.cell_state's); {} before its search finished.
    A run counts only where its results say it ran (the runner's "network"; none on loopback)."""
    if not state["searched"]:
        return {}
    # A run of the sweep made behind CROSSBOW_NETWORK (its results say so) is not a loopback run.
    runs = {LOOPBACK: [r if r is None or "network" not in r[2] else None
                       for r in (state["final"].get(seed) for seed in spec.seeds)]}
    for limit in spec.network_limits:
        found = [load(limit_run_path(out, state["cell"], limit, state["best"]["label"], seed), spec.target)
                 for seed in spec.seeds]
        runs[limit.text()] = [r if r is not None and r[2].get("network") == limit.text() else None for r in found]
    return runs


def network_stats(runs):
    """Median [range] over the seeds' finished RUNS: TTA, epochs to target, best accuracy, and the
    cross_worker figures (ms per iteration, bytes sent per iteration); None when none finished."""
    summaries = [r[0] for r in runs if r is not None]
    if not summaries:
        return None
    across = cross_worker_statistics([summary.get("cross_worker") for summary in summaries]) or {}
    return dict(over_seeds(summaries, len(runs)),
                ms_per_iteration=across.get("step_ms_per_iteration", (None,))[0],
                mb_per_iteration=(lambda b: None if b is None else b / 1e6)(
                    across.get("bytes_per_iteration", (None,))[0]))


def _fastest(names, stats):
    """The series of NAMES with the lowest median TTA (one that never reached ranks after those that
    did, by best accuracy)."""
    def key(n):
        s = stats[n]
        return (s["tta"][0] is None, s["tta"][0] or 0.0, -(s["best_accuracy"][0] or 0.0))
    return min(names, key=key)


def judge(ssgd, averaging, stats):
    """(verdict, ratio, averaging series, S-SGD series) at one network: STATS {series: network_stats
    or None}; "not measured" until every series has finished on every seed. A series whose median
    run never reaches the target counts as never reaching it: an averaging method that reaches it
    where tuned S-SGD does not holds, one that does not reach it does not hold."""
    if not ssgd or not averaging or any(stats.get(n) is None or not stats[n]["complete"] for n in ssgd + averaging):
        return "not measured", None, None, None
    s, a = _fastest(ssgd, stats), _fastest(averaging, stats)
    s_tta, a_tta = stats[s]["tta"][0], stats[a]["tta"][0]
    if a_tta is None:
        return "does not hold", None, a, s
    if s_tta is None:
        return "holds", None, a, s
    ratio = s_tta / a_tta
    return ("holds" if ratio >= CLAIMED_SPEEDUP else "does not hold"), ratio, a, s


def _figures(name, stat, cap):
    """ "sma_2w 120.3 s, 8 epochs, 93 ms/iteration, 1.11 MB/iteration" (median over the seeds)."""
    if stat["tta"][0] is None:
        reach = f"not reached in {cap} epochs ({stat['reached']}/{stat['seeds']} seeds reached; best acc " \
                f"{fmt(stat['best_accuracy'][0], 4)})"
    else:
        reach = f"{fmt(stat['tta'][0], 1)} s, {fmt(stat['epochs'][0], None)} epochs"
    return (f"{name} {reach}, {fmt(stat['ms_per_iteration'], 0)} ms/iteration, "
            f"{fmt(stat['mb_per_iteration'], 2)} MB/iteration")


def verdict_cell(judged, stats, cap, lacking=None):
    """The verdict's cell at one network; LACKING: the side of the comparison the study has no series of."""
    verdict, ratio, a, s = judged
    if lacking:
        return f"not measured (the study has no {lacking} on these workers)"
    if verdict == "not measured":
        done = sum(1 for st in stats.values() if st is not None and st["complete"])
        return f"not measured ({done} of {len(stats)} series finished on every seed)"
    said = f"**{verdict}**" + (f" (S-SGD/averaging TTA {ratio:.2f}x)" if ratio is not None else "")
    return f"{said}: {_figures(a, stats[a], cap)}; {_figures(s, stats[s], cap)}"


def claim(spec, workers):
    return (f"an averaging method with a synchronisation period reaches {spec.target:.0%} at least "
            f"{CLAIMED_SPEEDUP}x sooner in wall time than tuned synchronous SGD on {workers} workers")


def across_workers(out, spec, cells, states, load):
    """(markdown lines, summary mapping) of a multi-worker study: the claim's verdict per network and
    the series x network figures, per global batch where multi-worker series ran."""
    multi = [c for c in cells if c.series.workers > 1]
    if not multi:
        return [], None
    workers = max(c.series.workers for c in multi)
    nets = networks(spec)
    lines, summary, table = [], dict(claim=claim(spec, workers), networks=nets, points=[]), []
    for g in sorted({c.global_batch for c in multi}):
        at = [c for c in multi if c.global_batch == g]
        ssgd = [c.series.name for c in at if c.series.method == "tf_ssgd" and not c.series.untuned]
        averaging = [c.series.name for c in at if c.series.method in AVERAGING_METHODS and not c.series.untuned]
        runs = {c.series.name: network_runs(out, spec, states[(c.series.name, g)], load) for c in at}
        stats = {net: {n: network_stats(runs[n][net]) if net in runs[n] else None for n in runs} for net in nets}
        judged = {net: judge(ssgd, averaging, stats[net]) for net in nets}
        lacking = None if ssgd and averaging else "tuned tf_ssgd series" if not ssgd else "averaging series"
        table.append([f"{claim(spec, workers)} (G={g})"] + [verdict_cell(judged[net], stats[net], spec.epochs, lacking)
                                                            for net in nets])
        summary["points"].append(dict(global_batch=g, verdicts={
            net: dict(verdict=v, ratio=r, averaging=a, ssgd=s) for net, (v, r, a, s) in judged.items()},
            series={n: {net: stats[net][n] for net in nets} for n in runs}))
        lines += _figures_table(g, runs, stats, nets, spec.epochs)
    # The limits phase's runs, for the report's progress line (limit_plan plans them for every multi-worker cell).
    summary["limit_runs"] = dict(planned=len(multi) * len(spec.network_limits) * len(spec.seeds),
                                 finished=sum(st["seeds"] for point in summary["points"]
                                              for by_net in point["series"].values()
                                              for net, st in by_net.items() if net != LOOPBACK and st))
    names = ", ".join(dict.fromkeys(c.series.name for c in multi))
    return _section(spec, workers, nets, table, series_words=names) + lines, summary


def _figures_table(g, runs, stats, nets, cap):
    rows = []
    for n in runs:
        for net in nets:
            st = stats[net][n]
            rows.append([n, net] + (["not run yet", "", "", "", ""] if st is None else [
                f"{st['reached']}/{st['seeds']}" + ("" if st["complete"] else f" of {st['of']} seeds"),
                fmt(st["tta"][0], 1) if st["tta"][0] is not None else f"not reached in {cap}",
                fmt(st["epochs"][0], None) if st["epochs"][0] is not None else "–",
                fmt(st["ms_per_iteration"], 0), fmt(st["mb_per_iteration"], 2)]))
    return [f"Across workers at G={g}, the best trial of each series on every seed, median over the seeds:", "",
            markdown_table(["series", "network", "reached/seeds", "TTA (s)", "epochs to target", "ms/iteration",
                            "MB sent/iteration"], rows), ""]


def _section(spec, workers, nets, table, series_words):
    limits = ", ".join(f"{limit.rate} with {limit.delay} delay" if limit.delayed() else limit.rate
                       for limit in spec.network_limits)
    return [f"### Across {workers} workers: a synchronisation period against tuned S-SGD, per network", "",
            f"Series: {series_words}. Each network's cell: the verdict, then the fastest averaging series' and the "
            "tuned S-SGD's median time to target over the seeds (training time, evaluation excluded), median "
            f"epochs to target, milliseconds per iteration and megabytes sent per worker per iteration. It holds "
            f"when the averaging series' median TTA is at least {CLAIMED_SPEEDUP}x shorter, or it reaches the "
            "target where S-SGD does not; a median run that never reaches the target counts as never reaching. "
            "Loopback: the sweep's runs; "
            + (f"each limit ({limits}): the limits phase's runs of the same best trials, each worker in a "
               "network namespace of its own behind a token bucket at that rate (`runs/<series>/G<g>/net-<limit>/`)."
               if spec.network_limits else "no network limits in the config (sweep.network_limits)."), "",
            markdown_table(["claim"] + nets, table), ""]
