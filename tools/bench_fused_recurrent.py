"""Forward+backward of Bidirectional(LSTM(64, return_sequences=True)) then Bidirectional(LSTM(64)) on
embedded tokens (b per learner, length L, D=128), under tf.function, at m = 2, 4, 8 learners:
crossbow_tf's fused recurrent form vs a python loop of m stateless_calls vs tf.vectorized_map of
stateless_call vs one Keras model at batch m*b. Prints examples/s, ratios to the m*b model, and the
first call's time (tracing) beside them.

    PYTHONPATH=$PWD python tools/bench_fused_recurrent.py [--length 100] [--iterations 5]
"""
import argparse
import sys
import time

import numpy as np
import tensorflow as tf
from keras import layers as L

from crossbow_tf.engine import fused_recurrent
from crossbow_tf.engine.fused_testing import ArrayContext

D, UNITS = 128, 64


def _layers(length):
    first = L.Bidirectional(L.LSTM(UNITS, return_sequences=True))
    second = L.Bidirectional(L.LSTM(UNITS))
    first.build((None, length, D))
    second.build((None, length, 2 * UNITS))
    return first, second


def _variants(first, second):
    variables = first.trainable_variables + second.trainable_variables
    n1 = len(first.trainable_variables)
    seeds = list(first.non_trainable_variables), list(second.non_trainable_variables)

    def keras_forward(weights, x):
        y, _ = first.stateless_call(weights[:n1], seeds[0], x, training=True)
        y, _ = second.stateless_call(weights[n1:], seeds[1], y, training=True)
        return y

    def fused(stacks, x):                     # x (m, b, L, D)
        ctx = ArrayContext.of(variables, stacks)
        y = fused_recurrent.apply(ctx, first, (tf.transpose(x, [1, 2, 0, 3]),), {})
        return fused_recurrent.apply(ctx, second, (y,), {})

    def loop(stacks, x):
        return tf.stack([keras_forward([s[i] for s in stacks], x[i]) for i in range(x.shape[0])])

    def vmap(stacks, x):
        return tf.vectorized_map(lambda args: keras_forward(list(args[0]), args[1]), (tuple(stacks), x))

    def one_model(stacks, x):                 # one learner's weights, batch m*b
        m, b = x.shape[0], x.shape[1]
        return keras_forward([s[0] for s in stacks], tf.reshape(x, [m * b] + x.shape[2:]))
    return variables, {"fused": fused, "loop": loop, "vectorized_map": vmap, "keras m*b": one_model}


def _step_fn(forward):
    @tf.function
    def step(stacks, x):
        with tf.GradientTape() as tape:
            tape.watch(stacks)
            loss = tf.reduce_sum(tf.square(forward(stacks, x)))
        return loss, tape.gradient(loss, stacks)
    return step


def _time(forward, stacks, x, iterations):
    step = _step_fn(forward)
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), step(stacks, x))
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(iterations):
        tf.nest.map_structure(lambda t: t.numpy(), step(stacks, x))
    return first, (time.perf_counter() - start) / iterations


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4, help="examples per learner")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--learners", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    if args.length < 1 or args.batch < 1 or args.iterations < 1 or min(args.learners) < 1:
        print("bench_fused_recurrent: --length, --batch, --iterations and --learners must be >= 1", file=sys.stderr)
        return 2
    first, second = _layers(args.length)
    variables, variants = _variants(first, second)
    rng = np.random.default_rng(0)
    print(f"L={args.length} b={args.batch} D={D} units={UNITS}; examples/s (ratio to keras m*b), first call s")
    for m in args.learners:
        stacks = [tf.constant(np.stack([v.numpy()] * m) + rng.normal(0, 0.01, (m,) + tuple(v.shape)), tf.float32)
                  for v in variables]
        x = tf.constant(rng.normal(size=(m, args.batch, args.length, D)), tf.float32)
        results = {}
        for name, forward in variants.items():
            try:
                results[name] = _time(forward, stacks, x, args.iterations)
            except Exception as e:   # vectorized_map may not vectorize the while loop: say so, go on
                results[name] = f"failed ({type(e).__name__}: {str(e).splitlines()[0][:60]})"
        base = m * args.batch / results["keras m*b"][1]
        cells = []
        for name, result in results.items():
            if isinstance(result, str):
                cells.append(f"{name}: {result}")
                continue
            rate = m * args.batch / result[1]
            cells.append(f"{name}: {rate:7.1f}/s ({rate / base:.2f}x) first {result[0]:.1f}s")
        print(f"m={m}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
