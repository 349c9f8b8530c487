"""Statistics: one run's summary from its results file, statistics over seeds, the best trial,
the comparison's rows and its TTA ratio. Pure functions; nothing here imports TensorFlow."""
import math
import statistics

from crossbow_tf.compare.plan import describe
from crossbow_tf.results import time_to_target  # noqa: F401  (the one TTA rule, used here and by tests)


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
        cross_worker=results.get("cross_worker"),   # a multi-worker run's per-iteration figures
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


def best_trial(trials, by="tta"):
    """Index of the best of TRIALS (each a list of per-seed summaries; None entries are failed runs).

    BY "tta": lowest median time to target; BY "epochs": fewest median epochs to target, then time.
    Trials that never reach rank after those that do, by median best accuracy.
    """
    def key(i):
        ok = [summary for summary in trials[i] if summary is not None]
        if not ok:
            return (2, 0, 0, 0)
        tta = seed_statistics([summary["tta"] for summary in ok])[0]
        epochs = seed_statistics([summary["epochs_to_target"] for summary in ok])[0]
        acc = statistics.median([summary["best_accuracy"] or 0.0 for summary in ok])
        if tta is None:
            return (1, -acc, 0, 0)
        return (0, epochs, tta, -acc) if by == "epochs" else (0, tta, epochs, -acc)
    return min(range(len(trials)), key=key) if trials else None


def compare_rows(spec, outcome):
    """Per entry: its statistics over the final seeds (a dict), in entry order."""
    rows = []
    for name, o in outcome.items():
        ok = [r.summary for r in o["final"] if r.summary is not None]
        rows.append(dict(
            name=name, method=o["entry"].method, best=describe(o["best_point"]), trials=len(o["trials"]),
            seeds=len(o["final"]), failed=sum(r.summary is None for r in o["final"]),
            reached=sum(summary["reached"] for summary in ok),
            epochs=seed_statistics([summary["epochs_to_target"] for summary in ok]),
            tta=seed_statistics([summary["tta"] for summary in ok]),
            images_per_second=seed_statistics([summary["images_per_second"] for summary in ok]),
            best_accuracy=seed_statistics([summary["best_accuracy"] for summary in ok]),
            trace_time=seed_statistics([summary["trace_time"] for summary in ok]),
            epoch_start_wait=seed_statistics([summary["epoch_start_wait"] for summary in ok])
            if any(summary["epoch_start_wait"] is not None for summary in ok) else (None, None, None),
            global_batch=ok[0]["global_batch"] if ok else None,
            cross_worker=cross_worker_statistics([summary.get("cross_worker") for summary in ok])))
    return rows


CROSS_WORKER_FIGURES = ("step_ms_per_iteration", "compute_ms_per_iteration", "collective_ms_per_iteration",
                        "bytes_per_iteration")


def over_seeds(summaries, planned):
    """What a report says of one setting's finished runs (SUMMARIES) out of PLANNED seeds: how many
    finished and reached, and the median [range] of epochs to target, TTA and best accuracy."""
    return dict(seeds=len(summaries), of=planned, complete=len(summaries) == planned,
                reached=sum(summary["reached"] for summary in summaries),
                epochs=seed_statistics([summary["epochs_to_target"] for summary in summaries]),
                tta=seed_statistics([summary["tta"] for summary in summaries]),
                best_accuracy=seed_statistics([summary["best_accuracy"] for summary in summaries
                                               if summary["best_accuracy"] is not None]))


def cross_worker_statistics(figures):
    """{workers, and per figure of CROSS_WORKER_FIGURES its seed_statistics} over the seeds' runs'
    ``cross_worker`` records (None when no run has one: a single-worker entry)."""
    figures = [f for f in figures if f]
    if not figures:
        return None
    out = dict(workers=figures[0]["workers"])
    for key in CROSS_WORKER_FIGURES:
        values = [f.get(key) for f in figures]
        out[key] = seed_statistics(values) if all(v is not None for v in values) else (None, None, None)
    return out


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
