"""Typed, validated experiment configuration, read from YAML with PyYAML's safe loader."""
import dataclasses
import os
import typing

import yaml

from crossbow_tf.errors import ConfigError

@dataclasses.dataclass
class DataConfig:
    name: str = "mnist_embedded"
    data_dir: typing.Optional[str] = None


@dataclasses.dataclass
class AlgorithmConfig:
    name: str = "sma"                       # sma | ssgd | easgd
    alpha: typing.Optional[float] = None    # None: 1/k for SMA, 0.9/k for EASGD
    momentum: float = 0.9
    central_momentum: float = 0.9
    weight_decay: float = 0.0


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
    batch_size: int = 16                     # b: the batch of one learner
    learning_rate: LearningRateConfig = dataclasses.field(default_factory=LearningRateConfig)
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


def _check_type(path, value, annotation):
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union:
        errors = []
        for option in args:
            try:
                return _check_type(path, value, option)
            except ConfigError as e:
                errors.append(e)
        names = " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
        raise ConfigError(f"{path}: expected {names}, got {value!r}")
    if annotation is type(None):
        if value is not None:
            raise ConfigError(f"{path}: expected null, got {value!r}")
        return None
    if origin in (list, typing.List):
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_check_type(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value, path)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(annotation)


def _build(cls, mapping, path):
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {mapping!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - fields)
    if unknown:
        raise ConfigError(f"{path + '.' if path else ''}{unknown[0]}: unknown key; "
                          f"known keys are {', '.join(sorted(fields))}")
    values = {name: _check_type(f"{path + '.' if path else ''}{name}", value, hints[name])
              for name, value in mapping.items()}
    return cls(**values)


def _validate(c):
    def need(ok, message):
        if not ok:
            raise ConfigError(message)
    need(c.algorithm.name in ("sma", "ssgd", "easgd"),
         f"algorithm.name: unknown algorithm {c.algorithm.name!r}; choose sma, ssgd or easgd")
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
    for name in ("momentum", "central_momentum"):
        value = getattr(c.algorithm, name)
        need(0 <= value < 1, f"algorithm.{name}: must be in [0, 1), got {value}")
    need(c.algorithm.weight_decay >= 0, "algorithm.weight_decay: must not be negative")
    need(c.algorithm.alpha is None or 0 < c.algorithm.alpha <= 1,
         f"algorithm.alpha: must be in (0, 1] or null, got {c.algorithm.alpha}")
    need(c.target_accuracy is None or 0 < c.target_accuracy <= 1,
         f"target_accuracy: must be in (0, 1], got {c.target_accuracy}")
    need(c.collapse_epochs >= 0, f"collapse_epochs: must not be negative (0 turns the check off), got {c.collapse_epochs}")
    need(c.batchnorm_eval in ("averaged", "recomputed", "both"),
         f"batchnorm_eval: unknown {c.batchnorm_eval!r}; choose averaged, recomputed or both")
    need(c.batchnorm_batches >= 1, f"batchnorm_batches: must be at least 1, got {c.batchnorm_batches}")
    need(c.devices.logical_cpu is None or c.devices.logical_cpu >= 1,
         f"devices.logical_cpu: must be at least 1, got {c.devices.logical_cpu}")
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
    return c


# Top-level sections that belong to tools/ and baselines/ (read by them, set aside here), so that
# one YAML file can describe an experiment and its comparison.
TOOL_SECTIONS = ("compare", "sweep", "tf_ssgd")


def from_dict(mapping):
    if isinstance(mapping, dict):
        mapping = {k: v for k, v in mapping.items() if k not in TOOL_SECTIONS}
    return _validate(_build(ExperimentConfig, mapping, ""))


def read_yaml(path):
    """The mapping in YAML file PATH (PyYAML's safe loader); ConfigError names the problem."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path) as f:
            mapping = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
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
