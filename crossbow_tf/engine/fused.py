"""Fused learners: the m learners of a device run as one computation.

Learners are an axis, not a loop. Per-learner activations are kept in one of two layouts, chosen by
the rank of the single-learner tensor, so that the expensive layers need no transposes:
- images (b, H, W, C) -> (b, H, W, m, C): a Conv2D over all learners is one grouped convolution
  (input (b, H, W, m*C), filter (kh, kw, C, m*O)), pooling works on (b, H, W, m*C) unchanged;
- features (b, F) -> (m, b, F): a Dense over all learners is one batched matmul.
Flatten and global pooling move from the first layout to the second. BatchNorm keeps statistics
per learner; Dropout draws each learner's mask from that learner's own seed, exactly as Keras does,
so fused and replicated learners compute the same numbers.

The model's Keras graph is walked with each layer replaced by its fused form; a model with a layer
that has no fused form raises UnsupportedModel, and `make_learners` falls back to replicated
learners with a one-line notice.
"""
import logging

import keras
import tensorflow as tf
from keras import layers as L

from crossbow_tf.engine.replicated import ReplicatedLearners, masked_mean, per_example_loss_fn

log = logging.getLogger("crossbow_tf")

_ELEMENTWISE = (L.Activation, L.ReLU, L.LeakyReLU, L.ELU, L.Softmax, L.Add, L.Subtract, L.Multiply,
                L.Average, L.Maximum, L.Minimum)
_REGULARIZERS = ("kernel_regularizer", "bias_regularizer", "activity_regularizer",
                 "gamma_regularizer", "beta_regularizer")


class UnsupportedModel(ValueError):
    """The model has a layer (or use of one) without a fused form."""


def _graph_of(model):
    if isinstance(model, keras.Sequential):
        graph = getattr(model, "_functional", None)
        if graph is None:
            raise UnsupportedModel("a Sequential model without an Input cannot be walked")
        return graph
    if isinstance(model, keras.Model) and hasattr(model, "_run_through_graph") and hasattr(model, "_nodes_by_depth"):
        return model
    raise UnsupportedModel(f"subclassed model {type(model).__name__} has no layer graph to fuse")


def onednn_enabled():
    """True when TensorFlow runs oneDNN kernels in this process.

    TensorFlow's own CPU kernels compute no filter gradient of a grouped convolution (and its fused
    Conv2D+BiasAdd rejects groups); oneDNN's do. TensorFlow turns oneDNN on by default only on some
    CPUs (not on AMD EPYC, for example); importing crossbow_tf before TensorFlow turns it on.
    """
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return False
    return bool(_pywrap_util_port.IsMklEnabled())


def _why_unsupported(layer):
    """None when LAYER has a fused form, else the reason."""
    if isinstance(layer, L.InputLayer):
        return None
    for name in _REGULARIZERS:
        if getattr(layer, name, None) is not None:
            return f"it has a {name.replace('_', ' ')}"
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return "only channels_last is fused"
    if isinstance(layer, L.Conv2D) and type(layer) is L.Conv2D:
        if layer.groups != 1:
            return "grouped Conv2D is not fused"
        if layer.padding not in ("valid", "same"):
            return f"padding {layer.padding!r} is not fused"
        if not onednn_enabled():
            return ("the learners' grouped convolution needs oneDNN, which is off in this process "
                    "(set TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow is imported)")
        return None
    if type(layer) in (L.Dense, L.Flatten, L.Dropout, L.MaxPooling2D, L.AveragePooling2D,
                       L.GlobalAveragePooling2D, L.GlobalMaxPooling2D, L.ZeroPadding2D):
        if isinstance(layer, (L.GlobalAveragePooling2D, L.GlobalMaxPooling2D)) and layer.keepdims:
            return "keepdims=True is not fused"
        return None
    if type(layer) is L.BatchNormalization:
        if layer.renorm or layer.synchronized:
            return "renorm/synchronized BatchNormalization is not fused"
        return None
    if type(layer) is L.Concatenate:
        return None if layer.axis == -1 else "Concatenate along an axis other than the last is not fused"
    if type(layer) in _ELEMENTWISE:
        return None if not isinstance(layer, L.Softmax) or layer.axis in (-1, [-1]) else \
            "Softmax along an axis other than the last is not fused"
    return "it has no fused form"


# Activations that act on each element alone, so they may run on the merged (b, H, W, m*C) layout,
# where TensorFlow's optimiser fuses Conv2D, BiasAdd and the activation into one oneDNN call.
_ELEMENTWISE_ACTIVATIONS = frozenset(
    getattr(keras.activations, name) for name in (
        "linear", "relu", "relu6", "elu", "selu", "gelu", "sigmoid", "hard_sigmoid", "tanh", "swish",
        "silu", "softplus", "softsign", "leaky_relu", "exponential", "mish")
    if hasattr(keras.activations, name))


@tf.custom_gradient
def _learners_matmul(x, kernel):
    """x (m, b, F) @ kernel (m, F, O) per learner. For LeNet's small per-learner batches the forward
    pass runs faster as m plain matmuls than as one batched matmul (measured here: 1.7 ms against
    2.5 ms for 8 learners of 16 on a 1024x1024 kernel); the gradients are fastest batched."""
    y = tf.stack([tf.matmul(x_i, k_i) for x_i, k_i in zip(tf.unstack(x), tf.unstack(kernel))])

    def grad(dy):
        return tf.matmul(dy, kernel, transpose_b=True), tf.matmul(x, dy, transpose_a=True)
    return y, grad


def _cast_seed(seed):
    # The same seed conversion as Keras's TensorFlow backend, so masks match the replicated path.
    from keras.src.backend.tensorflow.random import _cast_seed as keras_cast_seed
    return keras_cast_seed(seed)


class FusedLearners:
    """Gradients of M learners of MODEL computed as one grouped computation (see module doc)."""

    fused = True

    def __init__(self, model, loss):
        graph = _graph_of(model)
        for layer in graph.operations:
            reason = _why_unsupported(layer)
            if reason is not None:
                raise UnsupportedModel(f"layer {layer.name!r} ({type(layer).__name__}): {reason}")
        for nodes in graph._nodes_by_depth.values():
            for node in nodes:
                for t in list(node.input_tensors) + list(node.output_tensors):
                    if len(t.shape) not in (2, 4):
                        name = node.operation.name if node.operation else "input"
                        raise UnsupportedModel(f"layer {name!r}: a tensor of rank {len(t.shape)}; only "
                                               "images (rank 4) and feature vectors (rank 2) are fused")
        self.model, self.graph = model, graph
        self.per_example_loss = per_example_loss_fn(loss)
        self._t_index = {id(v): i for i, v in enumerate(model.trainable_variables)}
        self._s_index = {id(v): i for i, v in enumerate(model.non_trainable_variables)}

    # ---- layouts ---------------------------------------------------------------------------
    @staticmethod
    def _to_fused(x):
        """(m, b, ...) stacked per-learner tensor -> fused layout."""
        if len(x.shape) == 5:
            return tf.transpose(x, [1, 2, 3, 0, 4])
        return x

    @staticmethod
    def _to_stacked(x):
        if len(x.shape) == 5:
            return tf.transpose(x, [3, 0, 1, 2, 4])
        return x

    @staticmethod
    def _merge(x):   # (b, H, W, m, C) -> (b, H, W, m*C)
        s = tf.shape(x)
        return tf.reshape(x, [s[0], s[1], s[2], x.shape[3] * x.shape[4]])

    @staticmethod
    def _split(x, m):   # (b, H, W, m*C) -> (b, H, W, m, C)
        s = tf.shape(x)
        return tf.reshape(x, [s[0], s[1], s[2], m, x.shape[3] // m])

    # ---- layers ----------------------------------------------------------------------------
    def _w(self, variable):
        """The learners' stack of VARIABLE: trainable, or frozen (kept with the non-trainable state)."""
        index = self._t_index.get(id(variable))
        if index is not None:
            return self._weights[index]
        return self._states[self._s_index[id(variable)]]

    def _apply(self, layer, inputs):
        m = self._m
        if isinstance(layer, L.Conv2D):
            x = inputs[0]
            kernel = self._w(layer.kernel)                        # (m, kh, kw, C, O)
            kh, kw, c, o = kernel.shape[1:]
            kernel = tf.reshape(tf.transpose(kernel, [1, 2, 3, 0, 4]), [kh, kw, c, m * o])
            y = tf.nn.conv2d(self._merge(x), kernel, strides=layer.strides, padding=layer.padding.upper(),
                             dilations=layer.dilation_rate)
            if layer.use_bias:
                y = tf.nn.bias_add(y, tf.reshape(self._w(layer.bias), [m * o]))
            if layer.activation in _ELEMENTWISE_ACTIVATIONS:
                return self._split(layer.activation(y), m)
            return layer.activation(self._split(y, m))
        if isinstance(layer, L.Dense):
            x = inputs[0]
            y = _learners_matmul(x, self._w(layer.kernel))
            if layer.use_bias:
                y = y + self._w(layer.bias)[:, None, :]
            return layer.activation(y)
        if isinstance(layer, L.Flatten):
            x = inputs[0]
            if len(x.shape) == 3:
                return x
            y = tf.transpose(x, [3, 0, 1, 2, 4])
            return tf.reshape(y, [m, tf.shape(y)[1], y.shape[2] * y.shape[3] * y.shape[4]])
        if isinstance(layer, (L.MaxPooling2D, L.AveragePooling2D)):
            pool = tf.nn.max_pool2d if isinstance(layer, L.MaxPooling2D) else tf.nn.avg_pool2d
            y = pool(self._merge(inputs[0]), layer.pool_size, layer.strides, layer.padding.upper())
            return self._split(y, m)
        if isinstance(layer, (L.GlobalAveragePooling2D, L.GlobalMaxPooling2D)):
            reduce = tf.reduce_mean if isinstance(layer, L.GlobalAveragePooling2D) else tf.reduce_max
            return tf.transpose(reduce(inputs[0], axis=[1, 2]), [1, 0, 2])
        if isinstance(layer, L.ZeroPadding2D):
            (top, bottom), (left, right) = layer.padding
            return tf.pad(inputs[0], [[0, 0], [top, bottom], [left, right], [0, 0], [0, 0]])
        if isinstance(layer, L.BatchNormalization):
            return self._batch_norm(layer, inputs[0])
        if isinstance(layer, L.Dropout):
            return self._dropout(layer, inputs[0])
        if isinstance(layer, (L.Add, L.Subtract, L.Multiply, L.Average, L.Maximum, L.Minimum, L.Concatenate)):
            return layer.call(list(inputs))
        return layer.call(inputs[0])

    def _batch_norm(self, layer, x):
        spatial = len(x.shape) == 5
        axes = [0, 1, 2] if spatial else [1]

        def per_learner(t):   # (m, C) -> broadcastable against x
            return t if spatial else t[:, None, :]
        mean_idx = self._s_index[id(layer.moving_mean)]
        var_idx = self._s_index[id(layer.moving_variance)]
        if layer.trainable:
            mean, variance = keras.ops.moments(x, axes=axes)   # (m, C): statistics per learner
            momentum = layer.momentum
            self._new_states[mean_idx] = self._states[mean_idx] * momentum + mean * (1.0 - momentum)
            self._new_states[var_idx] = self._states[var_idx] * momentum + variance * (1.0 - momentum)
        else:
            mean, variance = self._states[mean_idx], self._states[var_idx]
        # The same kernel as Keras's BatchNormalization, so that rounding matches the replicated path.
        return tf.nn.batch_normalization(
            x, per_learner(mean), per_learner(variance),
            offset=per_learner(self._w(layer.beta)) if layer.center else None,
            scale=per_learner(self._w(layer.gamma)) if layer.scale else None,
            variance_epsilon=layer.epsilon)

    def _dropout(self, layer, x):
        if layer.rate <= 0:
            return x
        idx = self._s_index[id(layer.seed_generator.state)]
        state = self._states[idx]                                # (m, 2)
        spatial = len(x.shape) == 5
        # Each learner's keep-mask is drawn exactly as tf.nn.experimental.stateless_dropout draws it
        # from that learner's seed; then one select applies all of them.
        masks = []
        for i in range(self._m):
            x_i = x[:, :, :, i, :] if spatial else x[i]
            shape = tf.shape(x_i) if layer.noise_shape is None else \
                [s if s is not None else tf.shape(x_i)[a] for a, s in enumerate(layer.noise_shape)]
            uniform = tf.random.stateless_uniform(shape, seed=_cast_seed(state[i]), dtype=x.dtype)
            masks.append(uniform >= layer.rate)
        # Keras advances a seed generator by (0, 1) per draw.
        self._new_states[idx] = state + tf.constant([0, 1], dtype=state.dtype)
        keep = tf.stack(masks, axis=3 if spatial else 0)
        return tf.where(keep, x * tf.constant(1 / (1 - layer.rate), x.dtype), tf.constant(0, x.dtype))

    # ---- the learners ----------------------------------------------------------------------
    def forward(self, weights, states, x):
        """Outputs of every learner, stacked (m, b, ...), and the new states."""
        self._m = x.shape[0]
        self._weights, self._states, self._new_states = weights, states, list(states)
        inputs = [self._to_fused(t) for t in tf.nest.flatten(x)]
        outputs = self.graph._run_through_graph(
            inputs, operation_fn=lambda layer: (lambda *args, **kwargs: self._apply(layer, [
                a for a in tf.nest.flatten(args) if isinstance(a, (tf.Tensor, tf.Variable))])))
        outputs = tf.nest.map_structure(self._to_stacked, outputs)
        new_states = self._new_states
        self._weights = self._states = self._new_states = None
        return outputs, new_states

    def __call__(self, weights, states, x, y, mask):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            preds, new_states = self.forward(weights, states, x)
            losses = tf.stack([masked_mean(self.per_example_loss(y[i], preds[i]), mask[i])
                               for i in range(x.shape[0])])
            total = tf.reduce_sum(losses)
        # Each learner's loss depends only on its own slice of the stacks, so the gradient of
        # the sum is every learner's own gradient.
        grads = tape.gradient(total, weights, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return losses, grads, new_states, preds


def make_learners(model, loss, mode="auto"):
    """The learner computation for MODEL: "fused", "replicated" or "auto" (fused when possible)."""
    if mode == "replicated":
        return ReplicatedLearners(model, loss)
    try:
        return FusedLearners(model, loss)
    except UnsupportedModel as e:
        if mode == "fused":
            raise
        log.warning("crossbow_tf: learners run replicated (one call per learner): %s", e)
        return ReplicatedLearners(model, loss)
