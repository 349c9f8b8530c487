"""The comparison's and the sweep's reports: Markdown tables, the header, summary.json. Nothing here
imports TensorFlow."""
import dataclasses
import json
import os
import shutil
import sys

from crossbow_tf.compare.plan import describe
from crossbow_tf.compare.stats import seed_statistics, tta_ratio
from crossbow_tf.files import atomic_write_text, recorded_path


def fmt(x, digits=2):
    """X with DIGITS decimals; DIGITS None: as short as exact (a median of epochs may be 3.5)."""
    if x is None:
        return "–"
    return f"{x:g}" if digits is None else f"{x:.{digits}f}"


def fmt_stat(stat, digits=2, missing="–"):
    """ "median [min–max]"; MISSING when there is no value (e.g. "not reached" for times to target)."""
    med, lo, hi = stat
    if med is None and lo is None:
        return missing
    return (f"{fmt(med, digits) if med is not None else missing} "
            f"[{fmt(lo, digits)}–{fmt(hi, digits) if hi is not None else 'n/r'}]")


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def load_curves(records):
    """[(seed, evaluations)] of the successful RECORDS."""
    out = []
    for r in records:
        if r.summary is not None:
            with open(r.path) as f:
                out.append((r.seed, json.load(f)["evaluations"]))
    return out


def ratio_line(rows, target):
    """The report's sentence on the TTA ratio of the best SMA entry to the best baseline of ROWS
    (compare_rows), or why there is none: which side did not reach TARGET (a median time to target
    needs the target reached in more than half of the seeds), or which side was not compared."""
    ratio, sma, base = tta_ratio(rows)
    if ratio is not None:
        return (f"**TTA ratio SMA / best baseline = {ratio:.2f}** ({sma} against {base}; "
                f"below 1 means SMA reaches {target:.0%} sooner).")
    goal = f"{target:.0%} in more than half of its seeds"
    if not any(r["method"] == "sma" for r in rows):
        why = ["no SMA entry was compared"]
    else:
        why = [f"SMA did not reach {goal}" if sma is None else f"{sma} reached {target:.0%}"]
    if not any(r["method"] != "sma" for r in rows):
        why.append("no baseline was compared")
    else:
        why.append(f"no baseline reached {goal}" if base is None else f"{base} reached {target:.0%}")
    return f"TTA ratio SMA / best baseline: not available ({'; '.join(why)})."


def compare_markdown(spec, rows, outcome):
    headers = ["method", "best of trials", "global batch", "seeds reached", "epochs to target",
               "TTA (s)", "images/s", "best accuracy", "trace (s)", "epoch-start wait (s)"]
    table = markdown_table(headers, [
        [r["name"] + ("" if r["name"] == r["method"] else f" ({r['method']})"), f"{r['best']} ({r['trials']} tried)",
         r["global_batch"] if r["global_batch"] is not None else "–", f"{r['reached']}/{r['seeds']}",
         fmt_stat(r["epochs"], None, "not reached"), fmt_stat(r["tta"], 2, "not reached"), fmt_stat(r["images_per_second"], 0),
         fmt_stat(r["best_accuracy"], 4), fmt_stat(r["trace_time"]), fmt_stat(r["epoch_start_wait"])]
        for r in rows])
    ratio_text = ratio_line(rows, spec.target)
    trials = []
    for name, o in outcome.items():
        for label, point, _ in o["trials"]:
            for seed in spec.search_seeds:
                r = o["runs"][(label, seed)]
                summary = r.summary
                trials.append([name, label + (" **best**" if label == o["best"] else ""), describe(point), seed,
                               f"{r.load_before[0]:.1f}" if r.load_before else "–",
                               "failed: " + (r.error or "") if summary is None else
                               (f"{summary['tta']:.2f}" if summary["reached"] else "not reached"),
                               "–" if summary is None or not summary["reached"] else summary["epochs_to_target"],
                               "–" if summary is None else f"{summary['best_accuracy']:.4f}"])
    across = cross_worker_markdown(rows)
    return "\n\n".join([
        f"Target: {spec.target:.0%} test accuracy, at most {spec.epochs} epochs per run. Each method: "
        f"at most {spec.budget} trial(s) from its grid on search seed(s) {spec.search_seeds}; the best trial "
        f"(lowest median time to target) then ran on seeds {spec.seeds}. Cells: median [min–max] over those "
        "seeds (n/r: some seed did not reach the target). TTA counts training time only (evaluation "
        "excluded; tracing included once, however often a run was resumed, and also shown as *trace*).",
        table, ratio_text] + ([across] if across else []) + ["### Search trials",
        markdown_table(["method", "trial", "settings", "seed", "load at start", "TTA (s)", "epochs", "best accuracy"],
                       trials)])


def cross_worker_markdown(rows):
    """The table of the multi-worker entries' per-iteration figures (None when there is none)."""
    across = [r for r in rows if r.get("cross_worker")]
    if not across:
        return None
    table = markdown_table(
        ["method", "workers", "ms/iteration", "compute ms/iteration", "waiting in all-reduce ms/iteration",
         "MB sent per worker per iteration"],
        [[r["name"], r["cross_worker"]["workers"], fmt_stat(r["cross_worker"]["step_ms_per_iteration"], 1),
          fmt_stat(r["cross_worker"]["compute_ms_per_iteration"], 1),
          fmt_stat(r["cross_worker"]["collective_ms_per_iteration"], 1),
          fmt_stat(tuple(None if v is None else v / 1e6 for v in r["cross_worker"]["bytes_per_iteration"]), 3)]
         for r in across])
    return ("Across workers (per training iteration, median [min–max] over the final seeds; bytes: a ring "
            "all-reduce's 2(n-1)/n x the payload per worker; the stock baseline's from its gradients, its "
            "all-reduce not timed: –):\n\n" + table)


def sweep_markdown(spec, result):
    rows = []
    for series, name in (("ssgd", f"S-SGD ({spec.ssgd_method})"), ("sma", f"SMA (b={spec.sma_batch})")):
        for g, epochs, point, records in result[series]:
            ok = [r.summary for r in records if r.summary is not None]
            rows.append([name, g, (f"k={g // spec.sma_batch}" if series == "sma" else f"batch {g}"), describe(point),
                         "not reached" if epochs is None else f"{epochs:g}",
                         fmt(seed_statistics([summary["tta"] for summary in ok])[0]),
                         fmt(seed_statistics([summary["best_accuracy"] for summary in ok])[0], 4)])
    largest = {}
    for series in ("ssgd", "sma"):
        if result[series]:
            g, epochs, _, _ = max(result[series], key=lambda t: t[0])
            largest[series] = (g, epochs)
    notes = [f"at the largest global batch: S-SGD {_epochs_text(largest.get('ssgd'), spec.epochs)}, "
             f"SMA {_epochs_text(largest.get('sma'), spec.epochs)}."]
    return "\n\n".join([
        f"Epochs to {spec.target:.0%} test accuracy (median over seeds {spec.seeds}, at most {spec.epochs} epochs) "
        "with the best setting of each grid per point (fewest epochs).",
        markdown_table(["series", "global batch", "point", "best setting", "epochs to target", "TTA (s)",
                        "best accuracy"], rows), "Epochs to target " + notes[0]])


def _epochs_text(item, cap):
    if item is None:
        return "not run"
    g, epochs = item
    return f"{'not reached in ' + str(cap) if epochs is None else f'{epochs:g}'} epochs (global batch {g})"


def sweep_series(spec, result):
    return {f"S-SGD ({spec.ssgd_method}, best lr per batch)": [(g, e) for g, e, _, _ in sorted(result["ssgd"])],
            f"SMA (b={spec.sma_batch}, k learners)": [(g, e) for g, e, _, _ in sorted(result["sma"])]}


def header_markdown(title, command, machine, config_path):
    load = machine["load_average"]
    return "\n".join([
        f"# {title}", "",
        f"- command: `{command}`",
        f"- config: `{relative_path(config_path)}`",
        f"- machine: {machine['cpu']}, {machine['cpu_count']} CPU cores, {machine['platform']}, "
        f"Python {machine['python']}",
        f"- started: {machine['date']}" + (f", load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
                                           if load else ""),
        "- every run is its own process, one at a time; per-run logs, configs and results are under `runs/`.",
        "- fairness choices: see docs/harness.md."])


def software_line(records):
    for r in records:
        if r.summary is not None:
            with open(r.path) as f:
                env = json.load(f).get("environment", {})
            return f"- software: TensorFlow {env.get('tensorflow')}, Keras {env.get('keras')}"
    return "- software: (no run finished)"


def write_json(path, data):
    atomic_write_text(path, json.dumps(
        data, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)))


def command_line():
    """This process's command as one would type it again, its script's path relative to this folder."""
    script = os.path.abspath(sys.argv[0])
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # crossbow_tf/
    if script.endswith(".py") and script.startswith(package + os.sep):   # python -m crossbow_tf....
        module = os.path.relpath(script[:-3], os.path.dirname(package)).replace(os.sep, ".")
        head = ["python", "-m", module[:-len(".__main__")] if module.endswith(".__main__") else module]
    elif script.endswith(".py"):   # a checkout's tools/compare.py, as old reports name it
        head = ["python", os.path.relpath(script)]
    else:   # an installed entry point: crossbow-compare
        head = [os.path.basename(script)]
    return " ".join(head + [relative_path(a) for a in sys.argv[1:]])


def relative_path(argument):
    """ARGUMENT with an absolute path (alone, or after ``--flag=``) made relative to this folder, so
    that a recorded command names no machine's folders: /work/x/docs/out, run in /work/x, is docs/out;
    the interpreter running the command (or CROSSBOW_RUN_PYTHON, the runs') is ``python``."""
    flag, eq, value = argument.partition("=") if argument.startswith("--") else ("", "", argument)
    if not os.path.isabs(value):
        return argument
    if value in (sys.executable, os.environ.get("CROSSBOW_RUN_PYTHON")):   # a venv's interpreter, where it lives
        return flag + eq + "python"
    return flag + eq + recorded_path(value)


def copy_config(src, out_dir):
    shutil.copyfile(src, os.path.join(out_dir, "config.yaml"))


def check_report_dir(path, force=False, resume=False):
    """What runner.prepare_out_dir would refuse about report directory PATH, checked without making
    or emptying anything (--dry-run): a CrossbowError with prepare_out_dir's line."""
    from crossbow_tf.compare.runner import MARKER
    from crossbow_tf.errors import CrossbowError
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise CrossbowError(f"{path}: exists and is not a directory")
    if not (force or resume):
        raise CrossbowError(f"{path}: report directory exists; choose another --out, "
                            "or pass --resume to reuse its finished runs or --force to replace it")
    if os.listdir(path) and not os.path.exists(os.path.join(path, MARKER)):
        raise CrossbowError(f"{path}: not a report directory made by these tools; refusing to touch it")

