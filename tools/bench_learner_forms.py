"""tools/bench_throughput.py's table for the models of tools/bench_models.py: examples/s of SMA with
fused learners, SMA with replicated learners, and plain Keras at k*b and at b, with each one's first
iteration (tracing included), measured side by side in interleaved rounds (medians reported), one row (one k) at a time.

Every runner trains on the same data through the same pipeline: SMA by Engine.train_step over
train_batches, Keras by fit over the same tf.data batches with SGD and momentum 0.9 (SMA's learner
momentum). The first iteration is timed on a fresh runner: the engine's first train_step, Keras's
first train_on_batch (both trace their step then); one warm-up epoch follows before any timing.
"""
import statistics
import sys
import time

LEARNING_RATE = 0.01
# The models of tools/bench_models.py (named here, so that parsing arguments imports no Keras).
SEQUENCE_MODELS = ("transformer", "bilstm", "vit")


def _keras_runner(make_model, data, batch):
    import keras

    from crossbow_tf.data.pipeline import input_options
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = data.train.dataset.batch(batch).prefetch(2).with_options(input_options())
    x, y = next(iter(ds))
    start = time.perf_counter()
    model.train_on_batch(x, y)
    first = time.perf_counter() - start
    model.fit(ds, epochs=1, verbose=0, shuffle=False)

    def epoch():
        start = time.perf_counter()
        model.fit(ds, epochs=1, verbose=0, shuffle=False)
        return data.train.size / (time.perf_counter() - start)
    return first, epoch


def _sma_runner(make_model, data, devices, k, batch, learners, momentum):
    import keras

    from crossbow_tf.algorithms import SMA
    from crossbow_tf.data.pipeline import train_batches
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine.core import Engine
    strategy = CrossbowStrategy(devices=devices, learners_per_device=k // len(devices))
    engine = Engine(make_model(), keras.losses.SparseCategoricalCrossentropy(from_logits=True), SMA(momentum=momentum),
                    strategy, learners=learners)

    def one_epoch(epoch):
        for x, y, mask in train_batches(data.train, k * batch, epoch, shuffle=False):
            engine.train_step(x, y, mask, LEARNING_RATE)

    x, y, mask = next(iter(train_batches(data.train, k * batch, 0, shuffle=False)))
    start = time.perf_counter()
    float(engine.train_step(x, y, mask, LEARNING_RATE)[0])
    first = time.perf_counter() - start
    one_epoch(0)

    def epoch():
        start = time.perf_counter()
        one_epoch(1)
        return data.train.size / (time.perf_counter() - start)
    return first, epoch


def _runners(args, devices, data, make_model, k):
    """{key: (first iteration s, epoch rate fn)} of one row: ("fused"|"replicated", k), ("keras", b), ("keras", k*b)."""
    import keras

    def fresh():
        keras.utils.set_random_seed(0)
        return make_model()
    b = args.batch_size
    runners = {("keras", batch): _keras_runner(fresh, data, batch) for batch in (b, k * b)}
    for learners in ("fused", "replicated"):
        runners[learners, k] = _sma_runner(fresh, data, devices, k, b, learners, args.learner_momentum[0])
    return runners


def _measure(args, runners):
    """Median examples/s of each runner over interleaved rounds, and the largest spread."""
    samples = {key: [] for key in runners}
    for r in range(args.rounds):
        for key, (_, run) in runners.items():
            samples[key].append(run())
    spread = max((max(v) - min(v)) / statistics.median(v) for v in samples.values())
    return {key: statistics.median(v) for key, v in samples.items()}, spread


def _header(args, devices, data):
    print(f"# {args.model} on {data.name} ({data.train.size} examples per epoch), per-learner batch "
          f"b={args.batch_size}, {len(devices)} logical CPU device(s), SMA learner momentum "
          f"{args.learner_momentum[0]:g}, median of {args.rounds} interleaved rounds per row (examples/s; first "
          "iteration in s, tracing included)\n")
    print("| m per device | k | fused SMA | replicated SMA | Keras at k*b | Keras at b | fused / Keras(k*b) "
          "| replicated / Keras(k*b) | fused / replicated | first iteration: fused, replicated, Keras(k*b) "
          "| first fused / Keras(k*b) | spread |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)


def _row(k, d, b, firsts, med, spread):
    fused, replicated, big, small = med["fused", k], med["replicated", k], med["keras", k * b], med["keras", b]
    first = (firsts["fused", k], firsts["replicated", k], firsts["keras", k * b])
    print(f"| {k // d} | {k} | {fused:.0f} | {replicated:.0f} | {big:.0f} | {small:.0f} | {fused / big:.2f} "
          f"| {replicated / big:.2f} | {fused / replicated:.2f} | {first[0]:.1f}, {first[1]:.1f}, {first[2]:.1f} "
          f"| {first[0] / first[2]:.2f} | {spread:.0%} |", flush=True)
    return dict(m=k // d, k=k, fused=fused, replicated=replicated, keras_global=big, keras_small=small,
                first_fused=first[0], first_replicated=first[1], first_keras_global=first[2], spread=spread)


def main(args, devices):
    """One row per k: its four runners built, then measured in interleaved rounds, then printed
    (spread: the largest (max-min)/median of the row's runners across rounds)."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import bench_models
    data, make_model = bench_models.load(args.model, args.examples or (4000 if args.model == "vit" else 512),
                                         args.sequence_length, args.vocabulary)
    _header(args, devices, data)
    rows = []
    for k in args.ks:
        runners = _runners(args, devices, data, make_model, k)
        med, spread = _measure(args, runners)
        rows.append(_row(k, len(devices), args.batch_size, {key: f for key, (f, _) in runners.items()}, med, spread))
    if args.json:
        import json
        import os
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(model=args.model, data=data.name, examples=data.train.size, devices=len(devices),
                           batch_size=args.batch_size, rounds=args.rounds, rows=rows), f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return 0
