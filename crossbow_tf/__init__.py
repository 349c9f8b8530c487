"""Crossbow-style training for TensorFlow 2 / Keras 3: many small-batch learners per device, kept
together by synchronous model averaging (SMA).

    strategy = crossbow_tf.CrossbowStrategy(learners_per_device=4, logical_cpu_devices=2)
    model = crossbow_tf.use_sma(model, strategy)      # after model.compile(SGD(...), loss=...)

The names below load on first use: importing the package does not import TensorFlow, so that
``crossbow_tf.run`` can split the CPU into logical devices before TensorFlow starts.
"""
import importlib
import os

# The fused learners' grouped convolutions need oneDNN's CPU kernels (TensorFlow's own compute no
# filter gradient for groups), and TensorFlow enables oneDNN by default only on some CPUs. Set
# before TensorFlow is imported, so it reaches every entry point and the baselines alike (they
# import crossbow_tf first); TF_ENABLE_ONEDNN_OPTS=0 in the environment keeps it off.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

_LAZY = {
    "CrossbowStrategy": ("crossbow_tf.distribute.strategy", "CrossbowStrategy"),
    "use_sma": ("crossbow_tf.keras.sma", "use_sma"),
    "keras": ("crossbow_tf.keras", None),
    "data": ("crossbow_tf.data", None),   # crossbow_tf.data.load_embedded_mnist(): the offline digits
}

__all__ = ["CrossbowStrategy", "use_sma", "keras", "data"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'crossbow_tf' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
