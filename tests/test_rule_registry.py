"""The registry in crossbow_tf.algorithms is the list of rules: use_sma takes every name in it."""
import keras
import numpy as np
import pytest

from crossbow_tf.algorithms import ALGORITHMS
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.keras import get_training, use_sma
from test_engine_reference import LOSS, small_mlp, toy_data


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_use_sma_takes_every_registry_name(name, cpu_devices):
    x, y = toy_data()
    model = small_mlp()
    before = [v.numpy() for v in model.trainable_variables]
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS)
    use_sma(model, CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2), algorithm=name)
    assert isinstance(get_training(model).engine.algorithm, ALGORITHMS[name])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after = [v.numpy() for v in model.trainable_variables]
    assert max(np.abs(a - b).max() for a, b in zip(after, before, strict=True)) > 1e-3
