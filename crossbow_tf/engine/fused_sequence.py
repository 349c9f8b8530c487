"""Hand-written fused forms of the sequence layers: Embedding, LayerNormalization, MultiHeadAttention.

Why: a token model's learners should run as one computation per device, not one call per learner.
These three layers are where a transformer spends its time outside Dense; each has a form that
treats the learner axis as one more batch (or head) axis of the ops Keras itself uses, so no
per-learner loop and no transposes of the large activations are needed.

Layouts (fused.py's, decided by the single-learner rank): ids (b,) -> (m, b), ids and masks (b, L) ->
(m, b, L), sequences (b, L, C) -> (b, L, m, C), rank-4 tensors (b, N, T, S) -> (b, N, T, m, S).
- Embedding: one gather from the learners' tables seen as one (m*V, D) table, each learner's ids
  offset by i*V. Ids (m, b, L) are gathered transposed to (b, L, m) so the output is already in the
  sequence layout (b, L, m, D); other ranks gather stacked and move to the fused layout.
- LayerNormalization over the last axis: the last axis is the channel axis in every fused layout, so
  the moments are Keras's own (ops.moments, in at least float32 as ops.layer_normalization computes
  them) and only gamma/beta carry a learner axis.
- MultiHeadAttention: the inputs move once to the stacked layout (m, b, T, D); its EinsumDense
  projections are batched matmuls over the learner axis, (m, b*T, D) x (m, D, N*H), whose outputs
  (m, b, T, N, H) are the learners merged into the batch, (m*b, T, N, H), for free. The attention is
  then Keras's own (ops.dot_product_attention, or its einsums and Softmax layer) on a batch of m*b;
  the output projection is again a batched matmul, moved back to (b, T, m, E). (Einsums with the
  learner as an inner batch index, (b, T, m, D) x (m, D, N, H), measured slower: TensorFlow
  transposes every operand for them.) Which attention path runs, the masks it builds (query mask from the query,
  value/key masks, attention_mask, causal), the Softmax with mask and the scores' dropout follow
  Keras's MultiHeadAttention.call; the scores' dropout goes through ctx.dropout with the layer's own
  Dropout, so each learner's mask is drawn from its own seed.

`reason(layer)` says which configurations these forms take; `apply(ctx, layer, args, kwargs)`
computes the outputs for all learners (see FORMS_API.md for ctx).
"""
import keras
import tensorflow as tf
from keras import layers as L
from keras import ops

__all__ = ["reason", "apply"]


def _is_last_axis(axis, rank):
    axes = [axis] if isinstance(axis, int) else list(axis)
    return len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))


def _input_rank(layer):
    try:
        return len(layer.input.shape)
    except (AttributeError, ValueError, TypeError):
        return None


def _layer_norm_reason(layer):
    if not _is_last_axis(layer.axis, _input_rank(layer)):
        return f"LayerNormalization over axis {layer.axis!r} (only the last axis has a fused form)"
    return None


def _einsum_dense_reason(dense, name):
    if getattr(dense, "lora_enabled", False):
        return f"MultiHeadAttention with LoRA on its {name} projection"
    if getattr(dense, "quantization_mode", None):
        return f"MultiHeadAttention with a quantized {name} projection"
    return None


def _mha_reason(layer):
    if type(layer) is not L.MultiHeadAttention:
        return f"{type(layer).__name__} subclasses MultiHeadAttention (its own attention may differ)"
    if not layer.built:
        return "MultiHeadAttention that was never built"
    checks = [
        (layer._use_gate, "MultiHeadAttention with use_gate=True"),
        (layer._sliding_window is not None, "MultiHeadAttention with a sliding_window"),
        (layer._flash_attention, "MultiHeadAttention with flash attention"),
        (layer._output_shape is not None, "MultiHeadAttention with output_shape set"),
        (tuple(layer._attention_axes) != (1,), "MultiHeadAttention over attention_axes other than the sequence"),
        (any(getattr(layer, name).equation != "abc,cde->abde" for name in ("_query_dense", "_key_dense",
                                                                            "_value_dense"))
         or layer._output_dense.equation != "abcd,cde->abe",
         "MultiHeadAttention on inputs that are not (batch, length, features)"),
    ]
    for failed, why in checks:
        if failed:
            return why
    for name in ("_query_dense", "_key_dense", "_value_dense", "_output_dense"):
        why = _einsum_dense_reason(getattr(layer, name), name.strip("_").replace("_dense", ""))
        if why:
            return why
    return None


def reason(layer):
    """None when this module has a fused form for LAYER as configured, else why not. Never raises."""
    try:
        if type(layer) is L.Embedding:
            if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
                return "Embedding with LoRA or quantization"
            return None
        if type(layer) is L.LayerNormalization:
            return _layer_norm_reason(layer)
        if isinstance(layer, L.MultiHeadAttention):
            return _mha_reason(layer)
        return f"{type(layer).__name__} is not an Embedding, LayerNormalization or MultiHeadAttention"
    except Exception as error:   # reason() must not raise: an unexpected layer state is a reason too
        return f"{type(layer).__name__}: cannot inspect its configuration ({error})"


# ---- Embedding ----------------------------------------------------------------------------------

def _embedding(ctx, layer, ids):
    tables = ctx.weight(layer.embeddings)                   # (m, V, D)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    m, vocab, dim = ctx.m, tables.shape[1], tables.shape[2]
    flat_tables = tf.reshape(tables, [m * vocab, dim])
    offsets = tf.range(m, dtype=ids.dtype) * tf.cast(vocab, ids.dtype)
    if len(ids.shape) == 3:                                  # (m, b, L) -> (b, L, m, D) directly
        offset_ids = tf.transpose(ids, [1, 2, 0]) + offsets
        outputs = tf.gather(flat_tables, offset_ids)
    else:                                                   # stacked (m, b, ...) -> (m, b, ..., D)
        stacked = ctx.to_stacked(ids)
        offset_ids = stacked + tf.reshape(offsets, [m] + [1] * (len(stacked.shape) - 1))
        outputs = ctx.to_fused(tf.gather(flat_tables, offset_ids))
    return ops.cast(outputs, layer.compute_dtype)


# ---- LayerNormalization -------------------------------------------------------------------------

def _learner_channels(ctx, variable, x):
    """VARIABLE's (m, C) stack shaped to broadcast against fused X, whose learner axis it finds."""
    stack = tf.cast(ctx.weight(variable), x.dtype)
    rank = len(x.shape)
    learner_axis = 0 if rank <= 3 else rank - 2
    shape = [1] * rank
    shape[learner_axis], shape[-1] = ctx.m, stack.shape[-1]
    return tf.reshape(stack, shape)


def _layer_norm(ctx, layer, x):
    original_dtype = x.dtype
    # As ops.layer_normalization: computed in at least float32 (weights read in the compute dtype first).
    x = tf.cast(x, keras.backend.result_type(x.dtype, "float32"))
    gamma = _learner_channels(ctx, layer.gamma, x) if layer.scale else None
    if layer.rms_scaling:
        variance = ops.var(x, axis=[-1], keepdims=True)
        outputs = x * ops.rsqrt(variance + layer.epsilon)
        if gamma is not None:
            outputs = outputs * gamma
    else:
        mean, variance = ops.moments(x, axes=[-1], keepdims=True)
        inv = ops.rsqrt(variance + layer.epsilon)
        if gamma is not None:
            inv = inv * gamma
        shift = -mean * inv
        if layer.center:
            shift = shift + _learner_channels(ctx, layer.beta, x)
        outputs = x * inv + shift
    return ops.cast(ops.cast(outputs, original_dtype), layer.compute_dtype)


# ---- MultiHeadAttention -------------------------------------------------------------------------

def _dims(x):
    return [x.shape[a] if x.shape[a] is not None else tf.shape(x)[a] for a in range(len(x.shape))]


def _project(ctx, dense, x):
    """EinsumDense 'abc,cde->abde' for all learners as one batched matmul over the learner axis:
    stacked (m, b, T, D) x (m, D, N, H) -> (m*b, T, N, H), the learners merged into the batch."""
    m, b, t, d = _dims(x)
    kernel = ctx.weight(dense.kernel)
    heads, size = kernel.shape[2], kernel.shape[3]
    y = tf.matmul(tf.reshape(x, [m, b * t, d]), tf.reshape(kernel, [m, d, heads * size]))
    y = tf.reshape(y, [m, b, t, heads, size])
    if dense.bias is not None:
        y = y + ctx.weight(dense.bias)[:, None, None]        # (m, N, H) over (b, T)
    return tf.reshape(y, [m * b, t, heads, size])


def _output_projection(ctx, dense, x, m):
    """EinsumDense 'abcd,cde->abe' for all learners: (m*b, T, N, H) x (m, N, H, E) -> fused (b, T, m, E)."""
    mb, t, heads, size = _dims(x)
    kernel = ctx.weight(dense.kernel)
    y = tf.matmul(tf.reshape(x, [m, mb // m * t, heads * size]), tf.reshape(kernel, [m, heads * size, -1]))
    y = tf.reshape(y, [m, mb // m, t, kernel.shape[-1]])
    if dense.bias is not None:
        y = y + ctx.weight(dense.bias)[:, None, None]
    return tf.transpose(y, [1, 2, 0, 3])


def _call_masks(call):
    """The query, value and key masks (fused (m, b, L) or None) as Keras's MHA call would see them:
    the *_mask arguments Layer.__call__ fills from the inputs' Keras masks, or CALL["mask"] (the
    query's mask, or the masks of (query, value, key) in order)."""
    query_mask, value_mask, key_mask = call.get("query_mask"), call.get("value_mask"), call.get("key_mask")
    mask = call.get("mask")
    if isinstance(mask, (list, tuple)):                     # the masks of (query, value, key) in order
        mask = list(mask) + [None] * (3 - len(mask))
        query_mask = mask[0] if query_mask is None else query_mask
        value_mask = mask[1] if value_mask is None else value_mask
        key_mask = mask[2] if key_mask is None else key_mask
    elif mask is not None and query_mask is None:
        query_mask = mask
    return query_mask, value_mask, key_mask


def _attention_mask(layer, query, value, masks, attention_mask, use_causal_mask):
    """Keras's _compute_attention_mask on fused tensors: a bool mask broadcastable to (m, b, T, S)."""
    query_mask, value_mask, key_mask = masks
    combined = None

    def merge(mask):
        return mask if combined is None else tf.logical_and(combined, mask)
    if query_mask is not None:
        combined = merge(tf.cast(query_mask, tf.bool)[..., :, None])      # (m, b, T, 1)
    for mask in (value_mask, key_mask):
        if mask is not None:
            combined = merge(tf.cast(mask, tf.bool)[..., None, :])        # (m, b, 1, S)
    if use_causal_mask:
        combined = merge(layer._compute_causal_mask(query, value)[None])  # (1, 1, T, S)
    if attention_mask is not None:                          # fused (b, T, m, S) -> (m, b, T, S)
        attention_mask = tf.transpose(tf.cast(attention_mask, tf.bool), [2, 0, 1, 3])
        combined = attention_mask if combined is None else tf.logical_and(attention_mask, combined)
    return combined


def _per_example(mask, m, b, t, s):
    """(m, b, T, S)-broadcastable MASK -> (m*b, 1, T, S), as Keras expands it over the heads."""
    return tf.reshape(tf.broadcast_to(mask, [m, b, t, s]), [m * b, 1, t, s])


def _dot_product_path(layer, query, key, value, mask, causal_only, m):
    """Keras's ops.dot_product_attention path, the learners merged into the batch."""
    mb, t = _dims(query)[:2]
    if mask is not None:
        mask = _per_example(mask, m, mb // m, t, _dims(key)[1])
    return ops.dot_product_attention(query, key, value, mask=mask, scale=layer._inverse_sqrt_key_dim,
                                     is_causal=causal_only)


def _scores_path(ctx, layer, query, key, value, mask, causal_only):
    """Keras's explicit-scores path: scaled query, scores, its Softmax with mask, dropout, combine.
    Returns the attended values (m*b, T, N, H) and the scores in fused layout (b, N, T, m, S)."""
    m = ctx.m
    mb, t, heads, _ = _dims(query)
    s = _dims(key)[1]
    if causal_only:
        mask = layer._compute_causal_mask(query, value)[None]
    query = ops.multiply(query, ops.cast(layer._inverse_sqrt_key_dim, query.dtype))
    scores = ops.einsum(layer._dot_product_equation, key, query)            # (m*b, N, T, S)
    if mask is not None:
        mask = _per_example(mask, m, mb // m, t, s)
    scores = layer._softmax(scores, mask=mask)
    stacked_shape = [m, mb // m, heads, t, s]
    fused_scores = ctx.to_fused(tf.reshape(scores, stacked_shape))
    dropped = scores
    if layer._dropout > 0.0:   # each learner's dropout mask from its own seed
        dropped = tf.reshape(ctx.to_stacked(ctx.dropout(layer._dropout_layer, fused_scores)), [mb, heads, t, s])
    return ops.einsum(layer._combine_equation, dropped, value), fused_scores


def _stacked_inputs(ctx, query, key, value):
    """Fused (b, T, m, D) inputs -> stacked (m, b, T, D), one transpose per distinct tensor."""
    stacked = {}
    for x in (query, key, value):
        if id(x) not in stacked:
            stacked[id(x)] = tf.transpose(x, [2, 0, 1, 3])
    return stacked[id(query)], stacked[id(key)], stacked[id(value)]


def _mha(ctx, layer, args, kwargs):
    names = ("query", "value", "key", "query_mask", "value_mask", "key_mask", "attention_mask",
             "return_attention_scores", "training", "use_causal_mask")
    call = dict(zip(names, args))
    call.update(kwargs)
    query, value = call["query"], call["value"]
    key = call.get("key")
    key = value if key is None else key
    masks = _call_masks(call)
    attention_mask, use_causal = call.get("attention_mask"), bool(call.get("use_causal_mask", False))
    return_scores = bool(call.get("return_attention_scores", False))
    causal_only = use_causal and attention_mask is None and all(mk is None for mk in masks)
    mask = None if causal_only else _attention_mask(layer, query, value, masks, attention_mask, use_causal)
    query, key, value = _stacked_inputs(ctx, query, key, value)
    q = _project(ctx, layer._query_dense, query)
    k = _project(ctx, layer._key_dense, key)
    v = _project(ctx, layer._value_dense, value)
    if layer._dropout > 0.0 or return_scores:
        attended, scores = _scores_path(ctx, layer, q, k, v, mask, causal_only)
    else:
        attended, scores = _dot_product_path(layer, q, k, v, mask, causal_only, ctx.m), None
    output = _output_projection(ctx, layer._output_dense, attended, ctx.m)
    return (output, scores) if return_scores else output


def apply(ctx, layer, args, kwargs):
    """LAYER's output for all learners, in fused layout (see the module doc and FORMS_API.md)."""
    if type(layer) is L.Embedding:
        return _embedding(ctx, layer, args[0] if args else kwargs["inputs"])
    if type(layer) is L.LayerNormalization:
        return _layer_norm(ctx, layer, args[0] if args else kwargs["inputs"])
    if isinstance(layer, L.MultiHeadAttention):
        return _mha(ctx, layer, list(args), dict(kwargs))
    raise ValueError(f"no fused sequence form for {type(layer).__name__}: {reason(layer)}")
