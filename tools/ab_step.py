"""Iteration time of engine variants side by side: XLA for the update, update launches, learner momentum.

    python tools/ab_step.py                                  # LeNet, 8 fused learners of 16
    python tools/ab_step.py --model resnet32 --steps 2

Variants (one engine each, built from the same initial model and fed the same fixed random batch;
the rounds interleave the variants, so a busy moment of the shared machine hits all of them):

  default        the engine's defaults: the learners' update with XLA, one launch per group of
                 layers holding at least 1 MB of learners' weights, learner momentum 0.9
  no-xla-update  the update without XLA (jit_update=False)
  one-launch     the whole update of a device in one XLA launch
  momentum-0     learner momentum 0: no velocities

Prints, per variant, the median and minimum time of an iteration over the rounds, its images/s,
and the time of the first iteration (tracing and compilation included).
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

INPUTS = {"lenet": ((28, 28, 1), 10), "resnet32": ((32, 32, 3), 10)}
VARIANTS = ("default", "no-xla-update", "one-launch", "momentum-0")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet", choices=sorted(INPUTS))
    p.add_argument("--k", type=int, default=8, help="learners (all on one device)")
    p.add_argument("--batch-size", type=int, default=16, help="per-learner batch b")
    p.add_argument("--rounds", type=int, default=12, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=10, help="iterations per variant per round")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = p.parse_args(argv)
    if min(args.k, args.batch_size, args.rounds, args.steps) < 1:
        p.error("--k, --batch-size, --rounds and --steps must be at least 1")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import keras
    import tensorflow as tf

    import crossbow_tf.engine.core as core
    from crossbow_tf.algorithms import SMA
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.models import build_model

    input_shape, classes = INPUTS[args.model]
    n = args.k * args.batch_size
    x = tf.random.uniform((n,) + input_shape, seed=1)
    y = tf.random.uniform((n,), 0, classes, tf.int32, seed=2)
    mask = tf.ones((n,))
    default_group_bytes = core.MIN_GROUP_BYTES

    def build(variant):
        keras.utils.set_random_seed(0)
        model = build_model(args.model, input_shape, classes)
        core.MIN_GROUP_BYTES = float("inf") if variant == "one-launch" else default_group_bytes
        try:
            engine = core.Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                 SMA(momentum=0.0 if variant == "momentum-0" else 0.9),
                                 CrossbowStrategy(devices=["/CPU:0"], learners_per_device=args.k),
                                 learners="fused", jit_update=variant != "no-xla-update")
        finally:
            core.MIN_GROUP_BYTES = default_group_bytes

        def step():
            return engine.train_step(x, y, mask, 0.01)[0].numpy()
        start = time.perf_counter()
        step()
        first = time.perf_counter() - start
        step()
        return step, first, len(engine._update_groups)

    steps, firsts, launches = {}, {}, {}
    for variant in args.variants:
        steps[variant], firsts[variant], launches[variant] = build(variant)
    samples = {variant: [] for variant in args.variants}
    for _ in range(args.rounds):
        for variant in args.variants:
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[variant]()
            samples[variant].append((time.perf_counter() - start) / args.steps * 1e3)

    print(f"# {args.model}, {args.k} fused learners of b={args.batch_size} on one CPU device, "
          f"{args.rounds} interleaved rounds of {args.steps} iterations\n")
    print("| variant | update groups | iteration, median (ms) | minimum (ms) | images/s | first iteration (s) |")
    print("|---|---|---|---|---|---|")
    for variant in args.variants:
        median = statistics.median(samples[variant])
        print(f"| {variant} | {launches[variant]} | {median:.2f} | {min(samples[variant]):.2f} "
              f"| {n / median * 1e3:.0f} | {firsts[variant]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
