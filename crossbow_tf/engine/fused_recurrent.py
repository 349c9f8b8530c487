"""Fused forms of Keras's recurrent layers: LSTM, GRU, SimpleRNN and Bidirectional over one of them.

Why: on the replicated path each of the m learners runs its own loop over time, so a step costs m
small matmuls and m loop iterations' overhead. Here the m learners share ONE loop over time, and its
step is one batched matmul over all learners: h (m, b, u) @ recurrent_kernel (m, u, G). The input
projection of every time step, bias included, is computed before the loop as one einsum (what
Keras's cell does at each step, x_t @ kernel + bias, for all t and all learners at once). A
Bidirectional's two directions run in the same loop: the loop's learner axis holds the forward
direction's m learners and then the backward direction's m (the backward inputs reversed in time
before the loop), which halves the loop's steps, the part of the time that does not shrink with
the learners' small batches (tools/bench_fused_recurrent.py measures it).

Layouts (FORMS_API.md): the input sequence is fused (b, L, m, C), a mask (m, b, L). Inside, the loop
runs time-major: projected inputs (L, n*m, b, G) for n directions, mask (L, n*m, b, 1), states
(n*m, b, u). The output is (b, L, m, units) with return_sequences, else (m, b, units).

Numerics follow Keras 3.15's own layers on CPU (keras/src/layers/rnn/*.py and
keras/src/backend/tensorflow/rnn.py): the cells' gate orders (LSTM i, f, c, o; GRU z, r, h); at a
masked step the states are carried and the output is the previous output (the carried h), or zero
when zero_output_for_mask (which Bidirectional sets to return_sequences); go_backwards reads the
sequence reversed and returns its outputs in that reversed order; Bidirectional flips the backward
layer's sequence output back before merging. The sums differ from Keras's in order only (the input
bias joins the projection before the recurrent term is added), within float32 rounding.

Dropout and recurrent_dropout: Keras's RNN call draws the cell's masks once per call, before the
loop, from the cell's seed generator (keras/src/layers/rnn/rnn.py, _maybe_config_dropout_masks): the
input masks first (one, or one per gate where the cell's dropout_mask_count says so: LSTM 4, GRU 3
with implementation 1, which recurrent_dropout implies), then the recurrent ones, each draw
``tf.nn.experimental.stateless_dropout`` of ones from the next seed (the state advanced by (0, 1)).
Here each learner draws the same from its own seed state, and its state advances as Keras's does.

Not fused (reason() says so): a dropout rate of 1, stateful, return_state, unroll, regularizers,
non-elementwise activations, an initial_state argument (apply raises).
"""
import keras
import tensorflow as tf
from keras import layers as L
# Not exported by Keras: the seed conversion of its TensorFlow backend, so the draws match its own.
from keras.src.backend.tensorflow.random import _cast_seed

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
    if cell.dropout >= 1 or getattr(cell, "recurrent_dropout", 0) >= 1:
        return f"{name} with a dropout rate of 1 is not fused"
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
    return _to_output(layer, _run(ctx, [layer], x, mask)[0])


def _to_output(layer, outputs):
    """The (L, m, b, u) time-major outputs of LAYER as it returns them (see module doc)."""
    outputs = tf.cast(outputs, layer.compute_dtype)
    return tf.transpose(outputs, [2, 0, 1, 3]) if layer.return_sequences else outputs[-1]


def _bidirectional(ctx, layer, x, mask):
    directions = [layer.forward_layer, layer.backward_layer]
    if _one_loop(*directions):
        forward, backward = _run(ctx, directions, x, mask)
    else:
        forward, backward = (_run(ctx, [sub], x, mask)[0] for sub in directions)
    if layer.return_sequences:
        backward = tf.reverse(backward, [0])   # back into the forward time order
    forward, backward = (tf.cast(_to_output(sub, y), layer.compute_dtype)
                         for sub, y in zip(directions, (forward, backward), strict=True))
    if layer.merge_mode == "concat":
        return tf.concat([forward, backward], axis=-1)
    if layer.merge_mode == "sum":
        return forward + backward
    if layer.merge_mode == "ave":
        return (forward + backward) / 2
    if layer.merge_mode == "mul":
        return forward * backward
    return forward, backward


def _one_loop(first, second):
    """Whether the two recurrent layers can share one loop: the same cell computation and dtypes."""
    def signature(layer):
        cell = layer.cell
        return (type(layer), cell.units, cell.activation, getattr(cell, "recurrent_activation", None),
                cell.use_bias, getattr(cell, "reset_after", None), layer.zero_output_for_mask,
                layer.compute_dtype, cell.variable_dtype)
    return signature(first) == signature(second)


def _run(ctx, layers, x, mask):
    """The time-major outputs (L, m, b, u) of each of LAYERS (recurrent layers sharing one cell
    computation, see _one_loop) over fused X (b, L, m, C), in one loop over time."""
    m, x = ctx.m, tf.cast(x, layers[0].compute_dtype)
    time_mask = None if mask is None else tf.transpose(tf.cast(mask, tf.bool), [2, 0, 1])[..., None]
    parts = [_Direction(ctx, layer, x) for layer in layers]
    projected = [tf.reverse(p.projected, [0]) if p.layer.go_backwards else p.projected for p in parts]
    masks = [None if time_mask is None else tf.reverse(time_mask, [0]) if p.layer.go_backwards else time_mask
             for p in parts]
    stacked = _Direction.stacked(parts)
    step = _STEPS[type(layers[0])](layers[0].cell, stacked)
    outputs = _loop(step, tf.concat(projected, 1), None if mask is None else tf.concat(masks, 1),
                    stacked["states"], layers[0].zero_output_for_mask)
    return [outputs[:, i * m:(i + 1) * m] for i in range(len(layers))]


class _Direction:
    """One recurrent layer's pieces for the loop: its learners' weights, dropout masks (drawn as its
    cell draws them, see module doc) and projected inputs (L, m, b, G)."""

    def __init__(self, ctx, layer, x):
        self.layer, cell = layer, layer.cell
        self.recurrent_kernel = ctx.weight(cell.recurrent_kernel)                 # (m, u, G)
        bias = ctx.weight(cell.bias) if cell.use_bias else None   # (m, G), or (m, 2, G): GRU reset_after
        reset_after = getattr(cell, "reset_after", False)
        self.input_bias = bias[:, 0] if reset_after and bias is not None else bias
        self.recurrent_bias = bias[:, 1][:, None, :] if reset_after and bias is not None else None
        self.input_masks, self.recurrent_masks = _dropout_masks(ctx, cell, x)
        self.projected = self._projection(ctx.weight(cell.kernel), x)
        self.states = [tf.zeros([ctx.m, tf.shape(x)[0], cell.units], dtype=x.dtype)] * (
            2 if isinstance(layer, L.LSTM) else 1)

    def _projection(self, kernel, x):
        """Every step's x_t @ kernel + bias for every learner at once: (L, m, b, G)."""
        if self.input_masks is None:
            projected = tf.einsum("blmc,mcg->lmbg", x, kernel)
        else:   # each gate's block of the kernel sees the inputs under that gate's mask
            blocks = tf.split(kernel, len(self.input_masks), axis=-1)
            projected = tf.concat([tf.einsum("blmc,mcg->lmbg", x * tf.transpose(mask, [1, 0, 2])[:, None], block)
                                   for mask, block in zip(self.input_masks, blocks, strict=True)], -1)
        return projected if self.input_bias is None else projected + self.input_bias[None, :, None, :]

    @staticmethod
    def stacked(parts):
        """The directions' loop constants and initial states, stacked along the learner axis."""
        def joined(name):
            values = [getattr(p, name) for p in parts]
            if values[0] is None:
                return None
            if isinstance(values[0], list):
                return [tf.concat(group, 0) for group in zip(*values, strict=True)]
            return tf.concat(values, 0)
        return {name: joined(name) for name in ("recurrent_kernel", "recurrent_bias", "recurrent_masks", "states")}


def _dropout_masks(ctx, cell, x):
    """(input masks, recurrent masks) of CELL for every learner, as Keras's RNN call draws them: each
    a list of (m, b, C) or (m, b, u) masks (one per gate where dropout_mask_count says so), or None."""
    rates = [rate if 0 < rate < 1 else 0.0 for rate in (cell.dropout, getattr(cell, "recurrent_dropout", 0.0))]
    if not any(rates):
        return None, None
    state_variable = cell.seed_generator.state
    seeds = ctx.weight(state_variable)                                          # (m, 2)
    count = getattr(cell, "dropout_mask_count", None) or 1
    shapes = ([tf.shape(x)[0], x.shape[-1]], [tf.shape(x)[0], cell.units])
    drawn, masks = 0, []
    for rate, shape in zip(rates, shapes, strict=True):
        if not rate:
            masks.append(None)
            continue
        group = []
        for _ in range(count):
            offset = tf.constant([0, drawn], seeds.dtype)
            group.append(tf.stack([tf.nn.experimental.stateless_dropout(
                tf.ones(shape, x.dtype), rate=rate, seed=_cast_seed(seeds[i] + offset)) for i in range(ctx.m)]))
            drawn += 1
        masks.append(group)
    ctx.set_state(state_variable, seeds + tf.constant([0, drawn], seeds.dtype))
    return masks[0], masks[1]


def _loop(step, projected, time_mask, states, zero_output_for_mask):
    """The outputs (L, n, b, u) of STEP over time, masked as Keras's TensorFlow rnn() masks."""
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


def _recurrent_term(h, kernel, masks):
    """h @ kernel, or, under recurrent dropout, each gate's block of the kernel times h under that
    gate's mask (Keras's implementation 1)."""
    if masks is None:
        return tf.matmul(h, kernel)
    blocks = tf.split(kernel, len(masks), axis=-1)
    return tf.concat([tf.matmul(h * mask, block) for mask, block in zip(masks, blocks, strict=True)], -1)


def _lstm_step(cell, w):
    recurrent_kernel, masks = w["recurrent_kernel"], w["recurrent_masks"]

    def step(projected_t, states):
        h, c = states
        z = projected_t + _recurrent_term(h, recurrent_kernel, masks)
        z0, z1, z2, z3 = tf.split(z, 4, axis=-1)
        c = cell.recurrent_activation(z1) * c + cell.recurrent_activation(z0) * cell.activation(z2)
        h = cell.recurrent_activation(z3) * cell.activation(c)
        return h, (h, c)
    return step


def _gru_step(cell, w):
    units, recurrent_kernel, masks = cell.units, w["recurrent_kernel"], w["recurrent_masks"]
    recurrent_bias = w["recurrent_bias"]
    inner_kernel = recurrent_kernel if cell.reset_after else recurrent_kernel[..., :2 * units]
    inner_masks = masks if masks is None or cell.reset_after else masks[:2]

    def step(projected_t, states):
        h = states[0]
        x_z, x_r, x_h = tf.split(projected_t, 3, axis=-1)
        inner = _recurrent_term(h, inner_kernel, inner_masks)
        if recurrent_bias is not None:
            inner = inner + recurrent_bias
        z = cell.recurrent_activation(x_z + inner[..., :units])
        r = cell.recurrent_activation(x_r + inner[..., units:2 * units])
        if cell.reset_after:
            recurrent_h = r * inner[..., 2 * units:]
        else:
            h_h = h if masks is None else h * masks[2]
            recurrent_h = tf.matmul(r * h_h, recurrent_kernel[..., 2 * units:])
        h = z * h + (1 - z) * cell.activation(x_h + recurrent_h)
        return h, (h,)
    return step


def _simple_rnn_step(cell, w):
    recurrent_kernel, masks = w["recurrent_kernel"], w["recurrent_masks"]

    def step(projected_t, states):
        h = cell.activation(projected_t + _recurrent_term(states[0], recurrent_kernel, masks))
        return h, (h,)
    return step


_STEPS = {L.LSTM: _lstm_step, L.GRU: _gru_step, L.SimpleRNN: _simple_rnn_step}
