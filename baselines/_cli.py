"""Command line and YAML loading shared by the baselines.

Imports neither TensorFlow nor crossbow's engine: tf_ssgd uses it too.

A baseline reads the same experiment YAML as ``python -m crossbow_tf.run``; top-level sections that
belong to tools and baselines (baselines.TOOL_SECTIONS: ``compare``, ``sweep``, ``tf_ssgd``) are set
aside before crossbow_tf.config validates the rest, so one file can describe a whole comparison.
"""
import sys

from baselines import TOOL_SECTIONS
from crossbow_tf import cli
from crossbow_tf import config as config_lib
from crossbow_tf.config import apply_overrides, read_yaml  # noqa: F401  (tools import read_yaml from here too)
from crossbow_tf.errors import ConfigError, CrossbowError, TrainingDiverged
from crossbow_tf.results import collapse_stop


def split_sections(mapping):
    """(experiment mapping, {section: mapping}) with the tool sections taken out."""
    experiment = {k: v for k, v in mapping.items() if k not in TOOL_SECTIONS}
    sections = {}
    for name in TOOL_SECTIONS:
        value = mapping.get(name)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        sections[name] = value or {}
    return experiment, sections


def load(path):
    """(ExperimentConfig, tool sections) from the YAML file at PATH."""
    experiment, sections = split_sections(read_yaml(path))
    try:
        return config_lib.from_dict(experiment), sections
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


TF_SSGD_DEFAULTS = {"lr_scaling": "none", "reference_batch": 256, "warmup_from": "zero", "input": "repeat",
                    "jit_compile": "auto"}


def parse_tf_ssgd_options(section):
    """The validated ``tf_ssgd:`` options (see baselines/tf_ssgd.py), defaults filled in."""
    unknown = sorted(set(section) - set(TF_SSGD_DEFAULTS))
    if unknown:
        raise ConfigError(f"tf_ssgd.{unknown[0]}: unknown key; known keys are {', '.join(sorted(TF_SSGD_DEFAULTS))}")
    opts = dict(TF_SSGD_DEFAULTS, **section)
    if opts["lr_scaling"] not in ("none", "linear"):
        raise ConfigError(f"tf_ssgd.lr_scaling: choose none or linear, got {opts['lr_scaling']!r}")
    r = opts["reference_batch"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"tf_ssgd.reference_batch: must be a positive integer, got {r!r}")
    if opts["warmup_from"] not in ("zero", "unscaled"):
        raise ConfigError(f"tf_ssgd.warmup_from: choose zero or unscaled, got {opts['warmup_from']!r}")
    if opts["warmup_from"] == "unscaled" and opts["lr_scaling"] != "linear":
        raise ConfigError("tf_ssgd.warmup_from: unscaled needs lr_scaling: linear (without scaling the "
                          "unscaled rate is the peak, so there would be no warm-up)")
    if opts["input"] not in ("per_epoch", "repeat"):
        raise ConfigError(f"tf_ssgd.input: choose per_epoch or repeat, got {opts['input']!r}")
    if opts["jit_compile"] not in ("auto", True, False):
        raise ConfigError(f"tf_ssgd.jit_compile: choose auto, true or false, got {opts['jit_compile']!r}")
    return opts


def parse_args(prog, description, argv):
    p = cli.OneLineParser(prog=prog, description=description)
    p.add_argument("--config", required=True, type=cli.path_argument, help="YAML experiment (the same files crossbow_tf.run reads)")
    p.add_argument("--data-dir", type=cli.path_argument, help="directory of the data set's files (overrides data.data_dir)")
    p.add_argument("--epochs", type=int, help="override the number of epochs")
    p.add_argument("--batch-size", type=int, help="override the batch size (per device / per learner)")
    p.add_argument("--learning-rate", type=float, help="override learning_rate.base")
    p.add_argument("--learners-per-device", type=int, help="override learners per device (engine baselines)")
    p.add_argument("--logical-cpu-devices", type=int, help="override the number of logical CPU devices")
    p.add_argument("--seed", type=int, help="override the seed")
    p.add_argument("--results", type=cli.path_argument, help="write the run's results (JSON) to this new file")
    p.add_argument("--force", action="store_true", help="allow --results to replace an existing file")
    p.add_argument("--tensorboard", metavar="DIR", type=cli.path_argument,
                   help="write TensorBoard event files of every epoch in DIR (overrides tensorboard)")
    p.add_argument("--precision", choices=config_lib.PRECISIONS,
                   help="Keras's global dtype policy for the run (overrides precision; mixed_float16 with dynamic "
                        "loss scaling, as Keras's LossScaleOptimizer)")
    cli.add_verbose_flag(p)
    return p.parse_args(argv)


def build(args, algorithm=None):
    """(ExperimentConfig, tool sections) from ARGS; ALGORITHM, when given, replaces algorithm.name
    (an engine method, whose learners_per_device applies; without it, one replica per device)."""
    experiment, sections = split_sections(read_yaml(args.config))
    try:
        cfg = config_lib.to_dict(config_lib.from_dict(experiment))
    except ConfigError as e:
        raise ConfigError(f"{args.config}: {e}") from None
    apply_overrides(cfg, args)
    if algorithm is not None:
        cfg["algorithm"]["name"] = algorithm
    try:
        built = config_lib.from_dict(cfg)
        config_lib.check_fits_data(built, learners=algorithm is not None)
        if algorithm is not None:
            config_lib.check_engine_precision(built)
    except ConfigError as e:
        raise ConfigError(f"command line: {e}") from None
    if built.tensorboard:
        from crossbow_tf.tensorboard import check_logdir
        check_logdir(built.tensorboard)
    cli.import_tensorflow(getattr(args, "verbose", False))   # validated: now TensorFlow may start
    from crossbow_tf.models import resolve_model
    resolve_model(built.model)   # a user's model that does not import stops here, before the data loads
    return built, sections


def check_results_path(args):
    if args.results:
        from crossbow_tf.files import check_writable
        check_writable(args.results, force=args.force, what="results file")


def main(prog, description, run, argv=None):
    """Runs RUN(args) and turns user errors into one line and exit code 2; a run that diverged
    (exit code 3) or collapsed (exit code 5) is one line too, with its results written."""
    args = parse_args(prog, description, sys.argv[1:] if argv is None else argv)
    cli.quiet_tensorflow(args.verbose)

    def save(results):
        if args.results:
            cli.save_results(results, args.results, lambda line: print(line, flush=True))
    try:
        check_results_path(args)
        try:
            results = run(args)
        except TrainingDiverged as e:   # the epochs so far, and where and what diverged
            if getattr(e, "results", None) is not None:
                save(e.results)
            print(f"{prog}: {e}", file=sys.stderr, flush=True)
            return e.exit_code
        save(results)
        collapsed = collapse_stop(results)
        if collapsed is not None:
            print(f"{prog}: {collapsed}", file=sys.stderr, flush=True)
            return collapsed.exit_code
    except CrossbowError as e:
        return cli.fail(prog, e)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0
