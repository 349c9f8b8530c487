"""python -m crossbow_tf.run [--config FILE] [--data-dir DIR] ...: train one experiment.

Without arguments it trains Crossbow's LeNet with SMA on the embedded MNIST subset (the default
experiment, shipped inside the package; configs/lenet_mnist_embedded.yaml is the same file).
Every argument, the config and the output paths are validated before TensorFlow starts. With
TF_CONFIG set, every worker of the cluster runs the same command and they train together
(docs/multiworker.md); only the chief writes results.
"""
import os
import shlex
import sys

from crossbow_tf import cli
from crossbow_tf.config import PRECISIONS
from crossbow_tf.errors import ConfigError, CrossbowError, TrainingCollapsed, TrainingDiverged, TrainingInterrupted

DEFAULT_CONFIG_NAME = "lenet_mnist_embedded.yaml"


def default_config_path():
    """The default experiment inside the installed package (crossbow_tf/configs/)."""
    from importlib import resources
    return str(resources.files("crossbow_tf") / "configs" / DEFAULT_CONFIG_NAME)


DEFAULT_CONFIG = default_config_path()


def _int_or_word(text):
    # Anything else goes through to the config's validation, which names the key in one line.
    try:
        return int(text)
    except ValueError:
        return text


def parse_args(argv):
    p = cli.OneLineParser(prog="python -m crossbow_tf.run", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, type=cli.path_argument,
                   help="YAML experiment (default: the packaged configs/lenet_mnist_embedded.yaml)")
    p.add_argument("--data-dir", type=cli.path_argument, help="directory of the data set's files (overrides data.data_dir)")
    p.add_argument("--epochs", type=int, help="override the number of epochs")
    p.add_argument("--learners-per-device", type=_int_or_word, metavar="M|auto",
                   help="override learners per device (m), or auto: measure and choose before training")
    p.add_argument("--logical-cpu-devices", type=int, help="override the number of logical CPU devices")
    p.add_argument("--seed", type=int, help="override the seed")
    p.add_argument("--results", type=cli.path_argument, help="write the run's results (JSON) to this new file")
    p.add_argument("--force", action="store_true", help="allow --results to replace an existing file")
    p.add_argument("--worker-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="with TF_CONFIG: how long any wait for another worker may take before every "
                        "worker stops with an error naming the missing one (default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="validate the config, the output paths and the data set's files, then exit 0 without training")
    cli.add_verbose_flag(p)
    p.add_argument("--checkpoint-dir", metavar="DIR", type=cli.path_argument,
                   help="checkpoint the run in DIR (overrides checkpoint.dir; see checkpoint.every_iterations)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run checkpointed in the checkpoint directory (from the beginning if none)")
    p.add_argument("--tensorboard", metavar="DIR", type=cli.path_argument,
                   help="write TensorBoard event files of every epoch in DIR (overrides tensorboard)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="Keras's global dtype policy for the run (overrides precision; mixed_float16 with dynamic "
                        "loss scaling, as Keras's LossScaleOptimizer)")
    p.add_argument("--on-divergence", choices=("stop", "rollback"),
                   help="on a NaN or infinity: stop (exit 3), or roll back to the last checkpoint with the "
                        "learning rate halved, at most max_rollbacks times (overrides on_divergence)")
    return p.parse_args(argv)


def build_config(args):
    """The validated ExperimentConfig of ARGS (config file and overrides); no TensorFlow."""
    from crossbow_tf import config as config_lib
    from crossbow_tf import policy
    cfg = config_lib.to_dict(config_lib.load_config(args.config))
    overridden = config_lib.apply_overrides(cfg, args)
    try:
        built = config_lib.from_dict(cfg)
        config_lib.check_fits_data(built)
        config_lib.check_engine_precision(built)
        refused = policy.divergence_refused(built.on_divergence, built.checkpoint.dir)   # before TensorFlow
        if refused:
            raise ConfigError(f"on_divergence: {refused}: give --checkpoint-dir (or checkpoint.dir)")
        return built
    except CrossbowError as e:
        raise type(e)(f"{'command line' if overridden else args.config}: {e}") from None


def check_outputs(args, cfg):
    """Every file the run will write can be written (nothing is created)."""
    from crossbow_tf.files import check_writable
    from crossbow_tf.tensorboard import check_logdir
    if args.results:
        check_writable(args.results, force=args.force, what="results file")
    if cfg.tensorboard:
        check_logdir(cfg.tensorboard)
        cli.require_tensorboard("--tensorboard" if args.tensorboard is not None else "tensorboard")


def check_data(cfg):
    """For --check only: loads CFG's data set (its files exist and parse), checks that an iteration fits
    in it and that CFG's model builds for it. Building starts TensorFlow's runtime, so the real command,
    whose devices are not made yet, must not call this."""
    from crossbow_tf import config as config_lib
    from crossbow_tf.data import load_dataset
    from crossbow_tf.models import build_model
    data = load_dataset(cfg.data.name, cfg.data.data_dir, path=cfg.data.path)
    config_lib.check_fits_data(cfg, train_size=data.train.size)
    from crossbow_tf.experiment import check_own_step
    check_own_step(build_model(cfg.model, data.input_shape, data.num_classes),
                   loss_scale=cfg.precision == "mixed_float16")
    return data


def plural(count, noun):
    return f"{count} {noun}" + ("" if count == 1 else "s")


def run(args, log=print, stop_signals=None):
    cfg = build_config(args)
    if args.resume and not cfg.checkpoint.dir:
        raise CrossbowError("--resume: needs a checkpoint directory (--checkpoint-dir or checkpoint.dir)")
    cluster = None
    if not args.check and os.environ.get("TF_CONFIG", "").strip():
        from crossbow_tf.distribute import cluster as cluster_lib
        cli.import_tensorflow(args.verbose)   # the cluster resolver is TensorFlow's
        cluster = cluster_lib.from_environment(args.worker_timeout)
    writes = cluster is None or cluster.is_chief   # only the chief writes files
    if writes:
        check_outputs(args, cfg)
    cli.import_tensorflow(args.verbose)
    from crossbow_tf.models import resolve_model
    resolve_model(cfg.model)   # a user's model that does not import stops here, before the data loads
    if args.check:
        data = check_data(cfg)
        log(f"{args.config}: valid; {cfg.model} on {data.name} ({data.train.size} train / {data.test.size} "
            f"test), {cfg.algorithm.name}, batch {cfg.batch_size} per learner, {plural(cfg.epochs, 'epoch')}")
        return None
    from crossbow_tf.experiment import run_experiment
    try:
        results = run_experiment(cfg, log=log, resume=args.resume, stop_signals=stop_signals, cluster=cluster)
    except TrainingDiverged as e:
        if writes and args.results:   # the evaluations so far, and where and what diverged
            cli.save_results(e.results, args.results, log)
        raise
    if writes and args.results:
        cli.save_results(results, args.results, log)
    from crossbow_tf.results import collapse_stop
    collapsed = collapse_stop(results)
    if collapsed is not None:   # a failed run, with its results written: exit code 5
        raise collapsed
    return results


def resume_command(argv):
    """The command that continues the run ARGV started."""
    return shlex.join(["python", "-m", "crossbow_tf.run", *argv] + ([] if "--resume" in argv else ["--resume"]))


def main(argv=None):
    from crossbow_tf.engine.signals import StopSignals

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cli.quiet_tensorflow(args.verbose)
    try:
        with StopSignals() as stop_signals:
            run(args, stop_signals=stop_signals)
    except CrossbowError as e:
        code = cli.fail("crossbow_tf", e)
        return getattr(e, "exit_code", code)   # a lost worker (ClusterError) is not bad input
    except TrainingInterrupted as e:
        advice = f"; to continue: {resume_command(argv)}" if e.checkpoint else ""
        print(f"crossbow_tf: {e}{advice}", file=sys.stderr)
        return e.exit_code
    except (TrainingDiverged, TrainingCollapsed) as e:
        print(f"crossbow_tf: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("crossbow_tf: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
