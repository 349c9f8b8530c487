"""One process of the multi-worker tests: trains a few SMA iterations of LeNet on the embedded MNIST
digits through the engine and then through Keras's fit, and saves z before and after each.
Run with TF_CONFIG for a worker of a cluster, without it for one process.

    python tests/multiworker_worker.py engine|keras|both OUT --devices D --learners M
        [--iterations N] [--timeout S] [--rules sma sma_h3 diloco_h3]

writes OUT.engine.npz, OUT.engine.initial.npz (and the same for keras); each rule of --rules
but "sma" trains through the engine too, into OUT.engine_RULE.npz.
"""
import argparse
import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BATCH = 8   # per learner


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("path", choices=("engine", "keras", "both"))
    p.add_argument("out")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--learners", type=int, required=True)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--timeout", type=float, default=15.0)
    p.add_argument("--rules", nargs="+", choices=sorted(RULES), default=["sma"])
    return p.parse_args()


def _rules():
    from crossbow_tf.algorithms import SMA, LocalSGD
    return {"sma": SMA(),
            "sma_h3": SMA(alpha=0.3, central_step=1.5, sync_period=3),
            "diloco_h3": LocalSGD(period=3, outer_learning_rate=0.7, outer_momentum=0.9, nesterov=True)}


RULES = ("sma", "sma_h3", "diloco_h3")


def main():
    args = parse()
    import tensorflow as tf
    from crossbow_tf.distribute import CrossbowStrategy
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver() if os.environ.get("TF_CONFIG") else None
    strategy = CrossbowStrategy(learners_per_device=args.learners, logical_cpu_devices=args.devices,
                                cluster_resolver=resolver, worker_timeout=args.timeout)
    from crossbow_tf.data import load_dataset
    data = load_dataset("mnist_embedded")
    for path in ("engine", "keras") if args.path == "both" else (args.path,):
        if path == "keras":
            train_keras(strategy, data, args, f"{args.out}.keras")
            continue
        for rule in args.rules:
            train_engine(strategy, data, args, f"{args.out}.engine" + ("" if rule == "sma" else f"_{rule}"),
                         _rules()[rule])
    print("done", flush=True)


def fresh_model(strategy, data):
    import keras
    from crossbow_tf.models import build_model
    # Each worker draws other initial weights: every worker must start from the chief's.
    keras.utils.set_random_seed(7 + 1000 * strategy.worker_index)
    return build_model("lenet", data.input_shape, data.num_classes)


def save(path, center, states, losses=(), collectives=-1, local_collectives=-1):
    import numpy as np
    np.savez(path, *center, *states, losses=np.array(losses), collectives=np.array(collectives),
             local_collectives=np.array(local_collectives))


def _collectives_per_step(engine, x, y, mask, *count, step=None):
    """The collective all-reduce ops in the engine's compiled step (or STEP), nested functions included."""
    import tensorflow as tf
    count = [tf.cast(c, tf.float32) for c in count] or [None]
    graph = (step or engine._step).get_concrete_function(x, y, tf.cast(mask, tf.float32), tf.constant(0.05),
                                                         *count).graph
    count = sum(op.type == "CollectiveReduceV2" for op in graph.get_operations())
    for function in graph._functions.values():
        count += sum(node.op == "CollectiveReduceV2" for node in function.cached_definition.node_def)
    return count


def train_engine(strategy, data, args, out, rule):
    import keras
    from crossbow_tf.data.pipeline import train_batches
    from crossbow_tf.engine.core import Engine
    # The example order must be the same on every worker (tf.data's shuffle also reads the global seed).
    # Like the trainer, a worker reads only its own learners' rows of every iteration.
    keras.utils.set_random_seed(7)
    start = strategy.first_learner * BATCH
    rows = (start, start + strategy.local_learners * BATCH) if strategy.num_workers > 1 else None
    batches = iter(train_batches(data.train, strategy.num_learners * BATCH, epoch=1, seed=3,
                                 map_fn=data.train_map, rows=rows))
    model = fresh_model(strategy, data)
    engine = Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), rule, strategy)
    save(out + ".initial.npz", engine.center_weights(), [s.numpy() for s in engine.center_states[0]])
    losses = []
    with strategy.cluster.guard() if strategy.cluster else contextlib.nullcontext():
        for _ in range(args.iterations):
            x, y, mask, *count = next(batches)
            loss, _ = engine.train_step(x, y, mask, 0.05, *count)
            losses.append(float(loss))
    local = (_collectives_per_step(engine, x, y, mask, *count, step=engine._local_step)
             if engine.algorithm.synchronisation_period > 1 else -1)
    save(out + ".npz", engine.center_weights(), [s.numpy() for s in engine.center_states[0]], losses,
         collectives=_collectives_per_step(engine, x, y, mask, *count), local_collectives=local)


def train_keras(strategy, data, args, out):
    import keras
    import crossbow_tf
    x, y = _first_examples(data.train, args.iterations * strategy.num_learners * BATCH, data.train_map)
    model = fresh_model(strategy, data)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    crossbow_tf.use_sma(model, strategy)
    training = crossbow_tf.keras.sma.get_training(model)
    save(out + ".initial.npz", training.center_weights(), [s.numpy() for s in training.engine.center_states[0]])
    history = model.fit(x, y, batch_size=strategy.num_learners * BATCH, epochs=1, shuffle=False, verbose=0)
    save(out + ".npz", [v.numpy() for v in model.trainable_variables],
         [v.numpy() for v in model.non_trainable_variables], history.history["loss"])


def _first_examples(split, n, map_fn):
    import numpy as np
    ds = split.dataset.take(n)
    if map_fn is not None:
        ds = ds.map(map_fn)
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in ds])
    return np.stack(xs), np.stack(ys)


if __name__ == "__main__":
    sys.exit(main())
