"""Where the time of one SMA iteration goes: op times from TensorFlow's profiler, and the memory floor.

    python tools/profile_step.py                      # LeNet, 8 fused learners of 16, one device
    python tools/profile_step.py --k 8 --learner-momentum 0
    python tools/profile_step.py --model bilstm --k 4 --batch-size 4   # tools/bench_models.py's models

Prints, for one device with K fused learners of batch B and, side by side, one plain Keras model at
batch K*B (train_on_batch with SGD and momentum), on the same fixed random input:
- the median time of an iteration;
- op times per iteration from tf.profiler, grouped (convolutions, matmuls, the XLA update, other)
  and the largest ops. Op times are summed over the two intra-op threads, so they add up to more
  than the iteration;
- the bandwidth of one streaming pass (read and write) over a tensor the size of the learners'
  weights, measured here, and the time the learners' weights alone need at that bandwidth: every
  iteration reads each learner's weights in the forward and the backward pass, writes its gradient,
  and the update reads weights, gradients (and velocities) and writes weights (and velocities), then
  reads the weights once more for the sum over learners.
"""
import argparse
import collections
import glob
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# Model -> (input shape, classes) of the data set it is benchmarked on (MNIST, CIFAR-10).
INPUTS = {"lenet": ((28, 28, 1), 10), "resnet32": ((32, 32, 3), 10)}
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_learner_forms import SEQUENCE_MODELS  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet", choices=sorted(INPUTS) + list(SEQUENCE_MODELS))
    p.add_argument("--sequence-length", type=int, default=64, help="tokens per review (transformer, bilstm)")
    p.add_argument("--vocabulary", type=int, default=20000, help="token ids (transformer, bilstm)")
    p.add_argument("--k", type=int, default=8, help="learners (all on one device)")
    p.add_argument("--batch-size", type=int, default=16, help="per-learner batch b")
    p.add_argument("--learner-momentum", type=float, default=0.9)
    p.add_argument("--iterations", type=int, default=20, help="timed and profiled iterations")
    p.add_argument("--top", type=int, default=12, help="largest ops to list")
    args = p.parse_args(argv)
    if args.k < 1 or args.batch_size < 1 or args.iterations < 1 or args.top < 0:
        p.error("--k, --batch-size and --iterations must be at least 1, --top at least 0")
    if not 0 <= args.learner_momentum < 1:
        p.error("--learner-momentum must be in [0, 1)")
    return args


def _group(op_name):
    if op_name.startswith(("while", "scan", "TensorList", "TensorArray")) or "/while/" in op_name:
        return "inside loops over time"
    if any(part in op_name for part in ("Gather", "Scatter", "SegmentSum")):
        return "gathers and scatters"
    if "Conv2D" in op_name:
        return "convolutions"
    if "MatMul" in op_name:
        return "matmuls"
    if "fusion" in op_name or op_name.startswith(("copy", "wrapped_")):
        return "update (XLA)"
    return "other"


def op_times(logdir):
    """Op name -> total duration (ms) over the profile in LOGDIR (host planes, op events only)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    # Scheduling and wrapper events enclose the ops; counting them would count the ops twice.
    wrappers = ("ExecutorState", "ThunkExecutor", "ParallelFor", "BlockUntilReady", "CpuExecutable", "Eager",
                "TFE_", "KernelAndDevice", "FunctionRun", "ExecutorDoneCallback", "Threadpool", "MemoryAllocation")
    totals = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if not name.startswith(wrappers):
                    totals[name] += event.duration_ps / 1e9
    return totals


def profile(step, iterations):
    """(median ms per call of STEP, op name -> op ms per call) over ITERATIONS calls after warm-up."""
    import tensorflow as tf
    for _ in range(3):
        step()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(iterations):
            step()
        tf.profiler.experimental.stop()
        ops = op_times(logdir)
    return statistics.median(times) * 1e3, {name: ms / iterations for name, ms in ops.items()}


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import keras
    import numpy as np
    import tensorflow as tf

    from crossbow_tf.algorithms import SMA
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine.core import Engine
    from crossbow_tf.models import build_model

    n = args.k * args.batch_size
    if args.model in SEQUENCE_MODELS:
        import bench_models
        data, build = bench_models.load(args.model, n, args.sequence_length, args.vocabulary)
        x, y = (tf.constant(a) for a in next(iter(data.train.dataset.batch(n))))
    else:
        input_shape, classes = INPUTS[args.model]
        x = tf.random.uniform((n,) + input_shape)
        y = tf.random.uniform((n,), 0, classes, tf.int32)

        def build():
            return build_model(args.model, input_shape, classes)
    keras.utils.set_random_seed(0)
    model = build()
    engine = Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    SMA(momentum=args.learner_momentum),
                    CrossbowStrategy(devices=["/CPU:0"], learners_per_device=args.k), learners="fused")
    mask = tf.ones((n,))

    def sma_step():
        return engine.train_step(x, y, mask, 0.01)[0].numpy()

    keras.utils.set_random_seed(0)
    plain = build()
    plain.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def keras_step():
        return plain.train_on_batch(x, y)

    profiles = {f"SMA, {args.k} learners of {args.batch_size}": profile(sma_step, args.iterations),
                f"one Keras model at batch {n}": profile(keras_step, args.iterations)}

    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    stack_bytes = 4 * weights * args.k
    big = tf.Variable(tf.random.uniform([weights * args.k]))
    stream = tf.function(lambda: big * 1.0001)
    for _ in range(3):
        stream().numpy()
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            result = stream()
        result[:1].numpy()          # eager calls are synchronous on CPU; .numpy() of all would copy it
        passes.append((time.perf_counter() - start) / 10)
    bandwidth = 2 * stack_bytes / statistics.median(passes)          # one read and one write
    keeps_velocity = args.learner_momentum != 0
    # forward read, backward read, gradient write; update: w, g (, v) read, w (, v) written; sum: w read.
    # A floor: XLA today writes the new velocity and reads it back, one pass more.
    weight_passes = 3 + (5 if keeps_velocity else 3) + 1
    floor_ms = weight_passes * stack_bytes / bandwidth * 1e3

    print(f"# {args.model}, {args.k} fused learners of b={args.batch_size} on one CPU device (learner momentum "
          f"{args.learner_momentum:g}) against one plain Keras model at batch {n} (SGD with momentum), "
          f"{args.iterations} iterations each\n")
    names = list(profiles)
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    print("| iteration (median ms) | " + " | ".join(f"{profiles[k][0]:.2f}" for k in names) + " |")
    print("| images/s | " + " | ".join(f"{n / profiles[k][0] * 1e3:.0f}" for k in names) + " |")
    groups = {k: collections.Counter() for k in names}
    for k in names:
        for name, ms in profiles[k][1].items():
            groups[k][_group(name)] += ms
    for group in ("convolutions", "matmuls", "inside loops over time", "gathers and scatters", "update (XLA)",
                  "other"):
        print(f"| op time: {group} (ms, summed over threads) | "
              + " | ".join(f"{groups[k][group]:.2f}" for k in names) + " |")
    for k in names:
        print(f"\n| largest ops: {k} | ms per iteration |")
        print("|---|---|")
        for name, ms in sorted(profiles[k][1].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"| {name[:90]} | {ms:.2f} |")
    print(f"\nlearners' weights: {args.k} x {weights:,} floats = {stack_bytes / 1e6:.1f} MB; streaming bandwidth "
          f"measured here: {bandwidth / 1e9:.1f} GB/s (read + write)")
    sma_ms = profiles[names[0]][0]
    print(f"at least {weight_passes} passes over them per iteration: {weight_passes * stack_bytes / 1e6:.0f} MB, at "
          f"least {floor_ms:.1f} ms = {floor_ms / sma_ms:.0%} of the SMA iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
