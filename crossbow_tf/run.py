"""python -m crossbow_tf.run [--config FILE] [--data-dir DIR] ...: train one experiment.

Without arguments it trains Crossbow's LeNet with SMA on the embedded MNIST subset
(configs/lenet_mnist_embedded.yaml). With TF_CONFIG set, every worker of the cluster runs the same
command and they train together (docs/multiworker.md); only the chief writes results.
"""
import argparse
import os
import sys

from crossbow_tf.errors import CrossbowError

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
    p.add_argument("--worker-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="with TF_CONFIG: how long any wait for another worker may take before every "
                        "worker stops with an error naming the missing one (default: %(default)s)")
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
    try:
        return config_lib.from_dict(cfg)
    except CrossbowError as e:
        raise type(e)(f"command line: {e}") from None


def run(args, log=print):
    cfg = build_config(args)
    from crossbow_tf.distribute import cluster as cluster_lib
    cluster = cluster_lib.from_environment(args.worker_timeout)
    writes = cluster is None or cluster.is_chief   # only the chief writes files
    if writes and args.results and os.path.exists(args.results) and not args.force:
        raise CrossbowError(f"{args.results}: results file exists; choose a new name or pass --force")
    from crossbow_tf.experiment import run_experiment
    results = run_experiment(cfg, log=log, cluster=cluster)
    if writes and args.results:
        results.save(args.results)
        log(f"results written to {args.results}")
    return results


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # keep TensorFlow's start-up chatter out of the report
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except CrossbowError as e:
        print(f"crossbow_tf: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("crossbow_tf: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
