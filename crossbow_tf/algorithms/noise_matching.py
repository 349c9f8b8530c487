"""Noise matching: the averaged steps of adaptive learners made the size of one step at the global batch.

An adaptive optimizer (Adam, RMSprop, ...) divides each coordinate's step by the root of its running
mean square gradient. A learner's gradient on b = B/k examples has k times the noise variance of the
B-example gradient, so its denominator is larger than one model's at B would be, and where noise
dominates the mean of the k learners' steps carries up to sqrt(k) times less signal than one step
at B: averaged, the learners train as one model at a lower rate (docs/keras.md has the measurements).
Per coordinate the shortfall is the factor

    f = sqrt(E[g_b^2] / E[g_B^2]),   clipped to [1, sqrt(k)],

with E[g_b^2] estimated as the running mean (decay DECAY: the optimizer's own) of the learners' mean
square gradient and E[g_B^2] as the running mean of the square of their mean gradient, which is the
B-example gradient. Where the learners' gradients agree f is 1, where they are pure noise sqrt(k).

Noise matching moves z and every learner on by the same translation (f - 1) * s, s the learners'
mean step, so that z advances f * s, one step of the optimizer at B, while each learner's own noise
is not amplified and its distance to z, which the rule's correction and its stability act on, is the
rule's own. (Stretching each learner's own step by f instead gives the same mean but lets every
learner walk sqrt(k) times further on its own noisy gradient: with RMSprop at a rate near its edge
that diverged, docs/keras.md.)

Both running means start at 0 and share their decay, so their bias (1 - DECAY^t) cancels in the ratio.
The functions are pure and elementwise: NumPy arrays or TensorFlow tensors, one weight at a time.
"""
import numpy as np


def _math(x):
    if isinstance(x, (np.ndarray, np.generic, float, int)):
        return np
    import tensorflow as tf
    return tf.math


def update_statistics(learner_square, global_square, learners_mean_square, mean_gradient, decay):
    """The running means after one iteration: LEARNER_SQUARE of the learners' mean square gradient
    (this iteration's LEARNERS_MEAN_SQUARE) and GLOBAL_SQUARE of the square of their MEAN_GRADIENT."""
    return (decay * learner_square + (1.0 - decay) * learners_mean_square,
            decay * global_square + (1.0 - decay) * mean_gradient * mean_gradient)


def step_factor(learner_square, global_square, num_learners):
    """Per coordinate, the factor f on every learner's step (1 before any statistics exist)."""
    ops = _math(learner_square)
    # The smallest normal float32 keeps 0 / 0 at 1 (a weight no gradient has reached) and x / 0
    # at sqrt(k), without a division by zero.
    tiny = np.finfo(np.float32).tiny
    ratio = (learner_square + tiny) / (global_square + tiny)
    return ops.sqrt(ops.minimum(ops.maximum(ratio, 1.0), float(num_learners)))


def translation(mean_step, learner_square, global_square, num_learners):
    """How far z and every learner move on after an iteration whose learners' mean step was MEAN_STEP."""
    return (step_factor(learner_square, global_square, num_learners) - 1.0) * mean_step
