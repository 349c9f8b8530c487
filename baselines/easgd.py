"""python -m baselines.easgd --config FILE: synchronous elastic averaging SGD through our engine.

Each learner is pulled towards the central model z with strength alpha (null: 0.9/k) and z moves
towards the learners (crossbow_tf.algorithms.rules). The config's algorithm.name is ignored.
"""
import sys

from baselines import _cli

PROG = "python -m baselines.easgd"


def run(args, log=print):
    cfg, _ = _cli.build(args, algorithm="easgd")
    from crossbow_tf.experiment import run_experiment
    from crossbow_tf.errors import TrainingDiverged
    try:
        results = run_experiment(cfg, log=log)
    except TrainingDiverged as e:   # its results are written too: under this method's name
        e.results.method = "easgd"
        raise
    results.method = "easgd"
    return results


def main(argv=None):
    return _cli.main(PROG, __doc__.splitlines()[0], run, argv)


if __name__ == "__main__":
    sys.exit(main())
