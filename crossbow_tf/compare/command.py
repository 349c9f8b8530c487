"""The skeleton crossbow-compare and crossbow-sweep share: the dry run's checks, the study and the
runner, what ends a run before the report, and writing the report."""
import os
import sys

from crossbow_tf.compare import trials as trials_lib
from crossbow_tf.compare.report import check_report_dir, copy_config, markdown_table, write_json
from crossbow_tf.compare.runner import check_study, machine_info, open_study, Runner
from crossbow_tf.files import atomic_write_text


def dry_run(args, out, listing):
    """Checks what a real run into OUT would check, without writing anything, then prints LISTING
    (lines): exit code 0."""
    check_study(args, out)
    check_report_dir(out, force=args.force, resume=args.resume or trials_lib.joins(args))   # as the run would
    for line in listing:
        print(line)
    return 0


def open_named_study(args, out):
    """The study of ARGS' storage, with its name kept in OUT for the workers that join it."""
    study = open_study(args, out)
    trials_lib.remember_name(study, out)
    return study


def start(args, out, total, study):
    """(machine info, Runner of TOTAL runs into OUT) once the config is copied into OUT."""
    copy_config(args.config, out)
    return machine_info(), Runner(out, total, resume=True, trials=study)


def interrupted(command, out):
    print(f"{command}: interrupted; finished runs stay in {out}/runs (rerun with --resume)", file=sys.stderr)
    return 130


def stop_before_report(command, args, runner, out, complete):
    """The exit code when this process does not write the report (the study is not COMPLETE, or another
    worker writes it); None when it does."""
    if not complete:
        print(f"{command}: the study is not complete (runs whose workers died too often); rerun with --resume",
              file=sys.stderr)
        return 1
    if args.worker and not trials_lib.claim_report(runner.study, out):
        runner.say(f"{command}: the study is complete; another worker writes the report in {out}")
        return 0
    return None


def failed_runs_lines(failed, out):
    """The report's section on FAILED run records ([] when none failed)."""
    if not failed:
        return []
    return ["", "## Failed runs", "", markdown_table(
        ["run", "seed", "error"], [[os.path.relpath(r.path, out), r.seed, r.error] for r in failed])]


def write_report(out, parts, summary):
    atomic_write_text(os.path.join(out, "report.md"), "\n".join(parts) + "\n")
    write_json(os.path.join(out, "summary.json"), summary)
