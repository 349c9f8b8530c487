"""One process of the multi-worker tests: trains a few SMA iterations of LeNet on the embedded MNIST
digits and saves z. Run with TF_CONFIG for a worker of a cluster, without it for one process.

    python tests/multiworker_worker.py engine|keras OUT.npz --devices D --learners M
        [--iterations N] [--timeout S] [--sleep-per-iteration S]
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BATCH = 8   # per learner


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("path", choices=("engine", "keras"))
    p.add_argument("out")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--learners", type=int, required=True)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--timeout", type=float, default=15.0)
    p.add_argument("--sleep-per-iteration", type=float, default=0.0)
    return p.parse_args()


def main():
    args = parse()
    import tensorflow as tf
    from crossbow_tf.distribute import CrossbowStrategy
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver() if os.environ.get("TF_CONFIG") else None
    strategy = CrossbowStrategy(learners_per_device=args.learners, logical_cpu_devices=args.devices,
                                cluster_resolver=resolver, worker_timeout=args.timeout)
    import keras
    import numpy as np
    from crossbow_tf.data import load_dataset
    from crossbow_tf.models import build_model
    from crossbow_tf.data.pipeline import train_batches
    data = load_dataset("mnist_embedded")
    k = strategy.num_learners
    # The example order must be the same on every worker (tf.data's shuffle also reads the global seed)...
    keras.utils.set_random_seed(7)
    batches = iter(train_batches(data.train, k * BATCH, epoch=1, seed=3, map_fn=data.train_map))
    # ... while the initial weights may differ: every worker starts from the chief's.
    keras.utils.set_random_seed(7 + 1000 * strategy.worker_index)
    model = build_model("lenet", data.input_shape, data.num_classes)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if args.path == "engine":
        from crossbow_tf.algorithms import SMA
        from crossbow_tf.engine.core import Engine
        engine = Engine(model, loss, SMA(), strategy)
        losses = []
        with (strategy.cluster.guard() if strategy.cluster else _nothing()):
            for i in range(args.iterations):
                x, y, mask = next(batches)
                value, _ = engine.train_step(x, y, mask, 0.05)
                losses.append(float(value))
                print(f"iteration {i + 1} loss {losses[-1]:.6f}", flush=True)
                time.sleep(args.sleep_per_iteration)
        center = engine.center_weights()
        states = [s.numpy() for s in engine.center_states[0]]
    else:
        import crossbow_tf
        x, y = _first_examples(data.train, args.iterations * k * BATCH, data.train_map)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss, metrics=["accuracy"])
        crossbow_tf.use_sma(model, strategy)
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        losses = history.history["loss"]
        center = [v.numpy() for v in model.trainable_variables]
        states = [v.numpy() for v in model.non_trainable_variables]
    np.savez(args.out, *center, *states, losses=np.array(losses))
    print("done", flush=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _first_examples(split, n, map_fn):
    import numpy as np
    ds = split.dataset.take(n)
    if map_fn is not None:
        ds = ds.map(map_fn)
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in ds])
    return np.stack(xs), np.stack(ys)


if __name__ == "__main__":
    sys.exit(main())
