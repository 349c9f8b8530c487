"""Keras's fit falls back without XLA when XLA cannot compile the engine's first step, as the
engine's own train_step does: one line, then the same training as a run without XLA."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf import CrossbowStrategy
from crossbow_tf.keras import get_training, use_sma


def _data(n=96, features=6, classes=3):
    rng = np.random.default_rng(0)
    return rng.random((n, features), dtype=np.float32), rng.integers(0, classes, n).astype(np.int32)


def _model(strategy):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return use_sma(model, strategy)


def test_fit_falls_back_without_xla_when_xla_fails_on_the_first_step(cpu_devices, capsys):
    x, y = _data()
    reference = _model(CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    get_training(reference).engine._build_steps(False, False)   # the same training, never with XLA
    model = _model(CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    engine = get_training(model).engine
    start = [w.numpy().copy() for w in model.trainable_variables]

    def no_ptxas(*args):
        raise tf.errors.InternalError(None, None, "XLA compilation requires ptxas: Couldn't find ptxas")
    engine._local_update = no_ptxas   # what a GPU without CUDA's ptxas raises at the first launch
    assert engine.jit_update and not engine.xla_checked
    for m in (reference, model):
        m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert capsys.readouterr().err.count("note: XLA failed on the first step") == 1
    assert (engine.jit_update, engine.jit_compile) == (False, False) and engine.xla_checked
    got, want = model.trainable_variables, reference.trainable_variables
    assert len(got) == len(want) == len(start) == 4
    assert max(np.abs(w.numpy() - s).max() for w, s in zip(got, start, strict=True)) > 1e-2   # z moved
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_fit_raises_an_error_that_is_not_xlas(cpu_devices):
    x, y = _data()
    model = _model(CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2))

    def not_xla(*args):
        raise tf.errors.InvalidArgumentError(None, None, "labels out of range")
    get_training(model).engine._local_update = not_xla
    with pytest.raises(tf.errors.InvalidArgumentError, match="labels out of range"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
