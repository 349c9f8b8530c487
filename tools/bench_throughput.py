"""Images/s of SMA with k learners of batch b against plain Keras at batch k*b and at batch b.

Every configuration is measured side by side in the same process, interleaved over several
rounds, and the median is reported, so that a shared, noisy machine affects all alike. Each
measurement is one epoch over the embedded MNIST training set (4,000 images) through the same
tf.data pipeline, after one warm-up epoch that absorbs tracing.

    python tools/bench_throughput.py                 # LeNet, b=16, k in 1 2 4 8 16
    python tools/bench_throughput.py --ks 1 8 --rounds 5 --devices 2
    python tools/bench_throughput.py --model resnet32 --data cifar-shaped --examples 512
    python tools/bench_throughput.py --ks 8 --precision float32 mixed_bfloat16   # each side in both
    python tools/bench_throughput.py --ks 8 --conv-forms grouped patches per-learner   # each conv form

The sequence and attention models of tools/bench_models.py (transformer, bilstm, vit) get their own
table: examples/s of SMA with fused learners and with replicated learners (one call per learner), and
of plain Keras at k*b and at b, each beside its first iteration's time (tracing included), m = k /
devices learners per device:

    python tools/bench_throughput.py --model bilstm --devices 2 --ks 4 8 16 --batch-size 4

With several --precision values every runner is built under each Keras global policy and measured
in the same interleaved rounds; a second table gives each policy's images/s over float32's.

The last column is the SMA update's share of an iteration: the in-place learner and central
updates alone (on stand-in gradients), timed side by side with the whole step.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_learner_forms import SEQUENCE_MODELS  # noqa: E402

from crossbow_tf.config import PRECISIONS  # noqa: E402

CONV_FORMS = ("grouped", "grouped-float32", "patches", "per-learner")   # crossbow_tf.engine.conv_forms.FORMS


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet",
                   help=f"a model of crossbow_tf.models, or one of {', '.join(SEQUENCE_MODELS)} (tools/bench_models.py)")
    p.add_argument("--batch-size", type=int, default=16, help="per-learner batch b")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="numbers of learners k")
    p.add_argument("--devices", type=int, default=1, help="logical CPU devices the learners are spread over")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (median reported)")
    p.add_argument("--data", default="mnist", choices=["mnist", "mnist-shaped", "cifar-shaped"],
                   help="embedded MNIST, or random MNIST-shaped (28x28x1) or CIFAR-shaped (32x32x3) images "
                        "with 10 classes (as many as --examples)")
    p.add_argument("--examples", type=int, default=None, help="examples per measured epoch (default: all)")
    p.add_argument("--no-jit-update", dest="jit_update", action="store_false",
                   help="run the update without XLA (to see what the XLA-fused update saves)")
    p.add_argument("--learner-momentum", type=float, nargs="+", default=[0.9],
                   help="SMA's learner momentum, one row per value (0: plain learner steps, no velocities)")
    p.add_argument("--learners", default="fused", choices=["fused", "replicated"],
                   help="how a device runs its learners")
    p.add_argument("--precision", nargs="+", default=["float32"], choices=PRECISIONS,
                   help="Keras global dtype policies to measure every runner under (side by side)")
    p.add_argument("--conv-forms", nargs="+", default=["auto"], choices=["auto", *CONV_FORMS],
                   help="forms of the fused learners' convolutions to measure side by side (auto: the one the "
                        "engine chooses here; a form that does not compute here is reported and left out)")
    p.add_argument("--json", metavar="FILE", help="also write the table's numbers to FILE (JSON)")
    p.add_argument("--sequence-length", type=int, default=64, help="tokens per review (transformer, bilstm)")
    p.add_argument("--vocabulary", type=int, default=20000, help="token ids (transformer, bilstm; keras-io's 20000)")
    args = p.parse_args(argv)
    bad = [k for k in args.ks if k < 1 or k % args.devices]
    if bad:
        p.error(f"--ks {bad[0]} is not a positive multiple of --devices {args.devices}")
    if args.rounds < 1 or args.batch_size < 1:
        p.error("--rounds and --batch-size must be at least 1")
    if any(not 0 <= mu < 1 for mu in args.learner_momentum):
        p.error("--learner-momentum values must be in [0, 1)")
    if args.model in SEQUENCE_MODELS and (args.sequence_length < 1 or args.vocabulary < 123):
        p.error("--sequence-length must be at least 1 and --vocabulary at least 123 (the synthetic task's words)")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from crossbow_tf.distribute.devices import split_cpu
    devices = split_cpu(args.devices)
    if args.model in SEQUENCE_MODELS:
        from bench_learner_forms import main as forms_main
        return forms_main(args, devices)
    import keras
    import numpy as np
    import tensorflow as tf

    from crossbow_tf.algorithms import SMA
    from crossbow_tf.data import from_arrays, load_embedded_mnist
    from crossbow_tf.data.pipeline import input_options, train_batches
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine import conv_forms
    from crossbow_tf.engine.core import Engine
    from crossbow_tf.models import build_model

    if args.data == "mnist":
        (xa, ya), _ = load_embedded_mnist()
    else:
        rng = np.random.default_rng(0)
        shape = (28, 28, 1) if args.data == "mnist-shaped" else (32, 32, 3)
        count = args.examples or 4000
        xa = rng.random((count,) + shape, dtype=np.float32)
        ya = rng.integers(0, 10, count).astype(np.int32)
    n = min(args.examples or len(ya), len(ya))
    data = from_arrays(args.data, (xa[:n], ya[:n]), (xa[:1], ya[:1]), num_classes=10)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    b = args.batch_size

    def fresh_model(precision):
        keras.utils.set_random_seed(0)
        keras.mixed_precision.set_global_policy(precision)
        try:
            return build_model(args.model, data.input_shape, data.num_classes)
        finally:
            keras.mixed_precision.set_global_policy("float32")

    def keras_runner(batch, precision):
        model = fresh_model(precision)
        # Under mixed_float16 Keras's compile wraps the SGD in its LossScaleOptimizer.
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        # The same input set-up as the engine's pipeline (crossbow_tf.data.pipeline), so that both
        # sides are measured with the same tf.data threading.
        ds = data.train.dataset.batch(batch).prefetch(2).with_options(input_options())
        model.fit(ds, epochs=1, verbose=0, shuffle=False)           # warm-up: traces the step

        def epoch():
            start = time.perf_counter()
            model.fit(ds, epochs=1, verbose=0, shuffle=False)
            return data.train.size / (time.perf_counter() - start)
        return epoch

    def sma_runner(k, momentum, precision, form):
        strategy = CrossbowStrategy(devices=devices, learners_per_device=k // len(devices))
        with conv_forms.forcing(None if form == "auto" else form):
            engine = Engine(fresh_model(precision), loss, SMA(momentum=momentum), strategy, learners=args.learners,
                            jit_update=args.jit_update)

        def one_epoch(epoch):
            for x, y, mask in train_batches(data.train, k * b, epoch, shuffle=False):
                engine.train_step(x, y, mask, 0.01)
        one_epoch(0)

        def epoch():
            start = time.perf_counter()
            one_epoch(1)
            return data.train.size / (time.perf_counter() - start)

        # The update alone, on stand-in gradients, and one whole step, timed back to back.
        grads = [[tf.random.normal(w.shape) for w in device_weights] for device_weights in engine.weights]
        lr = tf.constant(0.01)

        @tf.function(autograph=False)
        def update_only():
            for d in range(len(devices)):
                totals = engine.update_learners(d, grads[d], lr, [1.0] * len(grads[d]))
                engine.update_center(d, totals, lr)
            return lr
        xb, yb, mb = next(iter(train_batches(data.train, k * b, 0, shuffle=False)))

        def update_share():
            update_only()
            engine.train_step(xb, yb, mb, 0.01)
            start = time.perf_counter()
            for _ in range(5):
                update_only().numpy()
            mid = time.perf_counter()
            for _ in range(5):
                float(engine.train_step(xb, yb, mb, 0.01)[0])
            return (mid - start) / (time.perf_counter() - mid)
        chosen = getattr(engine.learner_computation, "conv_forms", {})
        return epoch, update_share, ", ".join(sorted({form for form, _ in chosen.values()})) or "-"

    runners, shares, used = {}, {}, {}
    rows = []
    for p in args.precision:
        for k in args.ks:
            for mu in args.learner_momentum:
                for form in args.conv_forms:
                    for batch in (b, k * b):
                        if ("keras", batch, p) not in runners:
                            runners["keras", batch, p] = keras_runner(batch, p)
                    try:
                        runners[("sma", k, mu, p, form)], shares[k, mu, p, form], used[k, mu, p, form] = \
                            sma_runner(k, mu, p, form)
                    except conv_forms.NoConvolutionForm as e:
                        print(f"k={k} {p} conv form {form}: left out: {e}", file=sys.stderr)
                        continue
                    rows.append((k, mu, p, form))
    samples = {key: [] for key in runners}
    share_samples = {row: [] for row in rows}
    for r in range(args.rounds):
        for key, run in runners.items():   # each runner's model carries its own dtype policy
            samples[key].append(run())
        for row, share in shares.items():
            share_samples[row].append(share())
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    med = {key: statistics.median(v) for key, v in samples.items()}

    print(f"# {args.model} on {args.data} ({data.train.size} examples per epoch), per-learner batch b={b}, "
          f"{len(devices)} logical CPU device(s), update {'with' if args.jit_update else 'without'} XLA, "
          f"{args.learners} learners, median of {args.rounds} interleaved rounds (images/s)")
    print(f"# CPU: {conv_forms.cpu_summary()}; oneDNN {'on' if conv_forms.onednn_enabled() else 'off'} in this "
          f"process\n")
    print("| k | learner momentum | SMA k x b | Keras at k*b | Keras at b | SMA / Keras(k*b) | SMA / Keras(b) "
          "| update share | precision | conv form |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for k, mu, p, form in rows:
        sma, big, small = med[("sma", k, mu, p, form)], med[("keras", k * b, p)], med[("keras", b, p)]
        share = statistics.median(share_samples[k, mu, p, form])
        table.append(dict(precision=p, k=k, learner_momentum=mu, batch_size=b, global_batch=k * b, sma=sma,
                          keras_global=big, keras_small=small, update_share=share, conv_form=used[k, mu, p, form]))
        print(f"| {k} | {mu:g} | {sma:.0f} | {big:.0f} | {small:.0f} | {sma / big:.2f} | {sma / small:.2f} "
              f"| {share:.0%} | {p} | {used[k, mu, p, form]} |")
    others = [p for p in args.precision if p != "float32"]
    if "float32" in args.precision and others:
        print("\nimages/s under each policy over float32's (same round-interleaved medians)\n")
        print("| k | learner momentum | SMA k x b | Keras at k*b | Keras at b | precision |")
        print("|---|---|---|---|---|---|")
        for k, mu, p, form in rows:
            if p != "float32" and ("sma", k, mu, "float32", form) in med:
                print(f"| {k} | {mu:g} | {med['sma', k, mu, p, form] / med['sma', k, mu, 'float32', form]:.2f} "
                      f"| {med['keras', k * b, p] / med['keras', k * b, 'float32']:.2f} "
                      f"| {med['keras', b, p] / med['keras', b, 'float32']:.2f} | {p} over float32 ({form}) |")
    spread = max((max(v) - min(v)) / statistics.median(v) for v in samples.values())
    print(f"\nlargest spread across rounds (max-min)/median: {spread:.0%}")
    if args.json:
        import json
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(model=args.model, data=args.data, examples=data.train.size, devices=len(devices),
                           precisions=args.precision,
                           rounds=args.rounds, rows=table, spread=spread), f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
