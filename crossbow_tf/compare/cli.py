"""crossbow-compare --config C: time to accuracy of SMA against the baselines, as one report.

(Also python -m crossbow_tf.compare, and a checkout's python tools/compare.py.)

Reads the experiment and its ``compare:`` section (and, unless --no-sweep, its ``sweep:`` section)
from C; runs every method's search trials and then its best trial on several seeds, each run in
its own process, one at a time; writes DIR/report.md (tables), DIR/summary.json, accuracy plots
(accuracy_vs_time.png, accuracy_vs_epochs.png, sweep.png) and every run's config, log and results
under DIR/runs/. See docs/harness.md.

    crossbow-compare --config configs/lenet_mnist_cpu.yaml --out docs/results/lenet_mnist_cpu
    crossbow-compare --config configs/lenet_mnist_cpu.yaml --out /tmp/smoke --budget 1 \\
        --seeds 0 --epochs 2 --no-sweep          # a smoke test of the whole pipeline
"""
import dataclasses
import os
import sys

from crossbow_tf import cli
from crossbow_tf.compare.plan import count_compare_runs, describe, plan_compare, plan_sweep, trial_gpus
from crossbow_tf.compare.plots import plot_curves, plot_sweep
from crossbow_tf.compare import command, trials as trials_lib
from crossbow_tf.compare.report import (command_line, compare_markdown, header_markdown, load_curves, software_line,
                                        sweep_markdown, sweep_series)
from crossbow_tf.compare.runner import machine_info, run_compare, run_sweep, Runner
from crossbow_tf.compare.spec import check_data_directory, is_study, load_harness_config, parse_compare, parse_sweep
from crossbow_tf.compare.stats import compare_rows, tta_ratio
from crossbow_tf.errors import ConfigError, CrossbowError
from crossbow_tf.files import recorded_path


def parse_args(argv):
    p = cli.OneLineParser(prog="crossbow-compare", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML experiment with a compare: section")
    p.add_argument("--out", help="new report directory (default: reports/<experiment name>)")
    p.add_argument("--force", action="store_true", help="replace an existing report directory")
    p.add_argument("--resume", action="store_true",
                   help="reuse the finished runs of an existing report directory (same settings)")
    p.add_argument("--methods", nargs="+", metavar="NAME", help="only these entries of compare.methods")
    p.add_argument("--budget", type=int, help="override compare.budget (trials per method)")
    p.add_argument("--search-seeds", type=int, nargs="+", help="override compare.search_seeds")
    p.add_argument("--seeds", type=int, nargs="+", help="override compare.seeds")
    p.add_argument("--epochs", type=int, help="override the epochs cap of compare (and sweep)")
    p.add_argument("--data-dir", help="directory of the data set's files (overrides data.data_dir in every run)")
    p.add_argument("--no-sweep", action="store_true", help="skip the sweep: section")
    p.add_argument("--dry-run", action="store_true", help="validate and list the runs without running them")
    trials_lib.add_arguments(p)
    cli.add_verbose_flag(p)
    return p.parse_args(argv)


def build(args):
    """(experiment, sections, CompareSpec, compare plan, SweepSpec or None, sweep plan or None)."""
    experiment, sections = load_harness_config(args.config, args.data_dir)
    section = dict(sections["compare"])
    if not section:
        raise ConfigError(f"{args.config}: no compare: section (methods, grids, seeds) to run")
    check_data_directory(experiment, args.config)
    for key, value in (("budget", args.budget), ("search_seeds", args.search_seeds), ("seeds", args.seeds),
                       ("epochs", args.epochs)):
        if value is not None:
            section[key] = value
    if args.methods:
        methods = section.get("methods") or {}
        unknown = [m for m in args.methods if not isinstance(methods, dict) or m not in methods]
        if unknown:
            raise ConfigError(f"--methods: {unknown[0]!r} is not an entry of compare.methods "
                              f"({', '.join(methods) if isinstance(methods, dict) else 'none'})")
        section["methods"] = {m: methods[m] for m in args.methods}
    overridden = any(v is not None for v in (args.budget, args.search_seeds, args.seeds, args.epochs, args.methods))
    where = f"{args.config} (with command-line overrides)" if overridden else args.config
    sweeps = sections["sweep"] and not args.no_sweep
    gpus = trial_gpus(args.parallel, args.gpus_per_trial) if sweeps else None
    try:
        spec = parse_compare(section, experiment)
        plan = plan_compare(spec, experiment, sections)
        sweep_spec = sweep_plan = None
        if sweeps:
            if is_study(sections["sweep"]):
                raise ConfigError("the sweep: section is a study (series:): run it with crossbow-reproduce, "
                                  "or pass --no-sweep")
            sweep_section = dict(sections["sweep"], **({"epochs": args.epochs} if args.epochs else {}))
            sweep_spec = parse_sweep(sweep_section, experiment)
            sweep_plan = plan_sweep(sweep_spec, experiment, sections, gpus=gpus)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return experiment, sections, spec, plan, sweep_spec, sweep_plan


def main(argv=None):
    """The entry point (crossbow-compare, python -m crossbow_tf.compare): the exit code."""
    return command.entry_point("compare", compare, argv)


def _dry_run_listing(plan, sweep_plan, total):
    for entry, trials in plan:
        for label, point, _ in trials:
            yield f"{entry.name} ({entry.method}) {label}: {describe(dict(entry.fixed, **point))}"
    for series, g, label, point, _ in sweep_plan or []:
        yield f"sweep {series} global batch {g} {label}: {describe(point)}"
    yield f"{total} runs (at most)"


def _run_all(spec, plan, sweep_spec, sweep_plan, runner, total):
    """(compare outcome, sweep result or None, whether both studies are complete): the compare runs,
    then the sweep's in a study of their own that counts on from the compare's."""
    outcome = run_compare(spec, plan, runner)
    complete = runner.study.complete()
    sweep_result = None
    if sweep_plan:
        sweep_study = dataclasses.replace(runner.trials, name=runner.trials.name + ":sweep")
        sweep_runner = Runner(runner.out_dir, total, resume=True, trials=sweep_study)
        sweep_runner.done = runner.done
        sweep_result = run_sweep(sweep_spec, sweep_plan, sweep_runner)
        complete = complete and sweep_runner.study.complete()
    return outcome, sweep_result, complete


def _write_report(args, out, experiment, machine, spec, outcome, sweep_spec, sweep_result):
    """Writes OUT's report, summary and plots: the failed run records."""
    rows = compare_rows(spec, outcome)
    curves = {name: load_curves(o["final"]) for name, o in outcome.items()}
    plot_curves(curves, spec.target, os.path.join(out, "accuracy_vs_time.png"),
                os.path.join(out, "accuracy_vs_epochs.png"))
    records = [r for o in outcome.values() for r in o["runs"].values()]
    parts = [header_markdown(f"Time to accuracy: {experiment.get('name', '')}", command_line(),
                             machine, args.config),
             software_line(records),
             f"- finished: {machine_info()['date']}",
             "", "## Time to accuracy", "", compare_markdown(spec, rows, outcome), "",
             "![accuracy against time](accuracy_vs_time.png)", "",
             "![accuracy against epochs](accuracy_vs_epochs.png)"]
    summary = dict(machine=machine, command=command_line(), spec=spec, rows=rows,
                   tta_ratio=dict(zip(("ratio", "sma", "baseline"), tta_ratio(rows))))
    if sweep_result is not None:
        plot_sweep(sweep_series(sweep_spec, sweep_result), sweep_spec.epochs, sweep_spec.target,
                   os.path.join(out, "sweep.png"))
        parts += ["", "## Statistical efficiency", "", sweep_markdown(sweep_spec, sweep_result), "",
                  "![epochs to target against global batch](sweep.png)"]
        summary["sweep"] = {series: [dict(global_batch=g, epochs_to_target=e, best=p) for g, e, p, _ in points]
                            for series, points in sweep_result.items()}
        records += [r for points in sweep_result.values() for *_, recs in points for r in recs]
    failed = [r for r in records if r.summary is None]
    command.write_report(out, parts + command.failed_runs_lines(failed, out), summary)
    return rows, failed


def compare(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cli.quiet_tensorflow(args.verbose)   # the training processes inherit it
    try:
        experiment, sections, spec, plan, sweep_spec, sweep_plan = build(args)
        # Relative to this folder: the runs are given (and so record) paths that name no machine's folders.
        out = recorded_path(args.out) or os.path.join("reports", experiment.get("name", "experiment"))
        total = count_compare_runs(spec, plan) + (
            len(sweep_plan) * len(sweep_spec.seeds) if sweep_plan else 0)
        if args.dry_run:
            return command.dry_run(args, out, _dry_run_listing(plan, sweep_plan, total))
        study = command.open_named_study(args, out)
    except (CrossbowError, OSError) as e:   # OSError: the report directory cannot be made
        return command.refused("compare", e)

    try:
        machine, runner, (outcome, sweep_result, _) = command.run_to_report(
            "compare", args, out, study, total, f"compare: {len(plan)} methods, {total} runs, report in {out}",
            lambda runner: _run_all(spec, plan, sweep_spec, sweep_plan, runner, total),
            lambda runner, result: result[2])
    except command.Finished as done:
        return done.code
    rows, failed = _write_report(args, out, experiment, machine, spec, outcome, sweep_spec, sweep_result)
    runner.say("\n" + compare_markdown(spec, rows, outcome).split("### Search trials")[0].strip())
    runner.say(f"\nreport: {os.path.join(out, 'report.md')}")
    return command.exit_code("compare", failed)



if __name__ == "__main__":
    sys.exit(main())
