"""The suite's CPU seconds per test file and its costliest tests, from a run with
CROSSBOW_TEST_CPU_TIMES=FILE (tests/conftest.py). CPU, unlike wall time, stays put on a busy machine:

    CROSSBOW_TEST_CPU_TIMES=/tmp/cpu.tsv python -m pytest -q -n 3 --dist loadfile
    python tools/suite_cpu.py /tmp/cpu.tsv [--top 30] [--before /tmp/cpu_before.tsv]

Module-scoped fixtures count in the first test that uses them.
"""
import argparse
import collections
import sys


def read(path):
    """{node id: (CPU seconds, wall seconds)} (a test run twice counts its last run)."""
    times = {}
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 3:
                    raise ValueError(f"{path}:{n}: expected 'node id<TAB>cpu<TAB>wall', got {line.strip()!r}")
                times[parts[0]] = (float(parts[1]), float(parts[2]))
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    return times


def per_file(times):
    files = collections.defaultdict(lambda: [0.0, 0])
    for node, (cpu, _) in times.items():
        files[node.split("::")[0]][0] += cpu
        files[node.split("::")[0]][1] += 1
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("times")
    p.add_argument("--top", type=int, default=25, help="how many files and tests to list")
    p.add_argument("--before", help="an earlier run's file: its CPU beside this one's, per file")
    args = p.parse_args(argv)
    try:
        times = read(args.times)
        before = per_file(read(args.before)) if args.before else None
    except ValueError as e:
        print(f"suite_cpu: error: {e}", file=sys.stderr)
        return 2
    files = per_file(times)
    total = sum(cpu for cpu, _ in files.values())
    head = f"{'CPU s':>8} {'tests':>5}" + (f" {'before':>8} {'ratio':>6}" if before else "") + "  file"
    print(f"{len(times)} tests, {total:.0f} CPU seconds" + (
        f" (before: {sum(c for c, _ in before.values()):.0f})" if before else ""))
    print(head)
    for name, (cpu, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:args.top]:
        old = before.get(name, (0.0, 0))[0] if before else None
        extra = f" {old:8.1f} {cpu / old if old else float('nan'):6.2f}" if before else ""
        print(f"{cpu:8.1f} {n:5d}{extra}  {name}")
    print(f"\nthe {args.top} costliest tests (CPU s, wall s):")
    for node, (cpu, wall) in sorted(times.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{cpu:8.1f} {wall:8.1f}  {node}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
