"""The generic fused form: custom layers' own calls vectorized over the learners compute what
replicated learners compute (forward, gradients and SMA steps), masks and dropout included."""
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.algorithms import SMA
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.fused import FusedLearners
from crossbow_tf.engine.replicated import ReplicatedLearners

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
VOCAB, LENGTH, CLASSES = 20, 6, 3


class Scaled(keras.layers.Layer):
    """Its own weights, on any rank: x * scale + shift, then tanh (a mask passes through)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="random_normal")
        self.shift = self.add_weight(shape=(shape[-1],), initializer="random_normal")

    def call(self, x):
        return keras.ops.tanh(x * self.scale + self.shift)


class DropoutBlock(keras.layers.Layer):
    """Dense then Dropout, called without a training argument: the outer training flag must reach it."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, activation="relu")
        self.dropout = keras.layers.Dropout(0.4)
        self.supports_masking = True

    def call(self, x):
        return self.dropout(self.dense(x))


class MaskedMean(keras.layers.Layer):
    """The mean over the unmasked steps: what it returns depends on the mask it is given."""

    def call(self, x, mask=None):
        weights = keras.ops.cast(mask, x.dtype)[..., None]
        return keras.ops.sum(x * weights, axis=1) / keras.ops.maximum(keras.ops.sum(weights, axis=1), 1.0)


def text_model():
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
    x = Scaled()(DropoutBlock(8)(x))
    x = Scaled()(MaskedMean()(x))
    return keras.Model(tokens, keras.layers.Dense(CLASSES, dtype="float32")(x))


def run(learners, devices, m=3, b=4, steps=3, lr=0.1):
    keras.utils.set_random_seed(0)
    model = text_model()
    initial = [w.numpy() for w in model.trainable_variables]
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=devices, learners_per_device=m),
                    learners=learners)
    rng = np.random.default_rng(0)
    kb = engine.num_learners * b
    losses = []
    for _ in range(steps):
        x = rng.integers(0, VOCAB, (kb, LENGTH)).astype(np.int32)
        x[:, LENGTH // 2:] *= rng.random((kb, LENGTH - LENGTH // 2)) < 0.5   # padding, so masks matter
        y = rng.integers(0, CLASSES, kb).astype(np.int32)
        loss, _ = engine.train_step(x, y, np.ones(kb), lr)
        losses.append(float(loss))
    return engine, losses, initial


def assert_same(devices, atol):
    fused, losses_f, initial = run("fused", devices)
    replicated, losses_r, _ = run("replicated", devices)
    assert isinstance(fused.learner_computation, FusedLearners) and isinstance(replicated.learner_computation, ReplicatedLearners)
    np.testing.assert_allclose(losses_f, losses_r, atol=atol, rtol=0)
    moved = 0.0
    for la, lb in zip(fused.learner_weights(), replicated.learner_weights(), strict=True):
        assert len(la) == len(lb) == len(initial)
        for a, b, w0 in zip(la, lb, initial, strict=True):
            np.testing.assert_allclose(a, b, atol=atol, rtol=0)
            moved = max(moved, float(np.abs(a - w0).max()))
    assert moved > 100 * atol   # training moved the weights far beyond the tolerance
    for a, b in zip(fused.center_weights(), replicated.center_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
    for a, b in zip([s.numpy() for d in fused.states for s in d],
                    [s.numpy() for d in replicated.states for s in d], strict=True):
        np.testing.assert_array_equal(a, b)   # seed generator states advance alike


def test_generic_form_equals_replicated_on_custom_layers(cpu_devices, caplog):
    with caplog.at_level(logging.WARNING, logger="crossbow_tf"):
        assert_same(cpu_devices[:2], atol=2e-5)
    assert not [r for r in caplog.records if r.name == "crossbow_tf"]


def test_generic_form_equals_replicated_under_mixed_bfloat16(cpu_devices):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        assert_same(cpu_devices[:1], atol=1e-3)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_the_output_depends_on_the_mask_and_learners_draw_their_own_dropout(cpu_devices):
    """Same data and weights for both learners: only their own dropout masks separate them; padding
    changes what a learner computes only through the mask."""
    keras.utils.set_random_seed(1)
    engine = Engine(text_model(), LOSS, SMA(alpha=0.0, momentum=0.0),
                    CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2), learners="fused")
    x = np.array([[3, 4, 5, 0, 0, 0]] * 4, np.int32)
    y = np.zeros(4, np.int32)
    engine.train_step(np.concatenate([x, x]), np.concatenate([y, y]), np.ones(8), 0.1)
    first, second = engine.learner_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(first, second, strict=True))


class Unvectorizable(keras.layers.Layer):
    """An op TensorFlow has no vectorization for (tf.unique)."""

    def call(self, x):
        values, index = tf.unique(tf.reshape(tf.cast(x > 0, tf.int32), [-1]))
        return x + tf.cast(tf.size(values), x.dtype)


def test_layers_that_cannot_vectorize_run_per_learner_with_one_notice_naming_all(cpu_devices, caplog):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = Unvectorizable(name="first_odd")(keras.layers.Dense(4)(inputs))
    x = Unvectorizable(name="second_odd")(Scaled(name="fine")(x))
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(x))
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2),
                    learners="fused")
    rng = np.random.default_rng(0)
    with caplog.at_level(logging.WARNING, logger="crossbow_tf"):
        for _ in range(2):
            loss, _ = engine.train_step(rng.random((4, 4), dtype=np.float32), np.zeros(4, np.int32), np.ones(4), 0.1)
    assert np.isfinite(float(loss))
    notices = [r.getMessage() for r in caplog.records if r.name == "crossbow_tf"]
    assert len(notices) == 1
    assert "'first_odd'" in notices[0] and "'second_odd'" in notices[0] and "Unique" in notices[0]
    assert "'fine'" not in notices[0]


class SparseOutput(keras.layers.Layer):
    """An op TensorFlow cannot vectorize (tf.unique), and a SparseTensor out: the learners' outputs of its
    call once per learner cannot be stacked either, so it cannot run in the fused computation at all."""

    def call(self, x):
        values, _ = tf.unique(tf.reshape(tf.cast(x > 0, tf.int32), [-1]))
        return tf.sparse.from_dense(x + tf.cast(tf.size(values), x.dtype))

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype, sparse=True)


class Densify(keras.layers.Layer):
    def call(self, x):
        return tf.sparse.to_dense(x)

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype)


def sparse_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = Densify()(SparseOutput(name="sparse_out")(keras.layers.Dense(4)(inputs)))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def train_sparse_model(learners, devices, steps=3):
    engine = Engine(sparse_model(), LOSS, SMA(), CrossbowStrategy(devices=devices, learners_per_device=2),
                    learners=learners)
    rng = np.random.default_rng(0)
    losses = [float(engine.train_step(rng.standard_normal((4, 4)).astype(np.float32),
                                      rng.integers(0, CLASSES, 4).astype(np.int32), np.ones(4), 0.1)[0])
              for _ in range(steps)]
    return engine, losses


def test_a_layer_that_fails_once_per_learner_too_runs_the_model_replicated_with_one_notice(cpu_devices, caplog):
    with caplog.at_level(logging.WARNING, logger="crossbow_tf"):
        fused_engine, fused_losses = train_sparse_model("fused", cpu_devices[:1])
    replicated_engine, replicated_losses = train_sparse_model("replicated", cpu_devices[:1])
    assert isinstance(fused_engine.learner_computation, FusedLearners) and not fused_engine.learner_computation.fused
    assert len(fused_losses) == len(replicated_losses) == 3 and fused_losses[0] != fused_losses[-1]
    np.testing.assert_array_equal(fused_losses, replicated_losses)
    for ours, theirs in zip(fused_engine.learner_weights(), replicated_engine.learner_weights(), strict=True):
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a, b)
    notices = [r.getMessage() for r in caplog.records if r.name == "crossbow_tf"]
    assert len(notices) == 1, notices
    assert "learners run replicated" in notices[0] and "'sparse_out' (SparseOutput)" in notices[0]
    assert "op Unique" in notices[0] and "once per learner inside the fused computation failed too" in notices[0]
