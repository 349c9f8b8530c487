"""The arguments each learners' optimizer takes, without Keras or TensorFlow.

Keras's optimizers refuse an argument they do not know ("Argument(s) not recognized") only when
they are built, after TensorFlow has started; this table lets the config (and so ``--check``)
refuse it before. It is Keras's own signatures written down: tests/test_optimizer_args.py checks
that it equals ``inspect.signature`` of every optimizer class of the installed Keras.
"""
from crossbow_tf.errors import ConfigError

# keras.optimizers.Optimizer's own arguments, which every optimizer takes (learning_rate is the
# config's learning_rate's, name is the optimizer's name key here).
COMMON_ARGUMENTS = ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum",
                    "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps")

# keras.optimizers.get's name: (class name, the arguments of its own besides COMMON_ARGUMENTS).
OPTIMIZER_ARGUMENTS = {
    "sgd": ("SGD", ("momentum", "nesterov")),
    "adam": ("Adam", ("beta_1", "beta_2", "epsilon", "amsgrad")),
    "adamw": ("AdamW", ("beta_1", "beta_2", "epsilon", "amsgrad")),
    "rmsprop": ("RMSprop", ("rho", "momentum", "epsilon", "centered")),
    "adagrad": ("Adagrad", ("initial_accumulator_value", "epsilon")),
    "adadelta": ("Adadelta", ("rho", "epsilon")),
    "adamax": ("Adamax", ("beta_1", "beta_2", "epsilon")),
    "nadam": ("Nadam", ("beta_1", "beta_2", "epsilon")),
    "lion": ("Lion", ("beta_1", "beta_2")),
    "ftrl": ("Ftrl", ("learning_rate_power", "initial_accumulator_value", "l1_regularization_strength",
                      "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta")),
}


def arguments_of(name):
    """Every argument optimizer NAME (a key of OPTIMIZER_ARGUMENTS) takes from an ``optimizer:`` mapping."""
    return OPTIMIZER_ARGUMENTS[name][1] + COMMON_ARGUMENTS


def check_optimizer_arguments(spec):
    """Raises ConfigError naming the first key of SPEC (an ``optimizer:`` mapping whose name is a key
    of OPTIMIZER_ARGUMENTS; ``name`` and keys other checks own are skipped by the caller) that the
    optimizer's signature does not have."""
    name = spec["name"].lower()
    class_name, _ = OPTIMIZER_ARGUMENTS[name]
    takes = arguments_of(name)
    for key in spec:
        if key != "name" and key not in takes:
            raise ConfigError(f"optimizer.{key}: {class_name} takes no argument {key!r}; "
                              f"it takes {', '.join(takes)}")
