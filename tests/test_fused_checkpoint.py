"""A fused transformer trained with SMA through Keras's fit, stopped and resumed from its
BackupAndRestore checkpoint, ends bit for bit where an uninterrupted run ends: z, every learner's
weights, every optimizer slot, and the Dropout seed states (so the learners' draws continue where they
stopped) - issue 26, part 4. The model is keras-io's text classifier in small: Embedding, a custom
positional-embedding layer, MultiHeadAttention, LayerNormalization, Dropout and Dense.
"""
import os

import keras
import numpy as np
import pytest
from keras import layers

from crossbow_tf import use_sma
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.fused import FusedLearners
from crossbow_tf.keras.sma import get_training
from conftest import DEVICES   # the test session's logical CPU devices

VOCAB, LENGTH, DIM, EPOCHS, STOP_AT = 30, 8, 8, 2, 1


class TokenAndPositionEmbedding(layers.Layer):
    """keras-io's: a token embedding plus a learned embedding of each position (the generic form)."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(keras.ops.arange(start=0, stop=keras.ops.shape(x)[-1], step=1))
        return self.token_emb(x) + positions


def transformer(seed):
    keras.utils.set_random_seed(seed)
    inputs = layers.Input((LENGTH,), dtype="int32")
    x = TokenAndPositionEmbedding(LENGTH, VOCAB, DIM)(inputs)
    attention = layers.Dropout(0.2)(layers.MultiHeadAttention(num_heads=2, key_dim=DIM)(x, x))
    x = layers.LayerNormalization(epsilon=1e-6)(x + attention)
    ffn = layers.Dropout(0.2)(layers.Dense(DIM)(layers.Dense(16, activation="relu")(x)))
    x = layers.LayerNormalization(epsilon=1e-6)(x + ffn)
    x = layers.Dropout(0.2)(layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inputs, layers.Dense(2, activation="softmax")(x))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model = use_sma(model, CrossbowStrategy(devices=DEVICES[:1], learners_per_device=2))
    # XLA's compile of the learners' Adam update was 2/3 of this file's time; what is checkpointed is
    # the same without it (tests/test_checkpoint.py resumes engines with the XLA update).
    get_training(model)._engine_options["jit_update"] = False
    return model


def task(n=64, seed=0):
    """Label: whether token 1 occurs more often than token 2."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, (n, LENGTH)).astype("int32")
    return x, ((x == 1).sum(1) > (x == 2).sum(1)).astype("int32")


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == STOP_AT:
            raise RuntimeError("interrupted")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(reference, resumed, the interrupted run's state at its checkpoint): both trained EPOCHS epochs."""
    x, y = task()
    fit = dict(x=x, y=y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0)
    reference = transformer(seed=1)
    reference.fit(**fit)
    backup = str(tmp_path_factory.mktemp("fused_checkpoint") / "backup")
    interrupted = transformer(seed=1)
    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted.fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    stopped = [v.numpy() for v in get_training(interrupted).state_variables()]
    assert os.path.exists(os.path.join(backup, "latest.weights.h5.crossbow.npz"))
    resumed = transformer(seed=99)   # a new process builds a new model: other weights and seeds
    history = resumed.fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert history.epoch == [STOP_AT]
    return reference, resumed, stopped


def test_the_learners_ran_fused(runs):
    reference, resumed, _ = runs
    for model in (reference, resumed):
        assert isinstance(get_training(model).engine.learner_computation, FusedLearners)
        assert get_training(model).engine.learner_computation.fused


def test_resumed_run_equals_the_uninterrupted_run_bit_for_bit(runs):
    reference, resumed, stopped = runs
    ours, theirs = get_training(resumed).state_variables(), get_training(reference).state_variables()
    assert len(ours) == len(theirs) == len(stopped) > 40
    moved = 0
    for a, b, before in zip(ours, theirs, stopped, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a.numpy(), b.numpy())
        moved += not np.array_equal(a.numpy(), before)
    # The last epoch moved z, the learners, their Adam slots and the Dropout seeds past the checkpoint.
    assert moved > len(ours) // 2
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed.optimizer.iterations.numpy() == reference.optimizer.iterations.numpy() == EPOCHS * 4


def test_each_learner_keeps_drawing_from_its_own_dropout_seed(runs):
    """The seed states the resumed run ends with are the uninterrupted run's, and differ per learner."""
    reference, resumed, stopped = runs
    engine = get_training(resumed).engine
    seeds = [s.numpy() for d in engine.states for s in d if s.dtype.is_integer]
    reference_seeds = [s.numpy() for d in get_training(reference).engine.states for s in d if s.dtype.is_integer]
    assert len(seeds) == len(reference_seeds) == 3   # the 3 Dropout layers' generators (one device)
    for ours, theirs in zip(seeds, reference_seeds, strict=True):
        np.testing.assert_array_equal(ours, theirs)
        assert len({tuple(row) for row in ours}) == ours.shape[0]   # each learner its own seed
        assert (ours[:, 1] == EPOCHS * 4).all()   # one draw per step, across the stop
