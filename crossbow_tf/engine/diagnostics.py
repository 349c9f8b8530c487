"""Per-epoch diagnostics of the learners, and z's BatchNorm statistics recomputed on training data.

Why SMA needs more epochs where it does: learners drifting apart (their mean distance to z grows)
and an average that no learner is (a learner's accuracy well above z's), against a central model
that lags (a learner no better than z). `learner_report` measures both; it reads the engine's
variables through its state (crossbow_tf.engine.state) and writes the model only through
``write_learner_to_model`` / ``write_center_to_model``.

BatchNorm: z's statistics are the mean of the learners' statistics, which need not match z's
averaged weights (stochastic weight averaging recomputes them for this reason). `recompute_batchnorm`
sets them to the exact average over a few training batches of z's own batch statistics.
"""
import numpy as np
import tensorflow as tf
from keras import layers as L

def mean_distance_to_center(engine):
    """Mean over learners j of ||w_j - z||_2 over all trainable weights (0 for gradient-at-z methods)."""
    if engine.algorithm.gradient_at_center:
        return 0.0
    squares = []
    for device in engine.state.devices:
        with tf.device(device.device):
            per = [tf.reduce_sum(tf.reshape(tf.square(w - z[None]), [w.shape[0], -1]), axis=1)
                   for w, z in zip(device.weights, device.center)]
            squares.append(tf.add_n(per).numpy())
    return float(np.mean(np.sqrt(np.concatenate(squares))))


def center_norm(engine):
    return float(np.sqrt(sum(float(np.sum(np.square(z))) for z in engine.state.center_arrays())))


def write_learner_to_model(engine, j):
    """Copies learner J's weights and float state into the engine's model (z is restored by
    ``engine.write_center_to_model``)."""
    engine.state.write_learner_to(engine.model, j)


def recompute_batchnorm(model, batches):
    """Sets MODEL's BatchNorm moving statistics to the average of its batch statistics over
    BATCHES (an iterable of input batches), with the model's weights fixed. Returns the number of
    batches used; 0 when the model has no BatchNorm."""
    norms = [layer for layer in model._flatten_layers() if isinstance(layer, L.BatchNormalization)]
    if not norms:
        return 0
    saved = [layer.momentum for layer in norms]
    for layer in norms:
        layer.moving_mean.assign(tf.zeros_like(layer.moving_mean))
        layer.moving_variance.assign(tf.zeros_like(layer.moving_variance))
    n = 0
    try:
        for x in batches:
            n += 1
            for layer in norms:   # moving = moving * momentum + batch * (1 - momentum): a running mean
                layer.momentum = (n - 1) / n
            model(x, training=True)
    finally:
        for layer, momentum in zip(norms, saved):
            layer.momentum = momentum
    return n
