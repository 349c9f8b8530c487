"""Iteration time of the learners' optimizers: the rule's fused momentum SGD against Keras optimizers.

    python tools/bench_learner_optimizers.py [--rounds 5] [--learners-per-device 4] [--batch 16]

LeNet on random MNIST-shaped data, SMA on 2 logical CPU devices. The engines are measured in
alternating rounds of 10 iterations (the machine may be shared); each variant's best round median
is printed.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crossbow_tf.distribute.devices import split_cpu  # noqa: E402  (before TensorFlow runs anything)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--learners-per-device", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="per learner")
    args = p.parse_args()
    devices = split_cpu(2)
    import keras
    import numpy as np

    from crossbow_tf.algorithms import SMA
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine.core import Engine
    from crossbow_tf.models import build_model

    m, b = args.learners_per_device, args.batch
    rng = np.random.default_rng(0)
    x = rng.random((len(devices) * m * b, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, len(devices) * m * b).astype(np.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variants = [("momentum SGD (rule, XLA)", None, True), ("Adam, XLA update", keras.optimizers.Adam(), True),
                ("Adam, no XLA", keras.optimizers.Adam(), False),
                ("SGD nesterov, XLA", keras.optimizers.SGD(momentum=0.9, nesterov=True), True),
                ("RMSprop, XLA", keras.optimizers.RMSprop(), True)]
    engines = []
    for name, optimizer, jit in variants:
        keras.utils.set_random_seed(0)
        model = build_model("lenet", (28, 28, 1), 10)
        engine = Engine(model, loss, SMA() if optimizer is None else SMA(momentum=0.0),
                        CrossbowStrategy(devices=devices, learners_per_device=m), optimizer=optimizer,
                        jit_update=jit)
        for _ in range(3):   # tracing and XLA compilation
            engine.train_step(x, y, None, 0.001)
        engines.append((name, engine))
    best = {name: float("inf") for name, _ in engines}
    for _ in range(args.rounds):
        for name, engine in engines:
            times = []
            for _ in range(10):
                start = time.perf_counter()
                loss_value, _ = engine.train_step(x, y, None, 0.001)
                float(loss_value)
                times.append(time.perf_counter() - start)
            best[name] = min(best[name], float(np.median(times)))
    for name, seconds in best.items():
        print(f"{name:26s} {1000 * seconds:6.1f} ms per iteration (LeNet, {len(devices)} devices x {m} learners "
              f"of {b})", flush=True)


if __name__ == "__main__":
    main()
