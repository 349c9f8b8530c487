"""The replicated learner computation: one ``stateless_call`` per learner on the device's stack.

Works for any Keras model. A fused computation (all learners of a device as one grouped
computation) can replace it behind the same signature.
"""
import tensorflow as tf


def per_example_loss_fn(loss):
    """A function (y_true, y_pred) -> per-example losses from a Keras loss object or function."""
    call = getattr(loss, "call", None)
    if call is not None:
        return call
    return loss


def masked_mean(per_example, mask):
    per_example = tf.reshape(per_example, [tf.shape(mask)[0], -1])
    per_example = tf.reduce_mean(per_example, axis=1)
    count = tf.reduce_sum(mask)
    return tf.reduce_sum(per_example * mask) / tf.maximum(count, 1.0)


class ReplicatedLearners:
    """Gradients of M learners of one Keras model, each with its own weights and state."""

    fused = False

    def __init__(self, model, loss):
        self.model = model
        self.per_example_loss = per_example_loss_fn(loss)

    def __call__(self, weights, states, x, y, mask):
        """Runs every learner on its slice.

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
                loss = masked_mean(self.per_example_loss(y[i], y_pred), mask[i])
                if extra:
                    loss = loss + tf.add_n(extra)
            grads.append(tape.gradient(loss, w_i, unconnected_gradients=tf.UnconnectedGradients.ZERO))
            losses.append(loss)
            new_states.append(s_new)
            preds.append(y_pred)
        stack = lambda per_learner: [tf.stack(list(t)) for t in zip(*per_learner)]
        return tf.stack(losses), stack(grads), stack(new_states), tf.stack(preds)
