"""Iteration time of the learners' optimizers: the rule's fused momentum SGD against Keras optimizers.

    python tools/bench_learner_optimizers.py [--rounds 5] [--learners-per-device 4] [--batch 16]

LeNet on random MNIST-shaped data, SMA on 2 logical CPU devices. The engines are measured in
alternating rounds of 10 iterations (the machine may be shared); each variant's best round median
is printed. Adam and RMSprop also run with noise matching (``Engine(noise_matching=True)``), each
measured right next to its counterpart without it, the pair's order flipping every round; the
ratios on / off of the rounds' medians are printed with their spread, and the bytes each device
puts into the iteration's all-reduce with and without noise matching.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crossbow_tf.distribute.devices import split_cpu  # noqa: E402  (before TensorFlow runs anything)


def all_reduce_bytes(model):
    """Bytes of one device's sums in the synchronising iteration's all-reduce (Engine._synchronise):
    without noise matching the corrections (one per weight, in its dtype) and the float states'
    differences from z's; with it also the learners' step sums, share-weighted gradient sums and
    squared-gradient sums, each a float32 sum per weight."""
    import numpy as np
    weights = [int(np.prod(v.shape)) for v in model.trainable_variables]
    corrections = sum(n * np.dtype(v.dtype).itemsize for n, v in zip(weights, model.trainable_variables))
    states = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.non_trainable_variables
                 if np.dtype(v.dtype).kind == "f")
    return corrections + states, corrections + states + 3 * 4 * sum(weights)


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
    # (name, optimizer, jit_update, noise_matching). Noise matching is passed explicitly: the
    # engine's own default is off, only use_sma and the YAML resolve "auto" to on for Adam.
    variants = [("momentum SGD (rule, XLA)", None, True, False),
                ("Adam, XLA update", keras.optimizers.Adam(), True, False),
                ("Adam, noise matching", keras.optimizers.Adam(), True, True),
                ("Adam, no XLA", keras.optimizers.Adam(), False, False),
                ("SGD nesterov, XLA", keras.optimizers.SGD(momentum=0.9, nesterov=True), True, False),
                ("RMSprop, XLA", keras.optimizers.RMSprop(), True, False),
                ("RMSprop, noise matching", keras.optimizers.RMSprop(), True, True)]
    pairs = [("Adam", "Adam, noise matching", "Adam, XLA update"),
             ("RMSprop", "RMSprop, noise matching", "RMSprop, XLA")]
    engines = []
    for name, optimizer, jit, noise in variants:
        keras.utils.set_random_seed(0)
        model = build_model("lenet", (28, 28, 1), 10)
        engine = Engine(model, loss, SMA() if optimizer is None else SMA(momentum=0.0),
                        CrossbowStrategy(devices=devices, learners_per_device=m), optimizer=optimizer,
                        jit_update=jit, noise_matching=noise)
        for _ in range(3):   # tracing and XLA compilation
            engine.train_step(x, y, None, 0.001)
        engines.append((name, engine))
    medians = {name: [] for name, _ in engines}
    for r in range(args.rounds):
        # Every other round in reverse, so that each noise-matching pair is measured in both orders.
        for name, engine in (engines if r % 2 == 0 else engines[::-1]):
            times = []
            for _ in range(10):
                start = time.perf_counter()
                loss_value, _ = engine.train_step(x, y, None, 0.001)
                float(loss_value)
                times.append(time.perf_counter() - start)
            medians[name].append(float(np.median(times)))
    for name, seconds in medians.items():
        print(f"{name:26s} {1000 * min(seconds):6.1f} ms per iteration (LeNet, {len(devices)} devices x {m} learners "
              f"of {b})", flush=True)
    for label, on, off in pairs:
        ratios = np.array(medians[on]) / np.array(medians[off])
        print(f"{label} noise matching on / off: {np.median(ratios):.3f} (median of {len(ratios)} rounds' ratios, "
              f"range {ratios.min():.3f}-{ratios.max():.3f}; best rounds {min(medians[on]) / min(medians[off]):.3f})",
              flush=True)
    without, with_noise = all_reduce_bytes(build_model("lenet", (28, 28, 1), 10))
    print(f"all-reduce per iteration, per device: {without:,} bytes without noise matching (corrections), "
          f"{with_noise:,} with it (+ steps, gradients, squared gradients: {with_noise / without:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
