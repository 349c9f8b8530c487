from crossbow_tf.algorithms.rules import (ALGORITHMS, SMA, ElasticAveragingSGD, LocalSGD, SynchronousSGD,
                                         central_loop_bound, largest_stable_alpha)

__all__ = ["ALGORITHMS", "SMA", "ElasticAveragingSGD", "LocalSGD", "SynchronousSGD", "central_loop_bound",
           "largest_stable_alpha"]
