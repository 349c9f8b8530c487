from crossbow_tf.algorithms.contract import ALGORITHMS, Rule, register, rule_class, unregister
from crossbow_tf.algorithms.rules import (SMA, ElasticAveragingSGD, LocalSGD, SynchronousSGD, central_loop_bound,
                                         largest_stable_alpha)

__all__ = ["ALGORITHMS", "SMA", "ElasticAveragingSGD", "LocalSGD", "Rule", "SynchronousSGD", "central_loop_bound",
           "largest_stable_alpha", "register", "rule_class", "unregister"]
