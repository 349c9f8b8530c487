"""python -m crossbow_tf.run [--config FILE] [--data-dir DIR] ...: train one experiment.

Without arguments it trains Crossbow's LeNet with SMA on the embedded MNIST subset
(configs/lenet_mnist_embedded.yaml).
"""
import argparse
import os
import shlex
import sys

from crossbow_tf.errors import CrossbowError, TrainingDiverged, TrainingInterrupted

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "lenet_mnist_embedded.yaml")


def _int_or_word(text):
    # Anything else goes through to the config's validation, which names the key in one line.
    try:
        return int(text)
    except ValueError:
        return text


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m crossbow_tf.run", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="YAML experiment (default: %(default)s)")
    p.add_argument("--data-dir", help="directory of the data set's files (overrides data.data_dir)")
    p.add_argument("--epochs", type=int, help="override the number of epochs")
    p.add_argument("--learners-per-device", type=_int_or_word, metavar="M|auto",
                   help="override learners per device (m), or auto: measure and choose before training")
    p.add_argument("--logical-cpu-devices", type=int, help="override the number of logical CPU devices")
    p.add_argument("--seed", type=int, help="override the seed")
    p.add_argument("--results", help="write the run's results (JSON) to this new file")
    p.add_argument("--force", action="store_true", help="allow --results to replace an existing file")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="checkpoint the run in DIR (overrides checkpoint.dir; see checkpoint.every_iterations)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run checkpointed in the checkpoint directory (from the beginning if none)")
    p.add_argument("--on-divergence", choices=("stop", "rollback"),
                   help="on a NaN or infinity: stop (exit 3), or roll back to the last checkpoint with the "
                        "learning rate halved, at most max_rollbacks times (overrides on_divergence)")
    return p.parse_args(argv)


def build_config(args):
    from crossbow_tf import config as config_lib
    cfg = config_lib.to_dict(config_lib.load_config(args.config))
    if args.data_dir is not None:
        cfg["data"]["data_dir"] = args.data_dir
    for key, value in (("epochs", args.epochs), ("learners_per_device", args.learners_per_device),
                       ("seed", args.seed)):
        if value is not None:
            cfg[key] = value
    if args.logical_cpu_devices is not None:
        cfg["devices"]["logical_cpu"] = args.logical_cpu_devices
    if args.checkpoint_dir is not None:
        cfg["checkpoint"]["dir"] = args.checkpoint_dir
    if args.on_divergence is not None:
        cfg["on_divergence"] = args.on_divergence
    try:
        return config_lib.from_dict(cfg)
    except CrossbowError as e:
        raise type(e)(f"command line: {e}") from None


def run(args, log=print, stop_signals=None):
    cfg = build_config(args)
    if args.resume and not cfg.checkpoint.dir:
        raise CrossbowError("--resume: needs a checkpoint directory (--checkpoint-dir or checkpoint.dir)")
    if args.results and os.path.exists(args.results) and not args.force:
        raise CrossbowError(f"{args.results}: results file exists; choose a new name or pass --force")
    from crossbow_tf.experiment import run_experiment
    try:
        results = run_experiment(cfg, log=log, resume=args.resume, stop_signals=stop_signals)
    except TrainingDiverged as e:
        if args.results:   # the evaluations so far, and where and what diverged
            e.results.save(args.results)
            log(f"results so far written to {args.results}")
        raise
    if args.results:
        results.save(args.results)
        log(f"results written to {args.results}")
    return results


def resume_command(argv):
    """The command that continues the run ARGV started."""
    return shlex.join(["python", "-m", "crossbow_tf.run", *argv] + ([] if "--resume" in argv else ["--resume"]))


def main(argv=None):
    from crossbow_tf.engine.signals import StopSignals

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # keep TensorFlow's start-up chatter out of the report
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        with StopSignals() as stop_signals:
            run(args, stop_signals=stop_signals)
    except CrossbowError as e:
        print(f"crossbow_tf: error: {e}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        advice = f"; to continue: {resume_command(argv)}" if e.checkpoint else ""
        print(f"crossbow_tf: {e}{advice}", file=sys.stderr)
        return e.exit_code
    except TrainingDiverged as e:
        print(f"crossbow_tf: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("crossbow_tf: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
