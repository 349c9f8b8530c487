"""crossbow-sweep --config C: statistical efficiency, epochs to target against the global batch.

(Also python -m crossbow_tf.compare.sweep, and a checkout's python tools/sweep.py.)

S-SGD at each global batch of sweep.ssgd.global_batches (its best learning rate of sweep.ssgd.grid
per batch) and SMA with k learners of a fixed per-learner batch b for each k of sweep.sma.learners
(best of sweep.sma.grid per k). Each run is its own process, one at a time. Writes DIR/report.md,
DIR/summary.json, DIR/sweep.png and every run's files under DIR/runs/. See docs/harness.md.

    crossbow-sweep --config configs/lenet_mnist_cpu.yaml --out /tmp/sweep
    crossbow-sweep --config configs/lenet_mnist_cpu.yaml --out /tmp/sweep --global-batches 64 256 \\
        --learners 4 16 --epochs 5
"""
import os
import sys

from crossbow_tf import cli
from crossbow_tf.compare.plan import describe, plan_sweep, trial_gpus
from crossbow_tf.compare.plots import plot_sweep
from crossbow_tf.compare import command, trials as trials_lib
from crossbow_tf.compare.report import command_line, header_markdown, software_line, sweep_markdown, sweep_series
from crossbow_tf.compare.runner import machine_info, run_sweep
from crossbow_tf.compare.spec import check_data_directory, is_study, load_harness_config, parse_sweep
from crossbow_tf.errors import ConfigError, CrossbowError
from crossbow_tf.files import recorded_path


def parse_args(argv):
    p = cli.OneLineParser(prog="crossbow-sweep", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML experiment with a sweep: section")
    p.add_argument("--out", help="new report directory (default: reports/<experiment name>-sweep)")
    p.add_argument("--force", action="store_true", help="replace an existing report directory")
    p.add_argument("--resume", action="store_true", help="reuse the finished runs of an existing report directory")
    p.add_argument("--global-batches", type=int, nargs="+", help="override sweep.ssgd.global_batches")
    p.add_argument("--learners", type=int, nargs="+", help="override sweep.sma.learners (k)")
    p.add_argument("--seeds", type=int, nargs="+", help="override sweep.seeds")
    p.add_argument("--epochs", type=int, help="override sweep.epochs (the cap per run)")
    p.add_argument("--data-dir", help="directory of the data set's files (overrides data.data_dir in every run)")
    p.add_argument("--dry-run", action="store_true", help="validate and list the runs without running them")
    trials_lib.add_arguments(p)
    cli.add_verbose_flag(p)
    return p.parse_args(argv)


def study_argv(args):
    """A sweep: section with series: is the reproduction study's half 1: crossbow-reproduce runs it."""
    if args.global_batches or args.learners or args.seeds or args.epochs:
        raise ConfigError(f"{args.config}: --global-batches, --learners, --seeds and --epochs apply to the "
                          "one-grid sweep form; this sweep: section has series: (edit it instead)")
    return (["--config", args.config, "--out", args.out or os.path.join("reports", "study-sweep"),
             "--phases", "sweep", "report"] + (["--data-dir", args.data_dir] if args.data_dir else [])
            + [flag for flag, on in (("--force", args.force), ("--resume", args.resume), ("--dry-run", args.dry_run),
                                     ("--worker", args.worker)) if on]
            + (["--parallel", str(args.parallel)] if args.parallel != 1 else [])
            + [a for flag, v in (("--storage", args.storage), ("--study-name", args.study_name),
                                 ("--gpus-per-trial", args.gpus_per_trial)) if v is not None for a in (flag, str(v))]
            + (["--heartbeat", str(args.heartbeat)] if args.heartbeat != trials_lib.DEFAULT_HEARTBEAT else []))


def build(args):
    experiment, sections = load_harness_config(args.config, args.data_dir)
    section = {k: (dict(v) if isinstance(v, dict) else v) for k, v in sections["sweep"].items()}
    if not section:
        raise ConfigError(f"{args.config}: no sweep: section (ssgd, sma, seeds) to run")
    check_data_directory(experiment, args.config)
    overridden = False
    for key, value in (("seeds", args.seeds), ("epochs", args.epochs)):
        if value is not None:
            section[key], overridden = value, True
    for sub, key, value in (("ssgd", "global_batches", args.global_batches), ("sma", "learners", args.learners)):
        if value is not None:
            part = section.get(sub)
            section[sub] = dict(part if isinstance(part, dict) else {}, **{key: value})
            overridden = True
    gpus = trial_gpus(args.parallel, args.gpus_per_trial)
    try:
        spec = parse_sweep(section, experiment)
        return experiment, spec, plan_sweep(spec, experiment, sections, gpus=gpus)
    except ConfigError as e:
        raise ConfigError(f"{args.config}{' (with command-line overrides)' if overridden else ''}: {e}") from None


def main(argv=None):
    """The entry point (crossbow-sweep, python -m crossbow_tf.compare.sweep): the exit code."""
    return command.entry_point("sweep", sweep, argv)


def sweep(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cli.quiet_tensorflow(args.verbose)   # the training processes inherit it
    try:
        _, sections = load_harness_config(args.config)
        if is_study(sections["sweep"]):
            from crossbow_tf.compare import reproduce
            return reproduce.main(study_argv(args))
        experiment, spec, plan = build(args)
        out = recorded_path(args.out) or os.path.join("reports", experiment.get("name", "experiment") + "-sweep")
        total = len(plan) * len(spec.seeds)
        if args.dry_run:
            return command.dry_run(args, out, [f"{series} global batch {g} {label}: {describe(point)}"
                                               for series, g, label, point, _ in plan] + [f"{total} runs"])
        study = command.open_named_study(args, out)
    except (CrossbowError, OSError) as e:   # OSError: the report directory cannot be made
        return command.refused("sweep", e)

    try:
        machine, runner, result = command.run_to_report(
            "sweep", args, out, study, total, f"sweep: {total} runs, report in {out}",
            lambda runner: run_sweep(spec, plan, runner), lambda runner, result: runner.study.complete())
    except command.Finished as done:
        return done.code
    plot_sweep(sweep_series(spec, result), spec.epochs, spec.target, os.path.join(out, "sweep.png"))
    records = [r for points in result.values() for *_, recs in points for r in recs]
    text = sweep_markdown(spec, result)
    failed = [r for r in records if r.summary is None]
    parts = [header_markdown(f"Statistical efficiency: {experiment.get('name', '')}",
                             command_line(), machine, args.config),
             software_line(records), f"- finished: {machine_info()['date']}", "", text, "",
             "![epochs to target against global batch](sweep.png)"]
    command.write_report(out, parts + command.failed_runs_lines(failed, out), dict(
        machine=machine, command=command_line(), spec=spec,
        sweep={series: [dict(global_batch=g, epochs_to_target=e, best=p) for g, e, p, _ in points]
               for series, points in result.items()}))
    runner.say("\n" + text + f"\n\nreport: {os.path.join(out, 'report.md')}")
    return command.exit_code("sweep", failed)



if __name__ == "__main__":
    sys.exit(main())
