"""python -m baselines.crossbow_ssgd --config FILE: Crossbow's synchronous SGD through our engine.

Every learner takes its gradient at the central model z and z takes one momentum step with their
average (crossbow_tf.algorithms.rules.SynchronousSGD). The config's algorithm.name is ignored.
"""
import sys

from baselines._engine_method import command

run, main = command("crossbow_ssgd", "ssgd", __doc__)

if __name__ == "__main__":
    sys.exit(main())
