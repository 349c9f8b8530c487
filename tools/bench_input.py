"""Is the input pipeline fast enough? Its images/s next to the training step's, in one run.

For each model/data pair it measures, in this order:
  pipeline   one epoch of pipeline.train_batches (shuffle, per-example decode/augment, batch k*b,
             pad+mask, prefetch) with nothing consuming it but the loop;
  step       Engine.train_step (SMA, CrossbowStrategy) on batches already in memory;
  fed        Engine.train_step fed by train_batches, as the trainer runs it (both compete for
             the same cores; if fed is much slower than step, input is the bottleneck).
LeNet trains on the embedded MNIST subset; ResNet-32 on random CIFAR-10-shaped data written as
official binary files to a temporary directory and read back through the real loader, so decode,
pad-4 crop, flip and normalisation all run.

    python tools/bench_input.py                      # 2 logical CPU devices x 4 learners, b=16
    python tools/bench_input.py --models resnet32 --iterations 10
"""
import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["lenet", "resnet32"], choices=["lenet", "resnet32"])
    p.add_argument("--devices", type=int, default=2, help="logical CPU devices (D)")
    p.add_argument("--learners-per-device", type=int, default=4, help="learners per device (m)")
    p.add_argument("--batch-size", type=int, default=16, help="per-learner batch (b)")
    p.add_argument("--iterations", type=int, default=20,
                   help="timed training iterations for 'step' and 'fed' (after warm-up)")
    p.add_argument("--cifar-records", type=int, default=10_000,
                   help="records per CIFAR-10 training file (5 files; 10,000 is the real size)")
    p.add_argument("--learners", help="Engine learners argument (e.g. fused, replicated); default: the Engine's")
    args = p.parse_args(argv)
    if min(args.devices, args.learners_per_device, args.batch_size, args.iterations, args.cifar_records) < 1:
        p.error("all counts must be at least 1")
    return args


def write_random_cifar10(directory, records_per_file, seed=0):
    """Random uint8 records in the official CIFAR-10 binary layout (1 label byte + 3072 pixels)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name in names:
        records = rng.integers(0, 256, (records_per_file, 3073), dtype=np.uint8)
        records[:, 0] %= 10
        records.tofile(os.path.join(directory, name))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from crossbow_tf.distribute.devices import split_cpu
    devices = split_cpu(args.devices)          # before anything else makes TensorFlow initialise

    import keras

    from crossbow_tf.algorithms import SMA
    from crossbow_tf.data import load_dataset
    from crossbow_tf.data.pipeline import train_batches
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine.core import Engine
    from crossbow_tf.models import build_model

    k = args.devices * args.learners_per_device
    global_batch = k * args.batch_size
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_input_") as tmp:
        for model_name in args.models:
            if model_name == "lenet":
                data = load_dataset("mnist_embedded")
            else:
                write_random_cifar10(tmp, args.cifar_records)
                data = load_dataset("cifar10", tmp)

            # pipeline: a whole epoch, so the shuffle buffer's fill is paid as training pays it.
            start = time.perf_counter()
            seen = 0
            for x, y, mask in train_batches(data.train, global_batch, epoch=1, map_fn=data.train_map):
                seen += int(x.shape[0])
            pipeline_rate = seen / (time.perf_counter() - start)

            keras.utils.set_random_seed(0)
            model = build_model(model_name, data.input_shape, data.num_classes)
            strategy = CrossbowStrategy(devices=devices, learners_per_device=args.learners_per_device)
            extra = {"learners": args.learners} if args.learners else {}
            engine = Engine(model, loss, SMA(), strategy, **extra)
            batches = list(train_batches(data.train, global_batch, epoch=2, map_fn=data.train_map)
                           .take(min(4, args.iterations)))
            float(engine.train_step(*batches[0], 0.01)[0])           # warm-up: traces the step
            float(engine.train_step(*batches[-1], 0.01)[0])

            start = time.perf_counter()
            for i in range(args.iterations):
                float(engine.train_step(*batches[i % len(batches)], 0.01)[0])
            step_rate = args.iterations * global_batch / (time.perf_counter() - start)

            feed = iter(train_batches(data.train, global_batch, epoch=3, map_fn=data.train_map))
            float(engine.train_step(*next(feed), 0.01)[0])           # fills the shuffle buffer
            start = time.perf_counter()
            for _ in range(args.iterations):
                float(engine.train_step(*next(feed), 0.01)[0])
            fed_rate = args.iterations * global_batch / (time.perf_counter() - start)
            rows.append((model_name, data.name, pipeline_rate, step_rate, fed_rate))
            print(f"{model_name}: done", file=sys.stderr)
            del engine, model, batches, feed

    print(f"# k={k} learners ({args.devices} logical CPU devices x {args.learners_per_device}), b={args.batch_size}, "
          f"SMA, {args.iterations} timed iterations, {os.cpu_count()} CPU cores (images/s)\n")
    print("| model | data | pipeline | training step | pipeline / step | step fed by pipeline | fed / step |")
    print("|---|---|---|---|---|---|---|")
    for model_name, data_name, pipe, step, fed in rows:
        print(f"| {model_name} | {data_name} | {pipe:.0f} | {step:.0f} | {pipe / step:.1f}x | {fed:.0f} | {fed / step:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
