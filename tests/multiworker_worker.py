"""One process of the multi-worker tests: trains a few SMA iterations of a small CNN (small_cnn) on
the embedded MNIST digits through the engine and then through Keras's fit, and saves z before and after each.
Run with TF_CONFIG for a worker of a cluster, without it for one process.

    python tests/multiworker_worker.py engine|keras|both OUT --devices D --learners M
        [--iterations N] [--timeout S] [--rules sma sma_h3 diloco_h3 sma_adam sma_adam_nm sma_f16 sma_adam_f16]
        [--resume RULE ...]

writes OUT.engine.npz, OUT.engine.initial.npz (and the same for keras); each rule of --rules
but "sma" trains through the engine too, into OUT.engine_RULE.npz. A rule with a Keras optimizer
for the learners (sma_adam: Adam; sma_adam_nm: Adam with noise matching) or under mixed_float16
(sma_f16, sma_adam_f16: one learner's gradients overflow in iteration 1; their loss scale and good
steps go to OUT.engine_RULE.scale.npz) also writes this worker's learners, OUT.engine_RULE.learners.npz, and with noise matching its running means (device 0's),
OUT.engine_RULE.noise.npz. For each rule of --resume a checkpoint is written after N // 2 + 1
iterations (the chief's, in OUT.engine_RULE.ckpt), and a fresh engine restored from it trains the
rest, into OUT.engine_RULE.resumed.npz (z and state) and .resumed.learners.npz; with noise matching
also .stopped.noise.npz and .restored.noise.npz (the running means saved, and just after the restore).
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
    p.add_argument("--resume", nargs="*", choices=sorted(RULES), default=[])
    return p.parse_args()


def _rules():
    """Per rule name: the update rule, the Engine's options and the learning rate."""
    import keras
    from crossbow_tf.algorithms import SMA, LocalSGD
    return {"sma": (SMA(), {}, 0.05),
            "sma_h3": (SMA(alpha=0.3, central_step=1.5, sync_period=3), {}, 0.05),
            "diloco_h3": (LocalSGD(period=3, outer_learning_rate=0.7, outer_momentum=0.9, nesterov=True), {}, 0.05),
            "sma_adam": (SMA(momentum=0.0), dict(optimizer=keras.optimizers.Adam()), ADAM_LR),
            "sma_adam_nm": (SMA(momentum=0.0), dict(optimizer=keras.optimizers.Adam(), noise_matching=True), ADAM_LR),
            "sma_f16": (SMA(), dict(loss_scale=True), 0.05),
            "sma_adam_f16": (SMA(momentum=0.0), dict(optimizer=keras.optimizers.Adam(), loss_scale=True), ADAM_LR)}


RULES = ("sma", "sma_h3", "diloco_h3", "sma_adam", "sma_adam_nm", "sma_f16", "sma_adam_f16")
# Under mixed_float16 (the rules ending in _f16), iteration OVERFLOW_ITERATION's rows of global
# learner OVERFLOW_LEARNER (one of the second worker's) are infinite in float16: only that learner's
# gradients overflow, and every worker must skip the iteration.
OVERFLOW_ITERATION, OVERFLOW_LEARNER = 1, 5
ADAM_LR = 0.002


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
            out = f"{args.out}.engine" + ("" if rule == "sma" else f"_{rule}")
            train_engine(strategy, data, args, out, *_rules()[rule], resume=rule in args.resume)
    print("done", flush=True)


def fresh_model(strategy, data, policy="float32"):
    import keras
    # Each worker draws other initial weights: every worker must start from the chief's.
    keras.utils.set_random_seed(7 + 1000 * strategy.worker_index)
    saved = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        return small_cnn(data.input_shape, data.num_classes)
    finally:
        keras.mixed_precision.set_global_policy(saved)


def small_cnn(input_shape, num_classes):
    """A convolution, a Dropout and a Dense layer (4 weights and a seed state), a few channels wide:
    what these tests check (the same bits on every worker, one all-reduce per step, skips, stops and
    resumes) does not depend on depth or width, and every engine traces and compiles its steps once
    per weight and device. Also a user's model (multiworker_worker.py:small_cnn) for the command-line
    tests."""
    import keras
    return keras.Sequential([keras.Input(input_shape),
                             keras.layers.Conv2D(4, 5, padding="valid", activation="relu"),
                             keras.layers.MaxPooling2D(2),
                             keras.layers.Flatten(),
                             keras.layers.Dropout(0.4),
                             keras.layers.Dense(num_classes)], name="small_cnn")


def _with_an_overflow(strategy, batches):
    """BATCHES with OVERFLOW_LEARNER's rows of iteration OVERFLOW_ITERATION at 1e30 (infinite in
    float16), on the worker that trains that learner."""
    import numpy as np
    local = OVERFLOW_LEARNER - strategy.first_learner
    if not 0 <= local < strategy.local_learners:
        return batches
    x, *rest = batches[OVERFLOW_ITERATION]
    x = np.array(x)
    x[local * BATCH:(local + 1) * BATCH] = 1e30
    return batches[:OVERFLOW_ITERATION] + [(x, *rest)] + batches[OVERFLOW_ITERATION + 1:]


def save(path, center, states, losses=(), collectives=-1, local_collectives=-1):
    import numpy as np
    np.savez(path, *center, *states, losses=np.array(losses), collectives=np.array(collectives),
             local_collectives=np.array(local_collectives))


def _collectives_per_step(engine, x, y, mask, *count, step=None):
    """The collective all-reduce ops in the engine's compiled step (or STEP), nested functions included."""
    import tensorflow as tf
    # The arguments exactly as train_step passes them: the trace that trained is the one counted
    # (and none is made again).
    x, y, mask = engine._checked_batch(x, y, mask, local=bool(count))
    count = [tf.cast(c, tf.float32) for c in count] or [None]
    step = step or engine._step
    traces = step.experimental_get_tracing_count()
    graph = step.get_concrete_function(x, y, mask, tf.cast(0.05, tf.float32), *count).graph
    assert step.experimental_get_tracing_count() == traces, "the step was traced again to count its ops"
    count = sum(op.type == "CollectiveReduceV2" for op in graph.get_operations())
    for function in graph._functions.values():
        count += sum(node.op == "CollectiveReduceV2" for node in function.cached_definition.node_def)
    return count


def _batches(strategy, data, n):
    """The first N iterations' batches of this worker, as the trainer feeds them."""
    import keras
    from crossbow_tf.data.pipeline import train_batches
    # The example order must be the same on every worker (tf.data's shuffle also reads the global seed).
    # Like the trainer, a worker reads only its own learners' rows of every iteration.
    keras.utils.set_random_seed(7)
    start = strategy.first_learner * BATCH
    rows = (start, start + strategy.local_learners * BATCH) if strategy.num_workers > 1 else None
    batches = iter(train_batches(data.train, strategy.num_learners * BATCH, epoch=1, seed=3,
                                 map_fn=data.train_map, rows=rows))
    return [next(batches) for _ in range(n)]


def _engine(strategy, data, rule, options):
    import keras
    from crossbow_tf.engine.core import Engine
    model = fresh_model(strategy, data, "mixed_float16" if options.get("loss_scale") else "float32")
    return Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), rule, strategy, **options)


def _train(strategy, engine, batches, lr):
    """The engine's iterations on BATCHES; their losses."""
    losses = []
    with strategy.cluster.guard() if strategy.cluster else contextlib.nullcontext():
        for x, y, mask, *count in batches:
            loss, _ = engine.train_step(x, y, mask, lr, *count)
            losses.append(float(loss))
    return losses


def _save_learners(engine, out):
    """With a Keras optimizer for the learners or loss scaling: this worker's learners' weights."""
    if engine.optimizers is not None or engine.loss_scale is not None:
        save(out + ".learners.npz", [w for learner in engine.learner_weights() for w in learner], [])


def _save_noise(engine, out):
    """With noise matching: its running means on the first device."""
    if engine.noise_decay is not None:
        save(out + ".noise.npz", [v.numpy() for v in engine.learner_square[0] + engine.global_square[0]], [])


def train_engine(strategy, data, args, out, rule, options, lr, resume=False):
    """RESUME: also a checkpoint after N // 2 + 1 iterations (the chief's, in OUT.ckpt), from which a
    fresh engine (as a resumed process builds it) trains the rest."""
    from crossbow_tf.engine.checkpoint import Checkpoints, Progress
    from crossbow_tf.results import RunResults
    batches = _batches(strategy, data, args.iterations)
    if options.get("loss_scale"):
        batches = _with_an_overflow(strategy, batches)
    engine = _engine(strategy, data, rule, options)
    save(out + ".initial.npz", engine.center_weights(), [s.numpy() for s in engine.center_states[0]])
    stop = args.iterations // 2 + 1 if resume else args.iterations
    losses = _train(strategy, engine, batches[:stop], lr)
    if resume:
        Checkpoints(out + ".ckpt", engine).save(Progress(iteration=stop), RunResults("sma", {}, env={}))
        _save_noise(engine, out + ".stopped")
        losses += _train(strategy, engine, batches[stop:], lr)
    x, y, mask, *count = batches[-1]
    local = (_collectives_per_step(engine, x, y, mask, *count, step=engine._local_step)
             if engine.algorithm.sync_period > 1 else -1)
    save(out + ".npz", engine.center_weights(), [s.numpy() for s in engine.center_states[0]], losses,
         collectives=_collectives_per_step(engine, x, y, mask, *count), local_collectives=local)
    _save_learners(engine, out)
    _save_noise(engine, out)
    if engine.loss_scale is not None:
        save(out + ".scale.npz", [engine.loss_scale.numpy(), engine.good_steps.numpy()], [])
    if resume:
        resumed = _engine(strategy, data, rule, options)
        _, progress = Checkpoints(out + ".ckpt", resumed).restore_newest(RunResults("sma", {}, env={}),
                                                                         log=lambda line: None)
        assert progress.iteration == stop
        resumed.iteration = stop
        _save_noise(resumed, out + ".restored")
        losses = _train(strategy, resumed, batches[stop:], lr)
        save(out + ".resumed.npz", resumed.center_weights(), [s.numpy() for s in resumed.center_states[0]], losses)
        _save_learners(resumed, out + ".resumed")


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
