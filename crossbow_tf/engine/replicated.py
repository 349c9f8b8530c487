"""The replicated learner computation: one ``stateless_call`` per learner on the device's stack.

Works for any Keras model. A fused computation (all learners of a device as one grouped
computation) can replace it behind the same signature.
"""
import keras
import tensorflow as tf


def per_example_loss_fn(loss):
    """A function (y_true, y_pred) -> per-example losses from a Keras loss object or function.

    Float predictions are cast to the loss's dtype (float32 unless it says otherwise) first, as
    Keras's Loss.__call__ casts them: under a mixed-precision policy the model's outputs are in the
    compute dtype, but the loss is computed in float32."""
    call = getattr(loss, "call", None) or loss
    dtype = getattr(loss, "dtype", None) or "float32"

    def per_example(y_true, y_pred):
        y_pred = keras.tree.map_structure(
            lambda t: tf.cast(t, dtype) if t is not None and t.dtype.is_floating else t, y_pred)
        return call(y_true, y_pred)
    return per_example


def in_variable_dtypes(grads, weights):
    """GRADS in the dtypes of WEIGHTS (the variable dtype, float32 under a mixed policy): the
    update rules run in the weights' dtype."""
    return [tf.cast(g, w.dtype) for g, w in zip(grads, weights)]


def unscaled(grads, scale):
    """GRADS (float32) of a loss multiplied by SCALE, divided by it as Keras's LossScaleOptimizer does
    (SCALE None: the loss was not scaled)."""
    return grads if scale is None else [g / scale for g in grads]


def masked_mean(per_example, mask):
    per_example = tf.reshape(tf.cast(per_example, mask.dtype), [tf.shape(mask)[0], -1])
    per_example = tf.reduce_mean(per_example, axis=1)
    count = tf.reduce_sum(mask)
    return tf.reduce_sum(per_example * mask) / tf.maximum(count, 1.0)


class ReplicatedLearners:
    """Gradients of M learners of one Keras model, each with its own weights and state."""

    fused = False

    def __init__(self, model, loss):
        self.model, self.loss = model, loss
        self.per_example_loss = per_example_loss_fn(loss)

    def __call__(self, weights, states, x, y, mask, scale=None):
        """Runs every learner on its slice (SCALE: the loss scale its loss is multiplied by for the
        gradients, which come back divided by it; None: no loss scaling).

        Args:
          weights: list over trainable variables of stacks (m, ...).
          states: list over non-trainable variables of stacks (m, ...).
          x, y, mask: (m, b, ...) slices; MASK is 1.0 for real and 0.0 for padding examples.
        Returns:
          (losses (m,), grads: list of stacks, new states: list of stacks, predictions (m, b, ...)).
        """
        m = x.shape[0]
        losses, grads, new_states, preds = [], [], [], []
        for i in range(m):
            w_i = [w[i] for w in weights]
            s_i = [s[i] for s in states]
            with tf.GradientTape() as tape:
                tape.watch(w_i)
                # As Keras's own stateless trainers do: `training` only for a call() that takes it.
                training = {"training": True} if getattr(self.model, "_call_has_training_arg", True) else {}
                y_pred, s_new, extra = self.model.stateless_call(w_i, s_i, x[i], return_losses=True, **training)
                if hasattr(self.loss, "learner_loss"):   # the model's own compute_loss, add_loss terms included
                    loss = self.loss.learner_loss(x[i], y[i], y_pred, mask[i], w_i, s_new, extra)
                else:
                    loss = masked_mean(self.per_example_loss(y[i], y_pred), mask[i])
                    if extra:
                        loss = loss + tf.add_n([tf.cast(e, loss.dtype) for e in extra])
                scaled = loss if scale is None else loss * scale
            grads.append(unscaled(in_variable_dtypes(
                tape.gradient(scaled, w_i, unconnected_gradients=tf.UnconnectedGradients.ZERO), w_i), scale))
            losses.append(loss)
            new_states.append(s_new)
            preds.append(y_pred)
        stack = lambda per_learner: [tf.stack(list(t)) for t in zip(*per_learner)]
        return tf.stack(losses), stack(grads), stack(new_states), tf.stack(preds)
