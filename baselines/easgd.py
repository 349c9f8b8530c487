"""python -m baselines.easgd --config FILE: synchronous elastic averaging SGD through our engine.

Each learner is pulled towards the central model z with strength alpha (null: 0.9/k) and z moves
towards the learners (crossbow_tf.algorithms.rules). The config's algorithm.name is ignored.
"""
import sys

from baselines._engine_method import command

run, main = command("easgd", "easgd", __doc__)

if __name__ == "__main__":
    sys.exit(main())
