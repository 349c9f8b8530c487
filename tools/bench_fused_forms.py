"""Forward+backward time of the hand-written fused forms (crossbow_tf/engine/fused_sequence.py) beside
the generic form (tf.vectorized_map over stateless_call), a python loop of m stateless_calls, and one
Keras layer at batch m*b, under tf.function. Prints ratios to the hand-written form's time.

    PYTHONPATH=$PWD python tools/bench_fused_forms.py [--iters 20]
"""
import argparse
import sys
import time

import keras
import tensorflow as tf
from keras import layers as L

from crossbow_tf.engine import fused_sequence
from crossbow_tf.engine.fused_testing import ArrayContext

B, T, D, HEADS, VOCAB = 4, 64, 64, 2, 1000


def _case(name, m):
    """(layer, fused inputs, stacked per-learner inputs, call kwargs)."""
    if name == "Embedding":
        layer = L.Embedding(VOCAB, D)
        layer.build((None, T))
        ids = tf.random.uniform((m, B, T), 0, VOCAB, dtype=tf.int32)
        return layer, [ids], [ids]
    x = tf.random.normal((B, T, m, D))
    stacked = tf.transpose(x, [2, 0, 1, 3])
    if name == "LayerNorm":
        layer = L.LayerNormalization()
        layer.build((None, T, D))
        return layer, [x], [stacked]
    layer = L.MultiHeadAttention(num_heads=HEADS, key_dim=D // HEADS)
    layer(stacked[0], stacked[0])
    return layer, [x, x], [stacked, stacked]


def _variants(layer, m, fused_inputs, stacked_inputs):
    weights = [tf.Variable(tf.stack([v.value] * m)) for v in layer.trainable_variables]

    def per_learner(ws, *xs):
        return layer.stateless_call(list(ws), [], *xs)[0]

    def hand(ws):
        ctx = ArrayContext.of(layer.trainable_variables, ws)
        return fused_sequence.apply(ctx, layer, fused_inputs, {})

    to_fused = ArrayContext.to_fused   # the generic form and the loop also end in the fused layout

    def generic(ws):
        return to_fused(tf.vectorized_map(lambda a: per_learner(a[0], *a[1]), (ws, stacked_inputs),
                                 fallback_to_while_loop=False))

    def loop(ws):
        return to_fused(tf.stack([per_learner([w[i] for w in ws], *[x[i] for x in stacked_inputs])
                                  for i in range(m)]))

    big = [tf.reshape(x, [m * x.shape[1], *x.shape[2:]]) for x in stacked_inputs]
    single = [tf.Variable(v.value) for v in layer.trainable_variables]

    def one_layer(ws):
        return layer.stateless_call(list(ws), [], *big)[0]
    return {"hand-written": (hand, weights), "generic vmap": (generic, weights),
            "loop of m": (loop, weights), "one layer m*b": (one_layer, single)}


def _timed(fn, variables, iters):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.cast(fn(variables), tf.float32)))
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
    for _ in range(2):
        [g.numpy() for g in step()]
    start = time.perf_counter()
    for _ in range(iters):
        grads = step()
    [g.numpy() for g in grads]
    return (time.perf_counter() - start) / iters


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if args.iters < 1:
        print("bench_fused_forms: --iters must be at least 1", file=sys.stderr)
        return 2
    print(f"b={B} L={T} D={D} heads={HEADS}; ms per forward+backward, and x the hand-written form's time")
    print(f"{'form':10s} {'m':>2s} {'hand-written':>13s} {'generic vmap':>20s} {'loop of m':>20s} {'one layer m*b':>20s}")
    for name in ("Embedding", "LayerNorm", "MHA"):
        for m in (2, 4, 8):
            layer, fused_inputs, stacked_inputs = _case(name, m)
            times = {k: _timed(fn, ws, args.iters)
                     for k, (fn, ws) in _variants(layer, m, fused_inputs, stacked_inputs).items()}
            hand = times["hand-written"]
            cells = [f"{1e3 * t:8.2f} ({t / hand:5.2f}x)" for k, t in times.items() if k != "hand-written"]
            print(f"{name:10s} {m:2d} {1e3 * hand:13.2f} " + " ".join(f"{c:>20s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
