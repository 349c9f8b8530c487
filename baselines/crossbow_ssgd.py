"""python -m baselines.crossbow_ssgd --config FILE: Crossbow's synchronous SGD through our engine.

Every learner takes its gradient at the central model z and z takes one momentum step with their
average (crossbow_tf.algorithms.rules.SynchronousSGD). The config's algorithm.name is ignored.
"""
import sys

from baselines import _cli

PROG = "python -m baselines.crossbow_ssgd"


def run(args, log=print):
    cfg, _ = _cli.build(args, algorithm="ssgd")
    from crossbow_tf.experiment import run_experiment
    from crossbow_tf.errors import TrainingDiverged
    try:
        results = run_experiment(cfg, log=log)
    except TrainingDiverged as e:   # its results are written too: under this method's name
        e.results.method = "crossbow_ssgd"
        raise
    results.method = "crossbow_ssgd"
    return results


def main(argv=None):
    return _cli.main(PROG, __doc__.splitlines()[0], run, argv)


if __name__ == "__main__":
    sys.exit(main())
