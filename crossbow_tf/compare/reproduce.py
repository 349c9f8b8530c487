"""crossbow-reproduce --config C --out DIR: the reproduction study of Crossbow's claims, as one report.

(Also python -m crossbow_tf.reproduce, and a checkout's python tools/reproduce.py.)

Five phases, each resumable (--resume reuses every finished run and measurement):
  sweep   half 1, statistical efficiency: epochs to target against the global batch G for every
          series of the config's sweep: section (crossbow_tf/compare/plan.py), equal search
          budgets, the best trial per point on several seeds;
  limits  a multi-worker study's network limits (sweep.network_limits: [1gbit, 100mbit]): each
          multi-worker series' best trial of the sweep again on every seed, each worker in a network
          namespace behind each limit (crossbow_tf/compare/netns.py), trials of the same study
          (the sweep's runs not yet finished run first: the best trial must be known);
  bench   half 2, hardware efficiency: at each G, fused SMA's images/s against one plain Keras model
          at batch G and at batch b, side by side in one process (tools/bench_throughput.py);
  bn      z's test accuracy with the learners' averaged BatchNorm statistics against statistics
          recomputed on training batches (LeNet with BatchNorm, SMA at the middle G);
  report  DIR/report.md with tables, plots and the verdict, DIR/summary.json.

    crossbow-reproduce --config configs/lenet_fashion_mnist_cpu.yaml \\
        --out docs/results/lenet_fashion_mnist_cpu
    crossbow-reproduce --config configs/lenet_fashion_mnist_cpu.yaml --out DIR --resume
    crossbow-reproduce --config C --out DIR --resume --phases report     # tables from what finished
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from crossbow_tf.compare import launch, netns, study_report
from crossbow_tf.compare import trials as trials_lib
from crossbow_tf.compare.plan import count_runs, describe, plan_study, trial_devices, trial_gpus
from crossbow_tf.compare.report import check_report_dir, command_line, copy_config, relative_path, write_json
from crossbow_tf.compare.loops import limit_plan
from crossbow_tf.compare.runner import check_study, PACKAGE_ROOT, machine_info, open_study, run_study, Runner
from crossbow_tf.compare.spec import check_data_directory, is_study, load_harness_config, parse_study, run_config
from crossbow_tf.device_choice import visible_gpu_ids
from crossbow_tf.errors import ConfigError, CrossbowError
from crossbow_tf.files import recorded_path

PHASES = ("sweep", "limits", "bench", "bn", "report")
TRAINING_PHASES = {"sweep", "limits", "bn"}   # the phases that read the data set (the bench trains on the embedded digits)
# The throughput bench is a checkout's tools/bench_throughput.py.
TOOLS = os.path.join(PACKAGE_ROOT, "tools")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="crossbow-reproduce", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML experiment whose sweep: section has series:")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--data-dir", help="directory of the data set's files (overrides data.data_dir in every run)")
    p.add_argument("--force", action="store_true", help="replace an existing report directory")
    p.add_argument("--resume", action="store_true", help="continue an existing report directory (same settings)")
    p.add_argument("--phases", nargs="+", choices=PHASES, help="phases to run (in order; default: all)")
    p.add_argument("--bench-rounds", type=int, default=3, help="interleaved rounds of the throughput bench")
    p.add_argument("--bench-examples", type=int, default=8192, help="images per measured bench epoch")
    p.add_argument("--bn-epochs", type=int, default=8, help="epochs of the BatchNorm run")
    p.add_argument("--dry-run", action="store_true", help="validate and list the runs without running them")
    trials_lib.add_arguments(p)   # a worker runs the sweep's and limits' trials only (and the report once done)
    args = p.parse_args(argv)
    args.phases_given, args.phases = args.phases is not None, args.phases or list(PHASES)
    return args


def limits_phase(args, study, spec, cells, say):
    """True when the limits phase runs: asked for, with sweep.network_limits, multi-worker series, no
    named hosts (STUDY, trials.Options, or the environment) and a machine that makes network
    namespaces; else False, with one line saying why (a study without
    network_limits says nothing unless --phases named limits). One-worker series are left out, in one line."""
    if "limits" not in args.phases:
        return False
    if not spec.network_limits:
        if args.phases_given:
            say("reproduce: limits: the config's sweep has no network_limits; nothing to run at limits")
        return False
    alone = list(dict.fromkeys(c.series.name for c in cells if c.series.workers == 1))
    if alone:
        say(f"reproduce: limits: {', '.join(alone)} run on one worker (no network between workers): "
            "not run at the limits")
    if len(alone) == len({c.series.name for c in cells}):
        return False
    if any(launch.named_hosts(study.hosts)):
        say("reproduce: limits: the phase runs its workers on this machine in network namespaces, not on the "
            f"hosts of {launch.HOSTS_GIVEN}; not run")
        return False
    refused = netns.refusal()
    if refused:
        say(f"reproduce: limits: {refused}; the phase is not run (no loopback runs labelled as limited)")
        return False
    return True


def build(args):
    experiment, sections = load_harness_config(args.config, args.data_dir)
    section = sections["sweep"]
    if not is_study(section):
        raise ConfigError(f"{args.config}: the sweep: section has no series: mapping (see crossbow_tf/compare/plan.py)")
    if set(args.phases) & TRAINING_PHASES:
        check_data_directory(experiment, args.config)
    gpus = trial_gpus(args.parallel, args.gpus_per_trial)
    try:
        spec = parse_study(section, experiment)
        cells = plan_study(spec, experiment, sections, gpus=gpus)
    except ConfigError as e:
        raise ConfigError(f"{args.config}: {e}") from None
    if args.bench_rounds < 1 or args.bench_examples < 1 or args.bn_epochs < 1:
        raise ConfigError("--bench-rounds, --bench-examples and --bn-epochs must be at least 1")
    if "bench" in args.phases and not os.path.isfile(os.path.join(TOOLS, "bench_throughput.py")):
        raise ConfigError(f"the bench phase runs a checkout's tools/bench_throughput.py, which {TOOLS} does not "
                          "hold (an installed package has no tools/): run from a checkout, or leave bench out "
                          "of --phases")
    return experiment, sections, spec, cells


def bench_jobs(spec, cells):
    """[(b, [k...], devices)] per SMA series: the bench's learner counts at every point."""
    jobs = {}
    for cell in cells:
        if cell.series.method == "sma":
            exp = next(iter(cell.trials[0][2].values()))[0]
            devices = trial_devices(exp)
            jobs.setdefault((cell.series.batch_size, devices), set()).add(cell.k)
    return [(b, sorted(ks), devices) for (b, devices), ks in sorted(jobs.items())]


# The bench's flags that name files, not what is measured: --resume ignores them.
BENCH_OUTPUT_FLAGS = ("--json",)


def bench_settings(command):
    """{flag: [values]} of a bench COMMAND (its argument list, or a saved .cmd file's text) without
    the script and the output paths: what the measurement depends on (model, data, examples,
    batch, devices, rounds, ks, precision ...). Commands saved anywhere, with any --out, compare
    equal when they measured the same thing."""
    if isinstance(command, str):
        try:
            command = shlex.split(command)
        except ValueError:   # an unbalanced quote: never equal to a command of ours
            return None
    settings, flag = {}, None
    for token in command:
        if token.startswith("--"):
            flag = token
            settings.setdefault(flag, [])
        elif flag is not None:   # tokens before the first flag are the interpreter and the script
            settings[flag].append(token)
    for name in BENCH_OUTPUT_FLAGS:
        settings.pop(name, None)
    return settings


def bench_command(out, experiment, b, ks, devices, rounds, examples):
    """(BASE, command): the bench of per-learner batch B writes BASE.json, BASE.cmd and BASE.log."""
    base = os.path.join(out, "bench", f"b{b}")
    precision = experiment.get("precision", "float32")
    cmd = [sys.executable, os.path.join(TOOLS, "bench_throughput.py"), "--model", experiment.get("model", "lenet"),
           "--data", "mnist-shaped", "--examples", str(examples), "--batch-size", str(b), "--devices", str(devices),
           "--rounds", str(rounds), "--ks", *map(str, ks)] + (
               ["--precision", precision] if precision != "float32" else []) + ["--json", base + ".json"]
    return base, cmd


def _reusable_bench(base, cmd, ks):
    """The bench JSON at BASE.json when BASE.cmd measured what CMD measures and the JSON holds every
    k of KS; else None."""
    try:
        with open(base + ".cmd") as f:
            saved = bench_settings(f.read())
        if saved != bench_settings(cmd):
            return None
        with open(base + ".json") as f:
            result = json.load(f)
        if not set(ks) <= {row["k"] for row in result["rows"]}:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result


def run_bench(out, experiment, jobs, rounds, examples, say, resume):
    """Runs tools/bench_throughput.py once per per-learner batch; returns {b: bench JSON}.

    RESUME reuses a bench whose saved command (BASE.cmd) has the same settings (bench_settings),
    wherever it was run from and whatever the report directory was called."""
    results = {}
    os.makedirs(os.path.join(out, "bench"), exist_ok=True)
    for b, ks, devices in jobs:
        base, cmd = bench_command(out, experiment, b, ks, devices, rounds, examples)
        reused = _reusable_bench(base, cmd, ks) if resume else None
        if reused is not None:
            say(f"bench b={b}: done before, reusing {os.path.relpath(base + '.json', out)}")
            results[b] = reused
            continue
        say(f"bench b={b}, k in {ks}: SMA against Keras at k*b and at b, {rounds} rounds ...")
        start = time.time()
        with open(base + ".log", "w") as log:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        if code != 0:
            say(f"      FAILED (exit code {code}; log: {os.path.relpath(base)}.log)")
            continue
        with open(base + ".cmd", "w") as f:   # as one would type it again here: no machine's folders
            f.write(shlex.join(relative_path(a) for a in cmd[1:]))
        with open(base + ".json") as f:
            results[b] = json.load(f)
        say(f"      done in {time.time() - start:.0f}s")
    return results


def bn_run_config(experiment, sections, spec, epochs):
    """The BatchNorm experiment: LeNet with BatchNorm, SMA with b=16 at the middle global batch."""
    g = sorted(spec.global_batches)[len(spec.global_batches) // 2]
    b = 16
    exp, opts = run_config(
        experiment, sections, "sma",
        {"model": "lenet_bn", "batch_size": b, "learners_per_device": g // b, "batchnorm_eval": "both",
         "learning_rate.base": 0.05, "collapse_epochs": 0},
        seed=0, target=spec.target, epochs=epochs, where="bn run")
    exp["stop_at_target"] = False
    return g, exp, opts


def _dry_run(args, study, experiment, spec, cells, jobs, total, limits):
    """--dry-run: the checks the run would make, and its runs listed, nothing written."""
    check_study(args, args.out, study)
    check_report_dir(args.out, force=args.force, resume=args.resume or trials_lib.joins(args))   # as the run would
    for cell in cells:
        for label, point, _ in cell.trials:
            print(f"{cell.series.name} G={cell.global_batch} k={cell.k} {label}: {describe(point)}")
    for run in (limit_plan(spec, cells) if limits else []):
        if run.item.seed == spec.seeds[0]:
            print(f"{run.cell.series.name} G={run.cell.global_batch} behind {run.limit.text()}: the sweep's best "
                  f"trial on seeds {spec.seeds}, on {run.cell.series.workers} workers (runs/{run.subdir}/)")
    for b, ks, devices in jobs:
        base, cmd = bench_command(args.out, experiment, b, ks, devices, args.bench_rounds, args.bench_examples)
        reused = args.resume and _reusable_bench(base, cmd, ks) is not None
        print(f"bench b={b} k={ks} on {devices} device(s)"
              + (f": done before, --resume reuses {os.path.relpath(base)}.json" if reused else ""))
    print(f"{total} training runs (at most), budget {spec.describe_budget()}")
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Relative to this folder: the runs are given (and so record) paths that name no machine's folders.
    args.out = recorded_path(args.out)
    try:
        experiment, sections, spec, cells = build(args)
        jobs = bench_jobs(spec, cells)
        if args.worker:
            args.phases = [p for p in args.phases if p in ("sweep", "limits", "report")]
        study = trials_lib.options(args, args.out)   # the flags, --hostfile read once
        limits = limits_phase(args, study, spec, cells, print)
        total = count_runs(spec, cells) + ("bn" in args.phases) + (len(limit_plan(spec, cells)) if limits else 0)
        if args.dry_run:
            return _dry_run(args, study, experiment, spec, cells, jobs, total, limits)
        study = open_study(args, args.out, study)
        trials_lib.remember_name(study, args.out)
    except CrossbowError as e:
        print(f"reproduce: error: {e}", file=sys.stderr)
        return 2
    out = args.out
    # The report is built from this config, however many times the study resumed (a resumed study
    # may have gained series), so its copy is the one given now.
    copy_config(args.config, out)
    machine_path = os.path.join(out, "machine.json")
    if not os.path.exists(machine_path):
        # The GPUs the runs will see (the report's words about the machine come from this file).
        write_json(machine_path, dict(machine_info(), gpus=len(visible_gpu_ids()), command=command_line()))
    runner = Runner(out, total, resume=True, trials=study)
    runner.say(f"reproduce: {len(cells)} cells, {total} runs at most, phases {' '.join(args.phases)}, report in {out}")
    try:
        outcome = run_study(spec, cells, runner, limits=limits) if "sweep" in args.phases or limits else None
        if outcome is not None and not runner.study.complete():
            print("reproduce: the study is not complete (runs whose workers died too often); rerun with --resume",
                  file=sys.stderr)
            return 1
        bench = run_bench(out, experiment, jobs, args.bench_rounds, args.bench_examples, runner.say,
                          args.resume) if "bench" in args.phases else None
        bn = None
        if "bn" in args.phases:
            g, exp, opts = bn_run_config(experiment, sections, spec, args.bn_epochs)
            bn = runner.run("sma", exp, opts, "bn", f"lenet_bn_G{g}_s0", f"lenet_bn G={g} averaged vs recomputed",
                            0, spec.target, spec.timeout)
    except KeyboardInterrupt:
        print(f"reproduce: interrupted; finished runs stay in {out} (rerun with --resume)", file=sys.stderr)
        return 130
    except CrossbowError as e:   # the storage holds another plan
        print(f"reproduce: error: {e}", file=sys.stderr)
        return 2
    if "report" not in args.phases:
        return 0
    if args.worker and outcome is not None and not trials_lib.claim_report(runner.study, out):
        runner.say(f"reproduce: the study is complete; another worker writes the report in {out}")
        return 0
    report = study_report.build_report(out, spec, cells, experiment, args)
    runner.say("\n" + report["verdict_markdown"])
    runner.say(f"\nreport: {os.path.join(out, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
