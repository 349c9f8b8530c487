"""How long a reproduction study takes on W workers, from its report folder's measured run times.

    python tools/critical_path.py docs/results/lenet_fashion_mnist_cpu \
        --config configs/lenet_fashion_mnist_cpu.yaml --workers 1 2 8

Reads the folder's config.yaml, plans the study as crossbow-reproduce does (its trials in the
order of the Optuna study, crossbow_tf/compare/runner.py:study_items) and each finished run's
time from runs/**/*.json (`total_time`: training and evaluations; each process's start-up, a few
seconds, is not in it). Prints the sum of the run times (one worker), the critical path (infinitely
many workers: per cell, its longest search run, then its longest replication), and the time on W
workers when each takes the first waiting trial it may run, as the harness's workers do (a
replication only once its cell's search has finished). Each run is assumed to take on one worker
(a GPU) what it took here; the ratios are what carries over. The bench and BatchNorm phases are
not trials and are left out.
"""
import argparse
import heapq
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crossbow_tf.compare import study_report  # noqa: E402
from crossbow_tf.compare.plan import plan_study  # noqa: E402
from crossbow_tf.compare.runner import study_items  # noqa: E402
from crossbow_tf.compare.spec import load_harness_config, parse_study  # noqa: E402


def run_times(out, config=None):
    """[(item, seconds or None)] of the study in OUT (planned from CONFIG, default OUT/config.yaml),
    in the study's order."""
    experiment, sections = load_harness_config(config or os.path.join(out, "config.yaml"))
    spec = parse_study(sections["sweep"], experiment)
    cells = plan_study(spec, experiment, sections)
    items, _, by_group = study_items(spec, cells)
    best = {}
    for group, cell in by_group.items():
        state = study_report.cell_state(out, spec, cell)
        best[group] = state["best"]["label"] if state["best"] else None
    rows = []
    for item in items:
        name = f"{best[item.group]}_s{item.seed}" if item.replicate else item.key.rsplit("/", 1)[1]
        path = os.path.join(out, "runs", item.group, f"{name}.json")
        seconds = None
        if (not item.replicate or best[item.group]) and os.path.exists(path):
            with open(path) as f:
                seconds = json.load(f).get("total_time")
        rows.append((item, seconds))
    return rows


def makespan(rows, workers):
    """Wall time on WORKERS when each takes the first waiting trial whose dependencies are met."""
    waiting = list(range(len(rows)))
    search_left = {}
    for item, _ in rows:
        if not item.replicate:
            search_left[item.group] = search_left.get(item.group, 0) + 1
    running, now, free = [], 0.0, workers   # running: heap of (end time, index)
    while waiting or running:
        started = True
        while free and started:
            started = False
            for i in waiting:
                item, seconds = rows[i]
                if item.replicate and search_left[item.group]:
                    continue
                waiting.remove(i)
                heapq.heappush(running, (now + (seconds or 0.0), i))
                free -= 1
                started = True
                break
        now, i = heapq.heappop(running)
        free += 1
        if not rows[i][0].replicate:
            search_left[rows[i][0].group] -= 1
    return now


def critical_path(rows):
    groups = {}
    for item, seconds in rows:
        g = groups.setdefault(item.group, [0.0, 0.0])
        g[item.replicate] = max(g[item.replicate], seconds or 0.0)
    return max(search + replicate for search, replicate in groups.values())


def hours(seconds):
    return f"{seconds / 3600:.2f} h"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="a reproduction study's report folder")
    p.add_argument("--config", help="the study's config (default: the folder's config.yaml)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 8])
    args = p.parse_args(argv)
    rows = run_times(args.out, args.config)
    measured = [s for _, s in rows if s is not None]
    total = sum(measured)
    longest = max(measured) if measured else 0.0
    print(f"{args.out}: {len(measured)} of {len(rows)} planned runs measured (the others count as 0 s)")
    print(f"sum of run times (1 worker):            {hours(total)}")
    print(f"critical path (unlimited workers):      {hours(critical_path(rows))}  (longest run {hours(longest)})")
    for w in args.workers:
        span = makespan(rows, w)
        print(f"{w} worker(s), first claimable trial:   {hours(span)}  = sum / {total / span:.1f}"
              f"  (bound max(critical path, sum / {w}) = {hours(max(critical_path(rows), total / w))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
