"""The skeleton crossbow-compare and crossbow-sweep share: the dry run's checks, the study and the
runner, what ends a run before the report, and writing the report."""
import os
import sys

from crossbow_tf import cli
from crossbow_tf.compare import trials as trials_lib
from crossbow_tf.compare.report import check_report_dir, copy_config, markdown_table, write_json
from crossbow_tf.compare.runner import check_study, machine_info, open_study, Runner
from crossbow_tf.errors import CrossbowError
from crossbow_tf.files import atomic_write_text


def entry_point(command, run, argv):
    """RUN(ARGV)'s exit code; an OSError that escapes it happened writing the report after the runs."""
    try:
        return run(argv)
    except OSError as e:   # disk full, directory gone
        return cli.fail(command, f"{e.filename}: {e.strerror}; the finished runs stay in the report's "
                        "runs/ directory: free the space and rerun with --resume to write the report")


def refused(command, error):
    """The exit code (2) and one line for a config, plan or storage error, or a report directory that
    cannot be made (an OSError), before anything runs."""
    if isinstance(error, OSError):
        return cli.fail(command, f"{error.filename}: {error.strerror}")
    return cli.fail(command, error)


def exit_code(command, failed):
    """1 (and one line) when runs FAILED, else 0."""
    if failed:
        print(f"{command}: {len(failed)} run(s) failed; see the report", file=sys.stderr)
        return 1
    return 0


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


class Finished(Exception):
    """This process ends with exit code CODE before the report (run_to_report)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


def run_to_report(command, args, out, study, total, heading, run, complete):
    """Starts the runner of TOTAL runs into OUT, says HEADING, runs RUN(runner) as the study and returns
    (machine info, runner, RUN's result) when this process writes the report (COMPLETE(runner,
    result) says whether the study finished). Raises Finished with the exit code when it does not:
    interrupted, the storage holds another plan, the study is not complete, another worker writes it."""
    machine, runner = start(args, out, total, study)
    runner.say(heading)
    try:
        result = run(runner)
    except KeyboardInterrupt:
        raise Finished(interrupted(command, out)) from None
    except CrossbowError as e:   # the storage holds another plan
        raise Finished(cli.fail(command, e)) from None
    stop = stop_before_report(command, args, runner, out, complete(runner, result))
    if stop is not None:
        raise Finished(stop)
    return machine, runner, result


def failed_runs_lines(failed, out):
    """The report's section on FAILED run records ([] when none failed)."""
    if not failed:
        return []
    return ["", "## Failed runs", "", markdown_table(
        ["run", "seed", "error"], [[os.path.relpath(r.path, out), r.seed, r.error] for r in failed])]


def write_report(out, parts, summary):
    atomic_write_text(os.path.join(out, "report.md"), "\n".join(parts) + "\n")
    write_json(os.path.join(out, "summary.json"), summary)
