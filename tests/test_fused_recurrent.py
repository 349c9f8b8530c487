"""crossbow_tf.engine.fused_recurrent: each learner's slice of the fused recurrent forms equals Keras's
own layer (stateless_call with that learner's weights), forward and gradients, with and without a
padding mask, for m = 1 and 3, and under mixed_bfloat16."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers as L

from crossbow_tf.engine import fused_recurrent
from crossbow_tf.engine.fused_testing import ArrayContext

B, T, C = 2, 5, 3
LENGTHS = [5, 2]   # per example, as Embedding(mask_zero=True) masks padded tokens at the end


CASES = {
    "lstm": lambda: L.LSTM(4),
    "lstm_seq": lambda: L.LSTM(4, return_sequences=True),
    "lstm_back_seq": lambda: L.LSTM(4, return_sequences=True, go_backwards=True),
    "lstm_nobias_relu": lambda: L.LSTM(4, use_bias=False, activation="relu", recurrent_activation="hard_sigmoid"),
    "gru": lambda: L.GRU(4),
    "gru_before_seq": lambda: L.GRU(4, reset_after=False, return_sequences=True),
    "gru_back": lambda: L.GRU(4, go_backwards=True),
    "rnn_seq": lambda: L.SimpleRNN(4, return_sequences=True),
    "rnn_back": lambda: L.SimpleRNN(4, go_backwards=True, use_bias=False),
    "bi_lstm_seq": lambda: L.Bidirectional(L.LSTM(4, return_sequences=True)),
    "bi_lstm": lambda: L.Bidirectional(L.LSTM(4)),
    "bi_gru_sum_seq": lambda: L.Bidirectional(L.GRU(4, return_sequences=True), merge_mode="sum"),
    "bi_rnn_mul": lambda: L.Bidirectional(L.SimpleRNN(4), merge_mode="mul"),
    "bi_lstm_ave_seq": lambda: L.Bidirectional(L.LSTM(4, return_sequences=True), merge_mode="ave"),
    "bi_gru_none": lambda: L.Bidirectional(L.GRU(4), merge_mode=None),
}


def _padding_mask(m):
    return np.stack([np.arange(T)[None, :] < np.array(LENGTHS)[:, None]] * m)          # (m, b, T)


def _setup(make, m, policy):
    keras.config.set_dtype_policy(policy)
    try:
        layer = make()
        layer.build((B, T, C))
    finally:
        keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(7)
    stacks = [tf.constant(np.stack([rng.normal(0, 0.5, v.shape) for _ in range(m)]), tf.float32)
              for v in layer.trainable_variables]
    x = tf.constant(rng.normal(size=(m, B, T, C)), tf.float32)
    probe_rng = np.random.default_rng(3)
    # The cells' seed states: a different one per learner, as the engine gives them.
    seeds = [tf.constant(np.stack([v.numpy() + np.array([7 * i, 0], v.dtype) for i in range(m)]))
             for v in layer.non_trainable_variables]
    return layer, (stacks, seeds), x, probe_rng


def _loss(outputs, probes):
    return sum(tf.reduce_sum(tf.cast(o, tf.float32) * p) for o, p in zip(outputs, probes, strict=True))


def _fused(layer, weights, x, mask, probes):
    stacks, seeds = weights
    with tf.GradientTape() as tape:
        tape.watch([x] + stacks)
        ctx = ArrayContext.of(layer.trainable_variables + layer.non_trainable_variables, stacks + seeds,
                              layer.compute_dtype)
        kwargs = {} if mask is None else {"mask": tf.constant(mask)}
        y = fused_recurrent.apply(ctx, layer, (ctx.to_fused(tf.cast(x, layer.compute_dtype)),), kwargs)
        outputs = [ctx.to_stacked(t) for t in tf.nest.flatten(y)]
        loss = _loss(outputs, probes)
    new_seeds = [ctx.stacks[id(v)] for v in layer.non_trainable_variables]
    return outputs, tape.gradient(loss, [x] + stacks), new_seeds


def _keras(layer, weights, x, mask, probes):
    """Keras's layer per learner: outputs, gradients and seed states; PROBES may be a function of the
    outputs (then the probes it made are returned too), which spares a call only to learn their shapes."""
    stacks, seeds = weights
    m = x.shape[0]
    with tf.GradientTape() as tape:
        tape.watch([x] + stacks)
        per_learner, new_seeds = [], []
        for i in range(m):
            kwargs = {} if mask is None else {"mask": tf.constant(mask[i])}
            y, states = layer.stateless_call([s[i] for s in stacks], [s[i] for s in seeds],
                                             tf.cast(x[i], layer.compute_dtype), training=True, **kwargs)
            per_learner.append(tf.nest.flatten(y))
            new_seeds.append(states)
        outputs = [tf.stack(parts) for parts in zip(*per_learner, strict=True)]
        made = probes(outputs) if callable(probes) else probes
        loss = _loss(outputs, made)
    result = outputs, tape.gradient(loss, [x] + stacks), [tf.stack(s) for s in zip(*new_seeds, strict=True)]
    return result + (made,) if callable(probes) else result


def _compare(layer, weights, x, mask, rng, outputs, tol):
    """Fused against Keras per learner: outputs, gradients (inputs and weights) and seed states."""
    def random_probes(outputs):
        return [tf.constant(rng.normal(size=o.shape), tf.float32) for o in outputs]
    expected, expected_grads, expected_seeds, probes = _keras(layer, weights, x, mask, random_probes)
    got, got_grads, got_seeds = _fused(layer, weights, x, mask, probes)
    assert len(got) == len(expected) == outputs
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(tf.cast(g, tf.float32), tf.cast(e, tf.float32), **tol)
    assert len(got_grads) == len(expected_grads) == len(weights[0]) + 1
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert g is not None and np.abs(e.numpy()).max() > 0
        np.testing.assert_allclose(g, e, **tol)
    assert len(got_seeds) == len(expected_seeds) == len(weights[1])
    for g, e in zip(got_seeds, expected_seeds, strict=True):
        np.testing.assert_array_equal(g, e)
    return expected, expected_seeds


# Every case at m = 3 with and without a mask; m = 1 and mixed_bfloat16 on a few (the suite must stay fast).
GRID = ([(case, 3, masked, "float32") for case in sorted(CASES) for masked in (False, True)]
        + [(case, 1, True, "float32") for case in ("lstm", "gru_before_seq", "rnn_seq", "bi_lstm_seq", "bi_lstm")]
        + [(case, 3, True, "mixed_bfloat16") for case in ("lstm_seq", "gru", "bi_lstm_seq", "bi_lstm")])


@pytest.mark.parametrize("case, m, masked, policy", GRID)
def test_fused_equals_keras_per_learner(case, m, masked, policy):
    layer, weights, x, rng = _setup(CASES[case], m, policy)
    assert fused_recurrent.reason(layer) is None
    assert not layer.non_trainable_weights   # (the cells' seed generators are variables, not weights)
    mask = _padding_mask(m) if masked else None
    tol = dict(rtol=1e-5, atol=1e-5) if policy == "float32" else dict(rtol=0.05, atol=0.05)
    _compare(layer, weights, x, mask, rng, 2 if case == "bi_gru_none" else 1, tol)


DROPOUT_CASES = {
    "lstm_seq": lambda: L.LSTM(4, dropout=0.3, return_sequences=True),
    "lstm_both": lambda: L.LSTM(4, dropout=0.3, recurrent_dropout=0.4),
    "lstm_recurrent_seq": lambda: L.LSTM(4, recurrent_dropout=0.3, return_sequences=True),
    "gru_both_seq": lambda: L.GRU(4, dropout=0.2, recurrent_dropout=0.3, return_sequences=True),
    "gru_before_both": lambda: L.GRU(4, reset_after=False, dropout=0.2, recurrent_dropout=0.3),
    "gru_recurrent": lambda: L.GRU(4, recurrent_dropout=0.3),
    "rnn_both_seq": lambda: L.SimpleRNN(4, dropout=0.3, recurrent_dropout=0.3, return_sequences=True),
    "bi_lstm_both_seq": lambda: L.Bidirectional(L.LSTM(4, dropout=0.3, recurrent_dropout=0.2, return_sequences=True)),
}
# Keras's draws per call: (input masks, recurrent masks), one per gate under implementation 1.
DRAWS = {"lstm_seq": 1, "lstm_both": 8, "lstm_recurrent_seq": 4, "gru_both_seq": 6, "gru_before_both": 6,
         "gru_recurrent": 3, "rnn_both_seq": 2, "bi_lstm_both_seq": 8}


@pytest.mark.parametrize("case, policy", [(case, "float32") for case in sorted(DROPOUT_CASES)]
                         + [("bi_lstm_both_seq", "mixed_bfloat16")])
def test_dropout_draws_each_learners_masks_as_keras(case, policy):
    """Under dropout and recurrent_dropout each learner's slice is Keras's call with that learner's
    seed state (outputs, gradients, the advanced seed states), with a padding mask."""
    layer, weights, x, rng = _setup(DROPOUT_CASES[case], 3, policy)
    assert fused_recurrent.reason(layer) is None
    tol = dict(rtol=1e-5, atol=1e-5) if policy == "float32" else dict(rtol=0.05, atol=0.05)
    expected, seeds = _compare(layer, weights, x, _padding_mask(3), rng, 1, tol)
    assert len(seeds) == len(weights[1]) > 0
    for before, after in zip(weights[1], seeds, strict=True):   # each draw advanced the seed by (0, 1)
        np.testing.assert_array_equal(after - before, [[0, DRAWS[case]]] * 3)
    # The masks matter: without them (training=False) Keras computes other outputs.
    stacks, seed_stacks = weights
    plain = layer.stateless_call([s[0] for s in stacks], [s[0] for s in seed_stacks],
                                 tf.cast(x[0], layer.compute_dtype), training=False)[0]
    assert np.abs(np.float32(plain) - np.float32(expected[0][0])).max() > 1e-2


def test_padding_mask_changes_the_output():
    """The masked comparisons above are not vacuous: the mask changes Keras's own output."""
    layer, weights, x, _ = _setup(CASES["lstm_seq"], 1, "float32")
    plain = _keras(layer, weights, x, None, [tf.zeros(())])[0]
    masked = _keras(layer, weights, x, _padding_mask(1), [tf.zeros(())])[0]
    assert np.abs(plain[0].numpy() - masked[0].numpy()).max() > 1e-3


@pytest.mark.parametrize("make, words", [
    (lambda: L.LSTM(3, dropout=1.0), "dropout rate of 1"),
    (lambda: L.GRU(3, recurrent_dropout=1.0), "dropout rate of 1"),
    (lambda: L.LSTM(3, stateful=True), "stateful"),
    (lambda: L.LSTM(3, return_state=True), "return_state"),
    (lambda: L.SimpleRNN(3, unroll=True), "unroll"),
    (lambda: L.LSTM(3, recurrent_regularizer="l2"), "regularizer"),
    (lambda: L.Bidirectional(L.LSTM(3, return_state=True)), "return_state"),
    (lambda: L.Bidirectional(L.LSTM(3, unroll=True)), "forward layer"),
    (lambda: L.Dense(3), "not a recurrent layer"),
    (lambda: L.RNN(L.LSTMCell(3)), "not a recurrent layer"),
])
def test_reason_refuses(make, words):
    why = fused_recurrent.reason(make())
    assert why is not None and words in why


def test_initial_state_is_refused():
    layer, (stacks, _), x, _ = _setup(CASES["lstm"], 1, "float32")
    ctx = ArrayContext.of(layer.trainable_variables, stacks, layer.compute_dtype)
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent.apply(ctx, layer, (ctx.to_fused(x),), {"initial_state": [tf.zeros((B, 4))] * 2})


def _dropout_engine(learners, devices, steps=2):
    from crossbow_tf.algorithms import SMA
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine.core import Engine
    keras.utils.set_random_seed(0)
    tokens = keras.Input((T,), dtype="int32")
    x = L.Embedding(9, C, mask_zero=True)(tokens)
    x = L.Bidirectional(L.LSTM(4, dropout=0.3, recurrent_dropout=0.2, return_sequences=True))(x)
    x = L.GRU(4, dropout=0.2)(x)
    model = keras.Model(tokens, L.Dense(2)(x))
    engine = Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), SMA(),
                    CrossbowStrategy(devices=devices, learners_per_device=2), learners=learners)
    rng = np.random.default_rng(0)
    kb = engine.num_learners * B
    losses = []
    for _ in range(steps):
        ids = rng.integers(1, 9, (kb, T)).astype(np.int32)
        ids[:, 3:] *= rng.random((kb, T - 3)) < 0.5           # padding, so the masks matter
        losses.append(float(engine.train_step(ids, rng.integers(0, 2, kb).astype(np.int32), np.ones(kb), 0.5)[0]))
    return engine, losses, [w.numpy() for w in model.trainable_variables]


def test_recurrent_dropout_in_the_engine_equals_replicated_learners(cpu_devices):
    """A model with recurrent dropout runs fused (no fallback) and trains as replicated learners do:
    losses, every learner's weights and the cells' seed states after SMA steps."""
    from crossbow_tf.engine.fused import FusedLearners
    fused, losses_f, _ = _dropout_engine("fused", cpu_devices[:1])
    replicated, losses_r, initial = _dropout_engine("replicated", cpu_devices[:1])
    assert isinstance(fused.learner_computation, FusedLearners)
    np.testing.assert_allclose(losses_f, losses_r, atol=2e-5, rtol=0)
    moved = 0.0
    for la, lb in zip(fused.learner_weights(), replicated.learner_weights(), strict=True):
        assert len(la) == len(lb) == len(initial)
        for a, b in zip(la, lb, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
        moved = max(moved, max(float(np.abs(a - w0).max()) for a, w0 in zip(la, initial, strict=True)))
    assert moved > 1e-3
    states_f = [s.numpy() for d in fused.states for s in d]
    states_r = [s.numpy() for d in replicated.states for s in d]
    assert len(states_f) == len(states_r) > 0
    for a, b in zip(states_f, states_r, strict=True):
        np.testing.assert_array_equal(a, b)
