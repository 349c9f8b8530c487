"""z's BatchNorm statistics recomputed on training data before it is evaluated (Keras path).

SMA's z carries the mean of its learners' BatchNorm statistics, which need not be the statistics
of z's own averaged weights; `RecomputeBatchNorm` replaces them with the average of z's batch
statistics over a few training batches before every evaluation (fit's validation, `evaluate`)
and when fit ends (so that `predict` and `save` see them too). docs/keras.md gives the cost.
"""
import keras
import tensorflow as tf

from crossbow_tf.engine.diagnostics import recompute_batchnorm


class RecomputeBatchNorm(keras.callbacks.Callback):
    """Recomputes z's BatchNorm statistics on BATCHES batches of BATCH_SIZE training inputs X
    (an array, a tuple (x, y) or a tf.data.Dataset of single examples or (x, y) pairs), taken once
    in a seeded order."""

    def __init__(self, x, batches=8, batch_size=500, seed=0):
        super().__init__()
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"RecomputeBatchNorm: batches must be a positive integer, got {batches!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"RecomputeBatchNorm: batch_size must be a positive integer, got {batch_size!r}")
        ds = x if isinstance(x, tf.data.Dataset) else tf.data.Dataset.from_tensor_slices(x)
        ds = ds.map(lambda *e: e[0]) if isinstance(ds.element_spec, tuple) else ds
        self._inputs = ds.shuffle(10000, seed=seed, reshuffle_each_iteration=False).take(batches * batch_size) \
            .batch(batch_size).cache()
        self.recomputed = 0          # evaluations that ran with recomputed statistics

    def _recompute(self):
        recompute_batchnorm(self.model, iter(self._inputs))
        self.recomputed += 1

    def on_test_begin(self, logs=None):
        self._recompute()

    def on_train_end(self, logs=None):
        self._recompute()
