"""crossbow_tf.optimizer_args's table is Keras's own signatures, and the config refuses what Keras refuses."""
import inspect

import keras
import pytest
from keras.src.optimizers.base_optimizer import BaseOptimizer

from crossbow_tf import config as config_lib
from crossbow_tf.errors import ConfigError
from crossbow_tf.optimizer_args import COMMON_ARGUMENTS, OPTIMIZER_ARGUMENTS, arguments_of

NOT_IN_THE_MAPPING = {"self", "learning_rate", "name"}   # the config's learning_rate, the name key


def _named(function):
    return {p.name for p in inspect.signature(function).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - NOT_IN_THE_MAPPING


def test_the_table_is_every_optimizer_and_its_keras_signature():
    assert tuple(OPTIMIZER_ARGUMENTS) == config_lib.OPTIMIZER_NAMES
    assert set(COMMON_ARGUMENTS) == _named(BaseOptimizer.__init__)
    for name, (class_name, _) in OPTIMIZER_ARGUMENTS.items():
        cls = type(keras.optimizers.get(name))
        assert cls.__name__ == class_name
        assert set(arguments_of(name)) == _named(cls.__init__) | _named(BaseOptimizer.__init__), name
        assert len(set(arguments_of(name))) == len(arguments_of(name)), name


@pytest.mark.parametrize("name", list(OPTIMIZER_ARGUMENTS))
def test_keras_builds_every_argument_the_table_allows_and_refuses_one_it_lacks(name):
    # Each argument by itself at a value of its type (Keras checks the values when it builds).
    values = {"nesterov": True, "amsgrad": True, "centered": True, "use_ema": True, "ema_overwrite_frequency": 10,
              "gradient_accumulation_steps": 2, "learning_rate_power": -0.5}
    for argument in arguments_of(name):
        config_lib.build_keras_optimizer({"name": name, argument: values.get(argument, 0.5)}, 0.01)
    with pytest.raises(ConfigError, match="refuses"):
        config_lib.build_keras_optimizer({"name": name, "beta_3": 0.5}, 0.01)
    with pytest.raises(ConfigError, match=f"optimizer.beta_3: {OPTIMIZER_ARGUMENTS[name][0]} takes no argument"):
        config_lib.from_dict({"optimizer": {"name": name, "beta_3": 0.5}})
