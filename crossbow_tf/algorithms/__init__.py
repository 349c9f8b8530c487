from crossbow_tf.algorithms.rules import ALGORITHMS, SMA, ElasticAveragingSGD, SynchronousSGD

__all__ = ["ALGORITHMS", "SMA", "ElasticAveragingSGD", "SynchronousSGD"]
