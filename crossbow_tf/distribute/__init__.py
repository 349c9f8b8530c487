"""Devices, learner placement, and the cross-device and cross-worker reductions.

The names below load on first use, so that a process that only prepares a cluster (for example
``cluster.local_tf_configs``) does not import TensorFlow.
"""
import importlib

_LAZY = {
    "CrossbowStrategy": "crossbow_tf.distribute.strategy",
    "default_devices": "crossbow_tf.distribute.devices",
    "split_cpu": "crossbow_tf.distribute.devices",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'crossbow_tf.distribute' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
