"""Typed, validated experiment configuration, read from YAML with PyYAML's safe loader."""
import dataclasses
import math
import os
import re
import typing

import yaml

from crossbow_tf import policy
from crossbow_tf.algorithms.contract import ALGORITHMS
from crossbow_tf.optimizer_args import check_optimizer_arguments
from crossbow_tf.errors import ConfigError, ConfigTypeError
from crossbow_tf.policy import OPTIMIZER_NAMES, REFUSED_OPTIMIZERS  # noqa: F401  (read from here too)

# Seeds go to NumPy's legacy seeding (keras.utils.set_random_seed), which takes [0, 2**32).
MAX_SEED = 2**32 - 1
# Each logical CPU device has its own thread pools and copies of z; beyond this it is a typo.
MAX_LOGICAL_CPU_DEVICES = 64
# Every learner holds its own copy of the model and its velocity on the device; beyond this it is a typo.
MAX_LEARNERS_PER_DEVICE = 1024
# Training examples of the data sets whose size is fixed, to refuse an iteration larger than the
# training set before anything is loaded (other data sets are checked once loaded).
KNOWN_TRAIN_SIZES = {"mnist_embedded": 4000, "mnist": 60000, "fashion_mnist": 60000, "cifar10": 50000, "cifar100": 50000}
# The built-in models and data sets (crossbow_tf.models.MODELS, crossbow_tf.data.DATASETS; a test
# keeps them equal), so that a misspelt name is refused before TensorFlow starts. A model may also
# be a user's function, module:function or path/to/file.py:function.
MODEL_NAMES = ("lenet", "lenet_bn", "resnet32", "vgg16", "resnet50")
DATA_SET_NAMES = ("mnist_embedded", "mnist", "fashion_mnist", "cifar10", "cifar100", "imagenet", "npz")
FILE_DATA_SETS = ("npz",)   # read from data.path, one file, rather than from data.data_dir
EMBEDDED_DATA_SETS = ("mnist_embedded",)   # shipped inside the package: read no file at all
# Where a data set's files are when no data.data_dir is given, and how to put them there: Debian's
# dataset-fashion-mnist package installs Fashion-MNIST's four IDX files (MNIST's file names) here.
DEFAULT_DATA_DIRS = {"fashion_mnist": ("/usr/share/datasets/fashion-mnist",
                                       "install it with `apt-get install dataset-fashion-mnist` or pass "
                                       "--data-dir DIR with the four IDX files")}


def data_directory_problem(name, data_dir):
    """Why data set NAME cannot be read from DATA_DIR (or its default directory), found without reading
    a file or TensorFlow: the harness asks before it writes anything or starts a run, and the loaders
    before they read; what the files hold, the loaders check. None when the directory is there, or the
    set reads no directory."""
    if name in FILE_DATA_SETS or name in EMBEDDED_DATA_SETS:
        return None
    if not data_dir and name in DEFAULT_DATA_DIRS:
        directory, how = DEFAULT_DATA_DIRS[name]
        return None if os.path.isdir(directory) else f"{name}: {directory} not found; {how}"
    if not data_dir:
        return f"the {name} data set needs --data-dir (or data.data_dir: the directory of its files)"
    return None if os.path.isdir(data_dir) else f"{data_dir}: data directory not found"


@dataclasses.dataclass
class DataConfig:
    name: str = "mnist_embedded"
    data_dir: typing.Optional[str] = None
    path: typing.Optional[str] = None      # the file of a FILE_DATA_SETS data set (npz)


@dataclasses.dataclass
class AlgorithmConfig:
    """The update rule (crossbow_tf.algorithms: a key of its registry ALGORITHMS, whose rule's
    parameters are keys here). Keys left null take the rule's default; a null-by-default key set for a
    rule that has no such parameter is refused. alpha, momentum, central_momentum and weight_decay
    are checked for every rule and ignored by those without them, so that one file serves several
    methods (the harness and the baselines change the name)."""
    name: str = "sma"                       # sma | ssgd | easgd | localsgd (crossbow_tf.algorithms.ALGORITHMS)
    alpha: typing.Optional[float] = None    # None: 1/k for SMA, 0.9/k for EASGD
    momentum: float = 0.9
    central_momentum: float = 0.9
    weight_decay: float = 0.0
    central_step: typing.Optional[float] = None   # SMA: beta of the decoupled Delta = beta*mean(s_j - z); null: k*alpha
    sync_period: typing.Optional[int] = None      # SMA, EASGD: synchronise every H-th iteration (null: 1)
    allow_unstable: bool = False                  # SMA, EASGD: run a central loop past its stability bound
    period: typing.Optional[int] = None           # localsgd: H, iterations between synchronisations (null: 1)
    outer_learning_rate: typing.Optional[float] = None   # localsgd: eta_o (null: 1.0)
    outer_momentum: typing.Optional[float] = None        # localsgd: mu_o (null: 0)
    nesterov: typing.Optional[bool] = None               # localsgd: Nesterov outer momentum (null: false)
    local_after_epochs: typing.Optional[int] = None      # localsgd: post-local SGD, period 1 for E epochs
    # An adaptive optimizer's learners (optimizer: adam, ...): z advances as one step at the global
    # batch (crossbow_tf.algorithms.noise_matching). auto: on where it applies; true | false.
    noise_matching: typing.Union[bool, str] = "auto"


@dataclasses.dataclass
class DevicesConfig:
    logical_cpu: typing.Optional[int] = None   # split the CPU into this many devices when no GPU
    cross_device_reduction: str = "auto"     # auto | nccl | one_device | hierarchical_copy


@dataclasses.dataclass
class LearningRateConfig:
    base: float = 0.01
    drops_at_epochs: typing.List[float] = dataclasses.field(default_factory=list)
    drop_factor: float = 0.1
    warmup_epochs: float = 0.0


@dataclasses.dataclass
class AutotuneConfig:
    """How learners_per_device: auto measures (Crossbow's rule, crossbow_tf.engine.autotune)."""
    threshold: float = 0.10                 # add a learner per device while images/s gain more than this
    max_learners_per_device: int = 16
    warmup_iterations: int = 2              # untimed: tracing and first-run allocation
    measure_iterations: int = 10            # timed one by one; their median counts


@dataclasses.dataclass
class CheckpointConfig:
    """Where and when a run is checkpointed (crossbow_tf.engine.checkpoint); off without a dir."""
    dir: typing.Optional[str] = None                 # --checkpoint-dir
    every_iterations: typing.Optional[int] = None    # also every N iterations
    at_epoch_end: bool = True
    max_to_keep: int = 3


@dataclasses.dataclass
class ExperimentConfig:
    name: str = "experiment"
    model: str = "lenet"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    devices: DevicesConfig = dataclasses.field(default_factory=DevicesConfig)
    learners_per_device: typing.Union[int, str] = 1   # m, or "auto": measured before training
    autotune: AutotuneConfig = dataclasses.field(default_factory=AutotuneConfig)
    batch_size: int = 16                     # b: the batch of one learner (Crossbow's; Keras fit's batch_size is k*b)
    learning_rate: LearningRateConfig = dataclasses.field(default_factory=LearningRateConfig)
    # The learners' Keras optimizer, {name: adam, beta_1: 0.9, ...} (keras.optimizers.get's names and the
    # optimizer's own arguments; the rate is learning_rate's). null: momentum SGD with algorithm.momentum.
    optimizer: typing.Optional[typing.Dict[str, typing.Any]] = None
    epochs: int = 10
    target_accuracy: typing.Optional[float] = None
    stop_at_target: bool = True
    seed: int = 0
    eval_batch_size: int = 500
    jit_compile: bool = False                # XLA for the whole step (slower for convolutions on CPU)
    jit_update: bool = True                  # XLA for the memory-bound update only (faster on CPU)
    learners: str = "auto"                   # fused | replicated | auto (fused when every layer allows)
    learner_diagnostics: bool = True         # per epoch: learner 0's test accuracy, learners' distance to z
    collapse_epochs: int = 2                 # stop when at chance this many epochs after the first (0: never)
    batchnorm_eval: str = "averaged"         # z's BatchNorm statistics: averaged | recomputed | both
    batchnorm_batches: int = 8               # training batches (of eval_batch_size) for "recomputed"
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    on_divergence: str = "stop"              # stop | rollback (to the last checkpoint, learning rate halved)
    max_rollbacks: int = 3
    tensorboard: typing.Optional[str] = None   # write TensorBoard event files (tf.summary) in this folder
    precision: str = "float32"               # Keras's global dtype policy: float32 | mixed_bfloat16 | mixed_float16


def _check_type(path, value, annotation):
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union:
        errors = []
        for option in args:
            try:
                return _check_type(path, value, option)
            except ConfigTypeError as e:
                errors.append(e)   # a value of the right type but out of range says so below
        names = " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
        raise ConfigTypeError(f"{path}: expected {names}, got {value!r}")
    if annotation is type(None):
        if value is not None:
            raise ConfigTypeError(f"{path}: expected null, got {value!r}")
        return None
    if origin in (list, typing.List):
        if not isinstance(value, list):
            raise ConfigTypeError(f"{path}: expected a list, got {value!r}")
        return [_check_type(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, path)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigTypeError(f"{path}: expected a mapping, got {value!r}")
        return {k: _check_type(f"{path}.{k}", v, args[1]) for k, v in value.items()}
    if annotation is typing.Any:
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigTypeError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if annotation is int:
        # 1e6 is how people write a million; an integral float is taken as the integer it is.
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"{path}: expected an integer, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigTypeError(f"{path}: expected true or false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigTypeError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(annotation)


def _build(cls, mapping, path):
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigTypeError(f"{path or 'config'}: expected a mapping, got {mapping!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - fields)
    if unknown:
        raise ConfigError(f"{path + '.' if path else ''}{unknown[0]}: unknown key; "
                          f"known keys are {', '.join(sorted(fields))}")
    values = {name: _check_type(f"{path + '.' if path else ''}{name}", value, hints[name])
              for name, value in mapping.items()}
    return cls(**values)


# AlgorithmConfig's keys that every experiment carries (checked below whatever the rule): the others
# are null by default and belong to the rules that take them (rule_keys).
SHARED_RULE_KEYS = ("name", "alpha", "momentum", "central_momentum", "weight_decay", "allow_unstable", "noise_matching")


def rule_keys():
    """{optional algorithm key: the names of the rules that take it}, from the registry."""
    optional = [f.name for f in dataclasses.fields(AlgorithmConfig) if f.name not in SHARED_RULE_KEYS]
    return {key: tuple(name for name, cls in ALGORITHMS.items() if key in cls.config_keys()) for key in optional}


def make_rule(a, **overrides):
    """The update rule of AlgorithmConfig A (keys left null take the rule's defaults), with OVERRIDES;
    the rule's own checks raise TypeError/ValueError."""
    cls = ALGORITHMS[a.name]
    kwargs = {key: getattr(a, key) for key in cls.config_keys()
              if hasattr(a, key) and getattr(a, key) is not None}
    return cls(**dict(kwargs, **overrides))


def _rule_problem(error):
    """A rule's check ("SMA: central_step must be ..., got 0.0") as the config's line naming the key."""
    said = str(error).split(": ", 1)[-1]
    key, _, problem = said.partition(" ")
    problem = problem.replace(" or None", " or null").replace("True or False", "true or false")
    return f"algorithm.{key}: {problem}"


def _validate_algorithm(a, need):
    """The rule's name and keys, then the rule itself: constructing it runs its own checks."""
    need(a.name in ALGORITHMS,
         f"algorithm.name: unknown algorithm {a.name!r}; choose {', '.join(ALGORITHMS)}")
    for key, rules in rule_keys().items():
        need(getattr(a, key) is None or a.name in rules,
             f"algorithm.{key}: applies to {' and '.join(rules)}, not to {a.name}")
    central = [name for name, cls in ALGORITHMS.items() if cls.has_central_loop]
    need(not a.allow_unstable or ALGORITHMS[a.name].has_central_loop,
         f"algorithm.allow_unstable: applies to {' and '.join(central)} (the rules with a central loop), "
         f"not to {a.name}")
    need(a.noise_matching in ("auto", True, False) and isinstance(a.noise_matching, (bool, str)),
         f"algorithm.noise_matching: must be auto, true or false, got {a.noise_matching!r}")
    for name in ("momentum", "central_momentum"):
        value = getattr(a, name)
        need(0 <= value < 1, f"algorithm.{name}: must be in [0, 1), got {value}")
    need(a.weight_decay >= 0, "algorithm.weight_decay: must not be negative")
    need(a.alpha is None or 0 < a.alpha <= 1,
         f"algorithm.alpha: must be in (0, 1] or null (1/k), got {a.alpha}"
         + ("; alpha 0 never moves z: the learners would train apart and z stay at its initial weights"
            if a.alpha == 0 else ""))
    try:
        make_rule(a)
    except (TypeError, ValueError) as e:
        raise ConfigError(_rule_problem(e)) from None


# Arguments of the optimizer that other keys set.
OPTIMIZER_SET_ELSEWHERE = {"learning_rate": "the learning rate and its schedule are learning_rate's (base, drops, warm-up)"}


def _validate_optimizer(c):
    spec = c.optimizer
    if spec is None:
        return
    name = spec.get("name")
    if not isinstance(name, str):
        raise ConfigError(f"optimizer.name: give the optimizer's name (one of {', '.join(OPTIMIZER_NAMES)}), "
                          f"got {name!r}")
    if name.lower() in REFUSED_OPTIMIZERS:
        raise ConfigError(f"optimizer.name: {name} cannot be the learners' optimizer: "
                          f"{REFUSED_OPTIMIZERS[name.lower()]}, which over the stacked learners would mix them")
    if name.lower() not in OPTIMIZER_NAMES:
        raise ConfigError(f"optimizer.name: unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")
    for key in spec:
        if key in OPTIMIZER_SET_ELSEWHERE:
            raise ConfigError(f"optimizer.{key}: {OPTIMIZER_SET_ELSEWHERE[key]}, not the optimizer's")
    check_optimizer_arguments(spec)   # the optimizer's own signature, before TensorFlow starts
    if name.lower() != "sgd" and c.algorithm.weight_decay:
        raise ConfigError(f"algorithm.weight_decay: is the L2 term of the default momentum-SGD learners; "
                          f"{name} takes its own step: give optimizer.weight_decay instead")


def _adaptive(c):
    """Whether C's learners take an adaptive optimizer's step (not the default or a named SGD)."""
    return c.optimizer is not None and str(c.optimizer.get("name", "")).lower() != "sgd"


def noise_matching_excluded(c):
    """Why noise matching does not apply to C's learners, or None when it does (crossbow_tf.policy)."""
    return policy.noise_matching_excluded(_adaptive(c), make_rule(c.algorithm))


def noise_matching_on(c):
    """Whether C's learners run with noise matching (its auto resolved)."""
    return policy.noise_matching_on(c.algorithm.noise_matching, _adaptive(c), make_rule(c.algorithm))


def build_keras_optimizer(spec, learning_rate):
    """The Keras optimizer of an ``optimizer:`` mapping SPEC (validated) at LEARNING_RATE (a number or
    a Keras schedule); ConfigError names an argument the optimizer does not take."""
    import keras
    arguments = {k: v for k, v in spec.items() if k != "name"}
    cls = type(keras.optimizers.get(spec["name"].lower()))
    try:
        return cls(learning_rate=learning_rate, **arguments)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizer: {cls.__name__} refuses {arguments} ({str(e).splitlines()[0]})") from None


def expected_learners(c):
    """k as the config alone gives it (one worker, devices.logical_cpu devices of learners_per_device
    learners), or None when it depends on the machine (learners_per_device auto, no logical_cpu)."""
    if c.learners_per_device == "auto" or not c.devices.logical_cpu:
        return None
    return c.devices.logical_cpu * c.learners_per_device


def check_central_loop(c, num_learners):
    """Raises ConfigError when C's algorithm has an unstable central loop with NUM_LEARNERS learners
    (its rule's check_central_loop), unless algorithm.allow_unstable."""
    try:
        make_rule(c.algorithm).check_central_loop(num_learners)
    except ValueError as e:
        raise ConfigError(f"algorithm: {str(e).split(': ', 1)[1]}") from None


def _validate(c):
    def need(ok, message):
        if not ok:
            raise ConfigError(message)
    _validate_model_and_data(c, need)
    _validate_algorithm(c.algorithm, need)
    _validate_optimizer(c)
    need(c.algorithm.noise_matching is not True or noise_matching_excluded(c) is None,
         f"algorithm.noise_matching: {noise_matching_excluded(c)}")
    need(c.learners in ("auto", "fused", "replicated"),
         f"learners: unknown {c.learners!r}; choose auto, fused or replicated")
    need(c.learners_per_device == "auto"
         or (isinstance(c.learners_per_device, int) and c.learners_per_device >= 1),
         f"learners_per_device: must be a positive integer or \"auto\", got {c.learners_per_device!r}")
    t = c.autotune
    need(0 <= t.threshold < 1,   # a percentage written as 10 would silently mean 1000%
         f"autotune.threshold: must be a fraction in [0, 1) (0.1 is 10%), got {t.threshold}")
    need(t.max_learners_per_device >= 1,
         f"autotune.max_learners_per_device: must be at least 1, got {t.max_learners_per_device}")
    need(t.warmup_iterations >= 1,
         f"autotune.warmup_iterations: must be at least 1 (the first iteration traces), got {t.warmup_iterations}")
    need(t.measure_iterations >= 1,
         f"autotune.measure_iterations: must be at least 1, got {t.measure_iterations}")
    need(c.batch_size >= 1, f"batch_size: must be at least 1, got {c.batch_size}")
    need(c.epochs >= 1, f"epochs: must be at least 1, got {c.epochs}")
    need(c.eval_batch_size >= 1, f"eval_batch_size: must be at least 1, got {c.eval_batch_size}")
    need(c.learning_rate.base > 0, f"learning_rate.base: must be positive, got {c.learning_rate.base}")
    need(0 < c.learning_rate.drop_factor <= 1,
         f"learning_rate.drop_factor: must be in (0, 1], got {c.learning_rate.drop_factor}")
    need(c.learning_rate.warmup_epochs >= 0, "learning_rate.warmup_epochs: must not be negative")
    need(list(c.learning_rate.drops_at_epochs) == sorted(c.learning_rate.drops_at_epochs)
         and all(e > 0 for e in c.learning_rate.drops_at_epochs),
         "learning_rate.drops_at_epochs: must be positive and increasing")
    need(0 <= c.seed <= MAX_SEED, f"seed: must be in [0, {MAX_SEED}], got {c.seed}")
    need(c.target_accuracy is None or 0 < c.target_accuracy <= 1,
         f"target_accuracy: must be in (0, 1], got {c.target_accuracy}")
    need(c.collapse_epochs >= 0, f"collapse_epochs: must not be negative (0 turns the check off), got {c.collapse_epochs}")
    need(c.batchnorm_eval in ("averaged", "recomputed", "both"),
         f"batchnorm_eval: unknown {c.batchnorm_eval!r}; choose averaged, recomputed or both")
    need(c.batchnorm_batches >= 1, f"batchnorm_batches: must be at least 1, got {c.batchnorm_batches}")
    need(c.devices.logical_cpu is None or 1 <= c.devices.logical_cpu <= MAX_LOGICAL_CPU_DEVICES,
         f"devices.logical_cpu: must be in [1, {MAX_LOGICAL_CPU_DEVICES}], got {c.devices.logical_cpu}")
    need(c.learners_per_device == "auto" or c.learners_per_device <= MAX_LEARNERS_PER_DEVICE,
         f"learners_per_device: at most {MAX_LEARNERS_PER_DEVICE}, got {c.learners_per_device}")
    need(t.max_learners_per_device <= MAX_LEARNERS_PER_DEVICE,
         f"autotune.max_learners_per_device: at most {MAX_LEARNERS_PER_DEVICE}, got {t.max_learners_per_device}")

    need(c.devices.cross_device_reduction in ("auto", "nccl", "one_device", "hierarchical_copy"),
         f"devices.cross_device_reduction: unknown {c.devices.cross_device_reduction!r}; "
         "choose auto, nccl, one_device or hierarchical_copy")
    ck = c.checkpoint
    need(ck.every_iterations is None or ck.every_iterations >= 1,
         f"checkpoint.every_iterations: must be at least 1 or null, got {ck.every_iterations}")
    need(ck.max_to_keep >= 1, f"checkpoint.max_to_keep: must be at least 1, got {ck.max_to_keep}")
    need(c.on_divergence in ("stop", "rollback"),
         f"on_divergence: unknown {c.on_divergence!r}; choose stop or rollback")
    need(c.max_rollbacks >= 0, f"max_rollbacks: must not be negative, got {c.max_rollbacks}")
    need(c.precision in PRECISIONS, f"precision: unknown {c.precision!r}; choose {', '.join(PRECISIONS)}")
    if expected_learners(c) is not None:   # else the run checks, once it knows k
        check_central_loop(c, expected_learners(c))
    return c


def _validate_model_and_data(c, need):
    user_model = ":" in c.model
    need(c.model in MODEL_NAMES or user_model,
         f"model: unknown model {c.model!r}; choose one of {', '.join(sorted(MODEL_NAMES))}, or your own "
         "as module:function or path/to/file.py:function")
    if user_model:
        from crossbow_tf.user_model import parse_spec
        parse_spec(c.model)
    d = c.data
    need(d.name in DATA_SET_NAMES,
         f"data.name: unknown data set {d.name!r}; choose one of {', '.join(sorted(DATA_SET_NAMES))}")
    if d.name in FILE_DATA_SETS:
        need(bool(d.path), f"data.path: the {d.name} data set needs the path of its file (data.path: FILE.{d.name})")
        need(d.data_dir is None, f"data.data_dir: the {d.name} data set reads data.path, not a directory; "
                                 "remove data_dir (or --data-dir)")
    else:
        need(d.path is None, f"data.path: applies to the {' and '.join(FILE_DATA_SETS)} data set only; "
                             f"{d.name} reads data.data_dir")
        need(d.name not in EMBEDDED_DATA_SETS or d.data_dir is None,
             f"data.data_dir: the {d.name} data set ships inside the package and reads no directory; remove "
             "data_dir (or --data-dir), or choose a data set that reads one")
    need(c.tensorboard is None or c.tensorboard != "", "tensorboard: expected a folder, got ''")


# Keras's dtype policies a run may train under (keras.mixed_precision.set_global_policy).
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def check_engine_precision(c):
    """Raises ConfigError when C's precision cannot train C's rule through crossbow's engine on the
    workers of its TF_CONFIG (policy.precision_refused)."""
    refused = policy.precision_refused(c.precision, _tf_config_workers(), make_rule(c.algorithm))
    if refused:
        raise ConfigError(f"precision: {refused}; train on one worker, or use mixed_bfloat16 or float32")


def _tf_config_workers():
    """The number of workers TF_CONFIG names (1 without it; the cluster's own reader reports a bad one)."""
    import json
    try:
        workers = json.loads(os.environ.get("TF_CONFIG", "").strip() or "{}").get("cluster", {}).get("worker", [])
    except (ValueError, AttributeError):
        return 1
    return max(len(workers), 1) if isinstance(workers, list) else 1


def check_fits_data(c, learners=True, train_size=None, devices=None):
    """Raises ConfigError when one iteration of C takes more examples than the training set holds
    (an error, not an out-of-memory kill hours later). LEARNERS: whether learners_per_device applies
    (engine methods; the stock baseline has one replica per device). TRAIN_SIZE and DEVICES default
    to what is known before anything is loaded (KNOWN_TRAIN_SIZES; the logical CPU split, else 1)."""
    train_size = train_size if train_size is not None else KNOWN_TRAIN_SIZES.get(c.data.name)
    if train_size is None:
        return
    per_device = c.learners_per_device if learners and c.learners_per_device != "auto" else 1
    replicas = (devices or c.devices.logical_cpu or 1) * per_device
    if replicas * c.batch_size > train_size:
        raise ConfigError(
            f"batch_size: {replicas} {'learner' if learners else 'replica'}(s) x batch {c.batch_size} = "
            f"{replicas * c.batch_size} examples per iteration, more than the {train_size} training "
            f"examples of {c.data.name}")


# Top-level sections that belong to the harness (crossbow_tf.compare) and baselines/: one YAML file
# can describe an experiment and its comparison. They split them off (baselines/_cli.py) before
# validating the experiment; an experiment given to crossbow_tf.run must not hold them, since it
# would silently not use them.
TOOL_SECTIONS = ("compare", "sweep", "tf_ssgd")
SECTION_READERS = {"compare": "crossbow-compare", "sweep": "crossbow-sweep and crossbow-compare",
                   "tf_ssgd": "python -m baselines.tf_ssgd"}


def from_dict(mapping):
    """The validated ExperimentConfig of MAPPING (no tool sections); raises ConfigError naming the key."""
    if isinstance(mapping, dict):
        for name in TOOL_SECTIONS:
            if name in mapping:
                raise ConfigError(f"{name}: this section is read by {SECTION_READERS[name]}, not by "
                                  "crossbow_tf.run; run it with that tool or remove the section")
    return _validate(_build(ExperimentConfig, mapping, ""))


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate keys (the last one would silently win) and reading
    1e6 and 1.0e-3 as numbers (YAML 1.1 needs a dot and a signed exponent: 1.0e+6)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


StrictLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"""),
    list("-+0123456789."))


def parse_yaml(text):
    """The document in TEXT, read with StrictLoader."""
    return yaml.load(text, Loader=StrictLoader)


def _yaml_problem(error):
    """One line for a YAML error: what is wrong and where."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(error).split())
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def read_yaml(path):
    """The mapping in YAML file PATH (StrictLoader: safe, no duplicate keys); ConfigError names the problem."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path, encoding="utf-8") as f:
            mapping = parse_yaml(f.read())
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(e)})") from None
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(mapping).__name__}")
    return mapping


def load_config(path):
    """Reads and validates the YAML experiment at PATH; raises ConfigError naming the problem."""
    mapping = read_yaml(path)
    try:
        return from_dict(mapping)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_dict(config):
    return dataclasses.asdict(config)


# The command-line flags that override a key of the experiment: {argument's dest: dotted key}.
COMMAND_LINE_OVERRIDES = {"data_dir": "data.data_dir", "epochs": "epochs", "batch_size": "batch_size",
                          "learning_rate": "learning_rate.base", "learners_per_device": "learners_per_device",
                          "logical_cpu_devices": "devices.logical_cpu", "seed": "seed", "tensorboard": "tensorboard",
                          "precision": "precision", "checkpoint_dir": "checkpoint.dir",
                          "on_divergence": "on_divergence"}


def apply_overrides(mapping, args):
    """Sets in MAPPING (a to_dict) each key whose flag ARGS (an argparse namespace, which may lack
    some flags) gives; returns whether any was given."""
    given = False
    for dest, key in COMMAND_LINE_OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        *parents, last = key.split(".")
        target = mapping
        for parent in parents:
            target = target[parent]
        target[last] = value
        given = True
    return given
