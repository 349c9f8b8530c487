"""The cross-device step of the hierarchical reduction, built on tf.distribute's cross-device ops.

Learners on one device are summed on that device first (by the engine); this module then sums one
tensor per device across devices and returns the result on every device.
"""
import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from crossbow_tf.device_choice import REDUCTIONS as IMPLEMENTATIONS, reduction_problem
from crossbow_tf.distribute.devices import gpus_are_distinct_physical
from crossbow_tf.errors import ConfigError


def _ordered_sum(tensors):
    # A fixed summation order keeps results bit-reproducible; add_n's order depends on scheduling.
    return tf.reduce_sum(tf.stack(tensors), axis=0)


def cross_device_ops_for(devices, implementation="auto"):
    """Returns (name, tf.distribute.CrossDeviceOps) for DEVICES; None when there is one device.

    auto: NCCL between distinct physical GPUs (NCCL refuses two ranks on one GPU and has no CPU
    kernel), otherwise reduce to the first device and copy back.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"unknown cross-device reduction {implementation!r}; "
                          f"choose one of {', '.join(IMPLEMENTATIONS)}")
    if len(devices) == 1:
        return "none", None
    if implementation == "auto":
        implementation = "nccl" if gpus_are_distinct_physical(devices) else "one_device"
    if implementation == "nccl":
        if not gpus_are_distinct_physical(devices):
            raise ConfigError("the NCCL reduction needs distinct physical GPUs; "
                              f"devices are {', '.join(devices)}")
        return "nccl", tf.distribute.NcclAllReduce()
    if implementation == "hierarchical_copy":
        problem = reduction_problem(implementation, len(devices))
        if problem:
            raise ConfigError(problem)
        return "hierarchical_copy", tf.distribute.HierarchicalCopyAllReduce(num_packs=1)
    return "one_device", tf.distribute.ReductionToOneDevice(
        reduce_to_device=devices[0], accumulation_fn=_ordered_sum)


def all_reduce_sum(cross_device_ops, per_device):
    """PER_DEVICE[d] is a list of tensors on device d; returns the elementwise sums, per device."""
    if cross_device_ops is None:
        return per_device
    num_tensors = len(per_device[0])
    pairs = []
    for t in range(num_tensors):
        value = values_lib.PerReplica([tensors[t] for tensors in per_device])
        pairs.append((value, value))
    reduced = cross_device_ops.batch_reduce(tf.distribute.ReduceOp.SUM, pairs)
    return [[reduced[t].values[d] for t in range(num_tensors)] for d in range(len(per_device))]
