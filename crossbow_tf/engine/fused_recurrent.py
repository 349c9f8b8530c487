"""Fused forms of Keras's recurrent layers: LSTM, GRU, SimpleRNN and Bidirectional over one of them.

Why: on the replicated path each of the m learners runs its own loop over time, so a step costs m
small matmuls and m loop iterations' overhead. Here the m learners share ONE loop over time, and its
step is one batched matmul over all learners: h (m, b, u) @ recurrent_kernel (m, u, G). The input
projection of every time step is computed before the loop as one einsum (what Keras's cell does at
each step, x_t @ kernel, for all t and all learners at once).

Layouts (FORMS_API.md): the input sequence is fused (b, L, m, C), a mask (m, b, L). Inside, the loop
runs time-major: projected inputs (L, m, b, G), mask (L, m, b, 1), states (m, b, u). The output is
(b, L, m, units) with return_sequences, else (m, b, units).

Numerics follow Keras 3.15's own layers on CPU (keras/src/layers/rnn/*.py and
keras/src/backend/tensorflow/rnn.py): the cells' gate orders (LSTM i, f, c, o; GRU z, r, h) and
their sums in Keras's order; at a masked step the states are carried and the output is the previous
output (the carried h), or zero when zero_output_for_mask (which Bidirectional sets to
return_sequences); go_backwards reads the sequence reversed and returns its outputs in that reversed
order; Bidirectional flips the backward layer's sequence output back before merging.

Not fused (reason() says so): dropout or recurrent_dropout > 0 (the cells draw their masks inside
Keras's RNN call from their seed generators; not reproduced here), stateful, return_state, unroll,
regularizers, non-elementwise activations, an initial_state argument (apply raises).
"""
import keras
import tensorflow as tf
from keras import layers as L

_RECURRENT = (L.LSTM, L.GRU, L.SimpleRNN)
_MERGE_MODES = ("concat", "sum", "ave", "mul", None)
_ELEMENTWISE_ACTIVATIONS = frozenset(
    getattr(keras.activations, name) for name in (
        "linear", "relu", "relu6", "elu", "selu", "gelu", "sigmoid", "hard_sigmoid", "tanh", "swish",
        "silu", "softplus", "softsign", "leaky_relu", "exponential", "mish", "hard_silu", "hard_swish")
    if hasattr(keras.activations, name))
_CELL_REGULARIZERS = ("kernel_regularizer", "recurrent_regularizer", "bias_regularizer")


def reason(layer):
    """None when this module fuses LAYER exactly as configured, else why not. Never raises."""
    try:
        if isinstance(layer, L.Bidirectional):
            return _bidirectional_reason(layer)
        if type(layer) in _RECURRENT:
            return _recurrent_reason(layer)
        return "not a recurrent layer"
    except Exception as e:   # an unusual layer whose attributes we cannot read: not ours to fuse
        return f"its configuration could not be read ({type(e).__name__}: {e})"


def _bidirectional_reason(layer):
    if layer.merge_mode not in _MERGE_MODES:
        return f"Bidirectional merge_mode {layer.merge_mode!r} is not fused"
    if layer.return_state:
        return "Bidirectional with return_state=True is not fused"
    for direction, sub in (("forward", layer.forward_layer), ("backward", layer.backward_layer)):
        if type(sub) not in _RECURRENT:
            return f"Bidirectional over a {type(sub).__name__} ({direction}) is not fused"
        why = _recurrent_reason(sub)
        if why is not None:
            return f"its {direction} layer: {why}"
    return None


def _recurrent_reason(layer):
    name = type(layer).__name__
    cell = layer.cell
    for flag in ("stateful", "return_state", "unroll"):
        if getattr(layer, flag):
            return f"{name} with {flag}=True is not fused"
    if layer.zero_output_for_mask and not layer.return_sequences:
        return f"{name} with zero_output_for_mask=True and return_sequences=False is not fused"
    if cell.dropout or getattr(cell, "recurrent_dropout", 0):
        return (f"{name} with dropout/recurrent_dropout > 0 is not fused (its cell draws the masks inside "
                "Keras's RNN call; the replicated path keeps them exact)")
    for attr in _CELL_REGULARIZERS + ("activity_regularizer",):
        source = layer if attr == "activity_regularizer" else cell
        if getattr(source, attr, None) is not None:
            return f"{name} with a {attr.replace('_', ' ')} is not fused"
    activations = [cell.activation] + ([cell.recurrent_activation] if hasattr(cell, "recurrent_activation") else [])
    for activation in activations:
        if activation not in _ELEMENTWISE_ACTIVATIONS:
            return f"{name} with activation {getattr(activation, '__name__', activation)!r} is not fused"
    return None


def apply(ctx, layer, args, kwargs):
    """LAYER's output for all ctx.m learners in fused layout (see module doc)."""
    x = args[0]
    initial_state = args[1] if len(args) > 1 else kwargs.get("initial_state")
    if initial_state is not None:
        raise ValueError(f"layer {layer.name!r}: a recurrent layer called with initial_state is not fused")
    mask = kwargs.get("mask")
    if isinstance(mask, (list, tuple)):
        mask = mask[0]
    if isinstance(layer, L.Bidirectional):
        return _bidirectional(ctx, layer, x, mask)
    return _recurrent(ctx, layer, x, mask)


def _bidirectional(ctx, layer, x, mask):
    forward = tf.cast(_recurrent(ctx, layer.forward_layer, x, mask), layer.compute_dtype)
    backward = tf.cast(_recurrent(ctx, layer.backward_layer, x, mask), layer.compute_dtype)
    if layer.return_sequences:
        backward = tf.reverse(backward, [1])   # (b, L, m, u): back into the forward time order
    if layer.merge_mode == "concat":
        return tf.concat([forward, backward], axis=-1)
    if layer.merge_mode == "sum":
        return forward + backward
    if layer.merge_mode == "ave":
        return (forward + backward) / 2
    if layer.merge_mode == "mul":
        return forward * backward
    return forward, backward


def _recurrent(ctx, layer, x, mask):
    """One LSTM/GRU/SimpleRNN (a Bidirectional's direction too) over fused X (b, L, m, C)."""
    x = tf.cast(x, layer.compute_dtype)
    step, projected, states = _CELLS[type(layer)](ctx, layer.cell, x)
    time_mask = None if mask is None else tf.transpose(tf.cast(mask, tf.bool), [2, 0, 1])[..., None]
    if layer.go_backwards:
        projected = tf.reverse(projected, [0])
        time_mask = None if time_mask is None else tf.reverse(time_mask, [0])
    outputs = _loop(step, projected, time_mask, states, layer.zero_output_for_mask)   # (L, m, b, u)
    outputs = tf.cast(outputs, layer.compute_dtype)
    if layer.return_sequences:
        return tf.transpose(outputs, [2, 0, 1, 3])
    return outputs[-1]


def _loop(step, projected, time_mask, states, zero_output_for_mask):
    """The outputs (L, m, b, u) of STEP over time, masked as Keras's TensorFlow rnn() masks."""
    def body(carry, elems):
        previous = carry[:-1]
        output, new_states = step(elems[0], previous)
        if time_mask is not None:
            keep = elems[1]
            new_states = tuple(tf.where(keep, new, old) for new, old in zip(new_states, previous, strict=True))
            # Keras's masked output is the previous output, which for these cells is the carried h.
            output = tf.where(keep, output, tf.zeros_like(output) if zero_output_for_mask else previous[0])
        return tuple(new_states) + (output,)

    elems = (projected,) if time_mask is None else (projected, time_mask)
    initial = tuple(states) + (tf.zeros_like(states[0]),)
    return tf.scan(body, elems, initializer=initial)[-1]


def _projection(ctx, cell, x):
    """Every step's x_t @ kernel for every learner at once: (L, m, b, G)."""
    return tf.einsum("blmc,mcg->lmbg", x, ctx.weight(cell.kernel))


def _zeros(x, m, units):
    return tf.zeros([m, tf.shape(x)[0], units], dtype=x.dtype)


def _lstm(ctx, cell, x):
    m, units = ctx.m, cell.units
    recurrent_kernel = ctx.weight(cell.recurrent_kernel)                 # (m, u, 4u)
    bias = ctx.weight(cell.bias)[:, None, :] if cell.use_bias else None   # (m, 1, 4u)

    def step(projected_t, states):
        h, c = states
        z = projected_t + tf.matmul(h, recurrent_kernel)
        if bias is not None:
            z = z + bias
        z0, z1, z2, z3 = tf.split(z, 4, axis=-1)
        c = cell.recurrent_activation(z1) * c + cell.recurrent_activation(z0) * cell.activation(z2)
        h = cell.recurrent_activation(z3) * cell.activation(c)
        return h, (h, c)
    zeros = _zeros(x, m, units)
    return step, _projection(ctx, cell, x), (zeros, zeros)


def _gru(ctx, cell, x):
    m, units = ctx.m, cell.units
    recurrent_kernel = ctx.weight(cell.recurrent_kernel)                 # (m, u, 3u)
    projected = _projection(ctx, cell, x)
    recurrent_bias = None
    if cell.use_bias:
        bias = ctx.weight(cell.bias)            # (m, 3u), or (m, 2, 3u) with reset_after
        input_bias = bias[:, 0] if cell.reset_after else bias
        recurrent_bias = bias[:, 1][:, None, :] if cell.reset_after else None
        projected = projected + input_bias[None, :, None, :]

    def step(projected_t, states):
        h = states[0]
        x_z, x_r, x_h = tf.split(projected_t, 3, axis=-1)
        inner = tf.matmul(h, recurrent_kernel if cell.reset_after else recurrent_kernel[..., :2 * units])
        if recurrent_bias is not None:
            inner = inner + recurrent_bias
        z = cell.recurrent_activation(x_z + inner[..., :units])
        r = cell.recurrent_activation(x_r + inner[..., units:2 * units])
        if cell.reset_after:
            recurrent_h = r * inner[..., 2 * units:]
        else:
            recurrent_h = tf.matmul(r * h, recurrent_kernel[..., 2 * units:])
        h = z * h + (1 - z) * cell.activation(x_h + recurrent_h)
        return h, (h,)
    return step, projected, (_zeros(x, m, units),)


def _simple_rnn(ctx, cell, x):
    recurrent_kernel = ctx.weight(cell.recurrent_kernel)                 # (m, u, u)
    projected = _projection(ctx, cell, x)
    if cell.use_bias:
        projected = projected + ctx.weight(cell.bias)[None, :, None, :]

    def step(projected_t, states):
        h = cell.activation(projected_t + tf.matmul(states[0], recurrent_kernel))
        return h, (h,)
    return step, projected, (_zeros(x, ctx.m, cell.units),)


_CELLS = {L.LSTM: _lstm, L.GRU: _gru, L.SimpleRNN: _simple_rnn}
