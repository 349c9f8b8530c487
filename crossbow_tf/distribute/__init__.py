from crossbow_tf.distribute.devices import default_devices, split_cpu
from crossbow_tf.distribute.strategy import CrossbowStrategy

__all__ = ["CrossbowStrategy", "default_devices", "split_cpu"]
