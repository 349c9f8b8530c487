"""Per-iteration time of SMA on 1 worker against 2 local workers with the same learners in all.

For each model, side by side in one run:
- 1 worker: one process, DEVICES logical CPU devices x M learners;
- 2 workers: two processes on 127.0.0.1 (TF_CONFIG, TensorFlow's gRPC servers and collectives),
  each with DEVICES/2 logical devices x M learners: the same k, the same global batch.
Each process times ITERATIONS steps on one fixed batch (no input pipeline) after a warm-up. The
2-worker rows also time the cross-worker all-reduce alone, on a vector of the size the step
reduces (its weights' and BatchNorm sums and the loss, packed), and report its share of the
step, and the bytes that cross the network per iteration: a ring all-reduce over n workers sends
(and receives) 2(n-1)/n times the packed bytes per worker.

    python tools/bench_multiworker.py                       # LeNet and ResNet-32, 2 devices x 2 learners
    python tools/bench_multiworker.py --models lenet --iterations 50
    python tools/bench_multiworker.py --models lenet --sync-periods 1 4 16 --no-projection

The 2-worker layout runs in a network namespace of its own with only loopback (issue 52: TensorFlow's
servers bind every interface), as the harness runs a local trial's workers. --namespaces measures
what that costs: the same 2-worker layout outside a namespace (its servers exposed while it runs) and
inside, alternated for --rounds rounds, with the ratio of their medians.

    python tools/bench_multiworker.py --models lenet resnet32 --namespaces --rounds 3 --no-projection

With --sync-periods, SMA synchronises every H-th iteration (SMA(sync_period=H)); the iterations
between synchronisations run the learners' own steps with no collective, so the bytes per
iteration are the all-reduce's divided by H, and the time per iteration is the mean over whole
periods (the median would pick a local step).

It ends with an on-paper projection for ResNet-50 on 8 workers x 8 GPUs: the packed bytes of our
ResNet-50 (counted from the model), the ring all-reduce's bytes per worker at 25 and 100 Gb/s,
against an assumed GPU compute time per iteration (--gpu-images-per-second, default NVIDIA's
published ResNet-50 v1.5 TensorFlow training throughput on one V100 16 GB of a DGX-1: 412 images/s
in FP32 with XLA, 1270 with mixed precision; NVIDIA DeepLearningExamples,
TensorFlow/Classification/ConvNets/resnet50v1.5/README.md).
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # a checkout's crossbow_tf
from crossbow_tf.distribute import traffic  # noqa: E402
from crossbow_tf.distribute.traffic import ring_bytes  # noqa: E402

SHAPES = {"lenet": ((28, 28, 1), 10), "resnet32": ((32, 32, 3), 10)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["lenet", "resnet32"], choices=sorted(SHAPES))
    p.add_argument("--devices", type=int, default=2, help="logical CPU devices of the 1-worker run (even)")
    p.add_argument("--learners-per-device", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per-learner batch b")
    p.add_argument("--iterations", type=int, default=30, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sync-periods", type=int, nargs="+", default=[1],
                   help="SMA's synchronisation periods H to measure (iterations and warm-up are rounded up to whole periods)")
    p.add_argument("--images-per-gpu", type=int, default=128,
                   help="projection: images per GPU per iteration (m learners x b), default 4 x 32")
    p.add_argument("--gpu-images-per-second", type=float, nargs="+", default=[412.0, 1270.0],
                   help="projection: assumed ResNet-50 training throughput of one GPU (see above)")
    p.add_argument("--no-projection", dest="projection", action="store_false")
    p.add_argument("--namespaces", action="store_true",
                   help="time the 2-worker layout outside and inside its private namespace, side by side")
    p.add_argument("--rounds", type=int, default=3, help="with --namespaces: alternated rounds of each")
    p.add_argument("--worker", help=argparse.SUPPRESS)   # internal: run one process of a layout
    args = p.parse_args(argv)
    if args.devices < 2 or args.devices % 2:
        p.error("--devices must be even (the 2-worker run gives each worker half)")
    if min(args.learners_per_device, args.batch_size, args.iterations, args.warmup, args.rounds,
           *args.sync_periods) < 1:
        p.error("--learners-per-device, --batch-size, --iterations, --warmup, --rounds and --sync-periods must be "
                "at least 1")
    return args


def run_worker(args):
    """One process: times the step (and, on a cluster, the all-reduce alone); the chief prints JSON."""
    spec = json.loads(args.worker)
    import tensorflow as tf
    from crossbow_tf.distribute import CrossbowStrategy
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver() if os.environ.get("TF_CONFIG") else None
    strategy = CrossbowStrategy(learners_per_device=args.learners_per_device, logical_cpu_devices=spec["devices"],
                                cluster_resolver=resolver)
    import keras
    import numpy as np
    from crossbow_tf.algorithms import SMA
    from crossbow_tf.distribute.cross_worker import CrossWorkerReduction
    from crossbow_tf.engine.core import Engine
    from crossbow_tf.models import build_model

    input_shape, classes = SHAPES[spec["model"]]
    keras.utils.set_random_seed(0)
    model = build_model(spec["model"], input_shape, classes)
    period = spec.get("sync_period", 1)
    engine = Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), SMA(sync_period=period),
                    strategy)
    n = strategy.num_learners * args.batch_size
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((n,) + input_shape, dtype=np.float32))
    y = tf.constant(rng.integers(0, classes, n).astype(np.int32))
    mask = tf.ones([n])

    def timed(function, count, mean=False):
        times = []
        for _ in range(count):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
        return statistics.fmean(times) if mean else statistics.median(times)

    def whole_periods(count):
        return -(-count // period) * period

    def step():
        loss, _ = engine.train_step(x, y, mask, 0.01)
        float(loss)

    guard = strategy.cluster.guard() if strategy.cluster else _NoGuard()
    with guard:
        timed(step, whole_periods(max(args.warmup, period + 1)))   # traces both steps
        step_time = timed(step, whole_periods(args.iterations), mean=period > 1)
        nbytes = packed_bytes(model)
        reduce_time = None
        if strategy.cluster is not None:
            reduction = CrossWorkerReduction(strategy.cluster, strategy.devices[0])
            with tf.device(strategy.devices[0]):
                vector = tf.zeros([nbytes // 4])
            alone = tf.function(lambda: reduction([vector])[0], autograph=False)

            def all_reduce():
                alone().numpy()
            timed(all_reduce, args.warmup)
            reduce_time = timed(all_reduce, args.iterations)
    if strategy.is_chief:
        print("RESULT " + json.dumps({"step": step_time, "all_reduce": reduce_time, "bytes": nbytes,
                                      "workers": strategy.num_workers, "k": strategy.num_learners,
                                      "sync_period": period}), flush=True)


class _NoGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def launch(args, model, workers, sync_period=1, private=True):
    """Runs one layout (WORKERS processes; several in a private namespace unless PRIVATE is False);
    returns the chief's measurements."""
    with contextlib.ExitStack() as stack:
        prefix = _private_prefix(stack) if workers > 1 and private else []
        return _launch(args, model, workers, sync_period, prefix)


def _private_prefix(stack):
    """The command prefix that puts a worker in one loopback-only namespace entered on STACK, or [] (said
    once) where the machine allows none; CROSSBOW_PRIVATE_WORKERS=require makes that an exit."""
    from crossbow_tf.compare import netns
    try:
        net, note = netns.private_or_exposed(stack)
    except netns.ExposureRefused as e:
        sys.exit(f"bench_multiworker: {e}")
    if note and not _noted:
        _noted.append(note)
        print(f"# note: {note}", flush=True)
    return net.prefix(0) if net else []


_noted = []


def _launch(args, model, workers, sync_period, prefix):
    from crossbow_tf.distribute.cluster import local_tf_configs
    spec = json.dumps({"model": model, "devices": args.devices // workers, "sync_period": sync_period})
    command = [sys.executable, os.path.abspath(__file__), "--worker", spec,
               "--learners-per-device", str(args.learners_per_device), "--batch-size", str(args.batch_size),
               "--iterations", str(args.iterations), "--warmup", str(args.warmup)]
    configs = local_tf_configs(workers) if workers > 1 else [None]
    procs = []
    for config in configs:
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        if config is not None:
            env["TF_CONFIG"] = config
        procs.append(subprocess.Popen(prefix + command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env))
    outputs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outputs):
        if p.returncode != 0:
            sys.exit(f"bench_multiworker: a {workers}-worker {model} process failed:\n{err[-2000:]}")
    line = next(line for line in outputs[0][0].splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return run_worker(args)
    if args.namespaces:
        return compare_namespaces(args)
    m, d = args.learners_per_device, args.devices
    print(f"SMA step, {args.batch_size} examples per learner, k = {d * m} learners in both layouts; "
          f"median of {args.iterations} iterations after {args.warmup} of warm-up "
          "(for H > 1 the mean over whole periods)")
    print(f"{'model':<9} {'H':>3} {'layout':<26} {'ms/iteration':>12} {'all-reduce ms':>13} {'share':>6} "
          f"{'packed MB':>9} {'network MB/iteration/worker':>27}")
    for model in args.models:
        for period in args.sync_periods:
            for workers in (1, 2):
                r = launch(args, model, workers, period)
                layout = f"{workers} worker{'s' if workers > 1 else ''} x {d // workers} dev x {m}"
                reduce_ms = "" if r["all_reduce"] is None else f"{1000 * r['all_reduce']:.1f}"
                # One all-reduce per synchronisation: 1/H of the iterations.
                share = "" if r["all_reduce"] is None else f"{r['all_reduce'] / period / r['step']:.0%}"
                network = ring_bytes(r["bytes"], workers) / period / 1e6
                print(f"{model:<9} {period:>3} {layout:<26} {1000 * r['step']:>12.1f} {reduce_ms:>13} {share:>6} "
                      f"{r['bytes'] / 1e6:>9.2f} {network:>27.2f}", flush=True)
    if args.projection:
        project_resnet50(args)
    return 0


def compare_namespaces(args):
    """The 2-worker layout's ms/iteration outside a namespace and inside its private one, alternated."""
    m, d = args.learners_per_device, args.devices
    print(f"SMA step on 2 workers x {d // 2} dev x {m} learners, {args.batch_size} examples per learner; per round "
          f"the median of {args.iterations} iterations after {args.warmup} of warm-up; outside and inside alternate")
    print(f"{'model':<9} {'round':>5} {'outside ms':>10} {'inside ms':>9} {'inside/outside':>14}")
    for model in args.models:
        outside, inside = [], []
        for round_ in range(1, args.rounds + 1):
            outside.append(1000 * launch(args, model, 2, private=False)["step"])
            inside.append(1000 * launch(args, model, 2, private=True)["step"])
            print(f"{model:<9} {round_:>5} {outside[-1]:>10.1f} {inside[-1]:>9.1f} {inside[-1] / outside[-1]:>14.3f}",
                  flush=True)
        o, i = statistics.median(outside), statistics.median(inside)
        print(f"{model:<9} {'median':>5} {o:>10.1f} {i:>9.1f} {i / o:>14.3f}", flush=True)
    return 0


def packed_bytes(model):
    """Bytes of the vector one iteration all-reduces across workers for MODEL (float32 sums): its
    weights, its float statistics (BatchNorm's) and the loss."""
    import numpy as np
    floats = [v for v in model.trainable_variables] + [
        v for v in model.non_trainable_variables if np.dtype(v.dtype).kind == "f"]
    return traffic.packed_bytes(floats, extra_floats=1)


def project_resnet50(args, workers=8, gpus=8):
    from crossbow_tf.models import build_model
    nbytes = packed_bytes(build_model("resnet50", (224, 224, 3), 1000))
    sent = ring_bytes(nbytes, workers)
    print(f"\nOn paper: ResNet-50 on {workers} workers x {gpus} GPUs, {args.images_per_gpu} images per GPU per "
          f"iteration. One cross-worker all-reduce of {nbytes / 1e6:.1f} MB per iteration (GPUs reduce inside "
          f"the server first); a ring sends 2(n-1)/n x that = {sent / 1e6:.1f} MB per worker. The all-reduce "
          "follows the learners' step (no overlap), so step = compute + transfer (latency and the "
          "in-server reduction ignored).")
    print(f"{'GPU images/s':>12} {'compute ms':>10} {'link':>8} {'transfer ms':>11} {'step ms':>8} "
          f"{'network share':>13}")
    for rate in args.gpu_images_per_second:
        compute = args.images_per_gpu / rate
        for gbits in (25, 100):
            transfer = sent * 8 / (gbits * 1e9)
            print(f"{rate:>12.0f} {1000 * compute:>10.1f} {gbits:>5} Gb/s {1000 * transfer:>11.1f} "
                  f"{1000 * (compute + transfer):>8.1f} {transfer / (compute + transfer):>13.0%}")


if __name__ == "__main__":
    sys.exit(main())
