"""The hand-written fused forms of Embedding, LayerNormalization and MultiHeadAttention
(crossbow_tf/engine/fused_sequence.py) against Keras's own per-learner stateless_call: each learner's
slice of the fused output, and the gradients w.r.t. the learners' stacked weights."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers as L
from keras.src.backend import AutocastScope, set_keras_mask

from crossbow_tf.engine import fused_sequence
from crossbow_tf.engine.fused_testing import ArrayContext

B, T, V, D = 2, 5, 11, 8


def _stacks(layer, m, seed):
    rng = np.random.default_rng(seed)
    stacks = {}
    for v in layer.trainable_variables:
        base = keras.ops.convert_to_numpy(v.value)
        stacks[id(v)] = tf.constant(base + 0.3 * rng.standard_normal((m, *base.shape)).astype(base.dtype))
    for v in layer.non_trainable_variables:   # seed states: a different seed per learner
        base = keras.ops.convert_to_numpy(v.value)
        stacks[id(v)] = tf.constant(np.stack([base + np.array([7 * i, 0], base.dtype) for i in range(m)]))
    return stacks


def _reference(layer, stacks, i, args, kwargs, query_mask=None):
    """Learner I's output by Keras's own stateless_call, inputs and reads as Layer.__call__ does them."""
    trainable = [stacks[id(v)][i] for v in layer.trainable_variables]
    frozen = [stacks[id(v)][i] for v in layer.non_trainable_variables]
    args = [tf.cast(a, layer.compute_dtype) if a.dtype.is_floating else a for a in args]
    if query_mask is not None:
        set_keras_mask(args[0], query_mask)
    with AutocastScope(layer.compute_dtype if layer.autocast else None):
        return layer.stateless_call(trainable, frozen, *args, **kwargs)


def _check(layer, m, fused_args, fused_kwargs, learner_call, slice_out, tol, seed=0):
    """Forward and weight gradients of the fused form against each learner's stateless_call."""
    stacks = _stacks(layer, m, seed)
    weights = [stacks[id(v)] for v in layer.trainable_variables]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(weights)
        ctx = ArrayContext(stacks, layer.compute_dtype, m=m)
        fused = fused_sequence.apply(ctx, layer, fused_args, fused_kwargs)
        fused_out = fused[0] if isinstance(fused, tuple) else fused
        cotangent = tf.random.stateless_normal(tf.shape(fused_out), seed=[seed, 1])
        fused_loss = tf.reduce_sum(tf.cast(fused_out, tf.float32) * cotangent)
        references, ref_loss = [], 0.0
        for i in range(m):
            out, new_states = learner_call(stacks, i)
            out0 = out[0] if isinstance(out, tuple) else out
            references.append((out, new_states))
            ref_loss += tf.reduce_sum(tf.cast(out0, tf.float32) * slice_out(cotangent, i))
    for i, (out, new_states) in enumerate(references):
        pairs = list(zip(tf.nest.flatten(fused), tf.nest.flatten(out), strict=True))
        for got, want in pairs:
            np.testing.assert_allclose(np.float32(slice_out(got, i)), np.float32(want), rtol=tol, atol=tol)
        for v, state in zip(layer.non_trainable_variables, new_states, strict=True):
            np.testing.assert_array_equal(ctx.stacks[id(v)][i], state)
    fused_grads = tape.gradient(fused_loss, weights)
    ref_grads = tape.gradient(ref_loss, weights)
    assert len(fused_grads) == len(ref_grads) == len(layer.trainable_variables) > 0
    for got, want in zip(fused_grads, ref_grads, strict=True):
        got, want = tf.convert_to_tensor(got), tf.convert_to_tensor(want)
        assert np.abs(np.float32(want)).max() > 0
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=tol, atol=tol * 10)
    return fused


def _sequence_slice(x, i):   # (b, L, m, C) or (b, N, T, m, S) -> learner i
    return x[..., i, :]


def _ids(m, seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, V, size=(m, B, T)).astype("int32")
    ids[:, 0, -2:] = 0                                    # padding at the end of each first sequence
    return tf.constant(ids)


@pytest.fixture(scope="module", params=["float32", "mixed_bfloat16"])
def policy(request):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy(previous)


def _tol(policy):
    return 2e-2 if policy == "mixed_bfloat16" else 2e-5


@pytest.fixture(scope="module")
def layers_under(policy):
    emb = L.Embedding(V, D, mask_zero=True)
    emb.build((None, T))
    norm = L.LayerNormalization()
    norm.build((None, T, D))
    rms = L.LayerNormalization(center=False, rms_scaling=True)
    rms.build((None, D))
    x = tf.zeros((B, T, D))
    mha = L.MultiHeadAttention(num_heads=2, key_dim=4)
    mha(x, x)
    mha_drop = L.MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.3, seed=5)
    mha_drop(x, x)
    cross = L.MultiHeadAttention(num_heads=2, key_dim=4, value_dim=3)
    cross(x, tf.zeros((B, T + 1, D)), tf.zeros((B, T + 1, 6)))
    return dict(emb=emb, norm=norm, rms=rms, mha=mha, mha_drop=mha_drop, cross=cross)


def test_reasons():
    assert fused_sequence.reason(L.Embedding(3, 2)) is None
    assert fused_sequence.reason(L.LayerNormalization()) is None
    assert "axis" in fused_sequence.reason(L.LayerNormalization(axis=1))
    assert "not an Embedding" in fused_sequence.reason(L.Dense(3))
    gated = L.MultiHeadAttention(2, 4, use_gate=True)
    gated(tf.zeros((1, 3, 4)), tf.zeros((1, 3, 4)))
    assert "use_gate" in fused_sequence.reason(gated)


@pytest.mark.parametrize("m", [1, 3])
def test_embedding(layers_under, policy, m):
    emb, ids = layers_under["emb"], _ids(m)
    out = _check(emb, m, [ids], {}, lambda s, i: _reference(emb, s, i, [ids[i]], {}), _sequence_slice, _tol(policy))
    assert out.shape == (B, T, m, D)
    flat = ids[:, :, 0]                                  # ids (b,) -> (m, b, D)
    out = _check(emb, m, [flat], {}, lambda s, i: _reference(emb, s, i, [flat[i]], {}), lambda x, i: x[i],
                 _tol(policy))
    assert out.shape == (m, B, D)


@pytest.mark.parametrize("m", [1, 3])
def test_layer_norm(layers_under, policy, m):
    norm, rms = layers_under["norm"], layers_under["rms"]
    x = tf.random.stateless_normal((B, T, m, D), seed=[m, 2], dtype=norm.compute_dtype) * 3 + 1
    _check(norm, m, [x], {}, lambda s, i: _reference(norm, s, i, [x[:, :, i]], {}), _sequence_slice, _tol(policy))
    features = tf.random.stateless_normal((m, B, D), seed=[m, 3], dtype=rms.compute_dtype)
    _check(rms, m, [features], {}, lambda s, i: _reference(rms, s, i, [features[i]], {}), lambda y, i: y[i],
           _tol(policy))


def _mha_inputs(layer, m, seed):
    x = tf.random.stateless_normal((B, T, m, D), seed=[seed, 4], dtype=layer.compute_dtype)
    mask = tf.not_equal(_ids(m, seed), 0)                 # as an Embedding with mask_zero emits it
    return x, mask


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_with_masks(layers_under, policy, m, causal):
    mha = layers_under["mha"]
    x, mask = _mha_inputs(mha, m, 7)
    kwargs = {"query_mask": mask, "value_mask": mask, "use_causal_mask": causal}
    _check(mha, m, [x, x], kwargs,
           lambda s, i: _reference(mha, s, i, [x[:, :, i], x[:, :, i]],
                                   {"value_mask": mask[i], "use_causal_mask": causal, "training": True},
                                   query_mask=mask[i]),
           _sequence_slice, _tol(policy))


@pytest.mark.parametrize("m", [1, 3])
def test_attention_dropout_and_scores(layers_under, policy, m):
    mha = layers_under["mha_drop"]
    x, mask = _mha_inputs(mha, m, 9)
    kwargs = {"mask": [mask, mask], "return_attention_scores": True, "use_causal_mask": True}
    out, scores = _check(mha, m, [x, x], kwargs,
                         lambda s, i: _reference(mha, s, i, [x[:, :, i], x[:, :, i]],
                                                 {"value_mask": mask[i], "return_attention_scores": True,
                                                  "use_causal_mask": True, "training": True},
                                                 query_mask=mask[i]),
                         _sequence_slice, _tol(policy))
    assert scores.shape == (B, 2, T, m, T)


@pytest.mark.parametrize("m", [1, 3])
def test_cross_attention_with_key_and_attention_mask(layers_under, policy, m):
    cross = layers_under["cross"]
    dtype = cross.compute_dtype
    query = tf.random.stateless_normal((B, T, m, D), seed=[m, 5], dtype=dtype)
    value = tf.random.stateless_normal((B, T + 1, m, D), seed=[m, 6], dtype=dtype)
    key = tf.random.stateless_normal((B, T + 1, m, 6), seed=[m, 7], dtype=dtype)
    attention = tf.random.stateless_uniform((B, T, m, T + 1), seed=[m, 8]) > 0.3
    _check(cross, m, [query, value, key], {"attention_mask": attention},
           lambda s, i: _reference(cross, s, i, [query[:, :, i], value[:, :, i], key[:, :, i]],
                                   {"attention_mask": attention[:, :, i], "training": True}),
           _sequence_slice, _tol(policy))
