"""Device discovery and the logical split of the CPU into several devices."""
import tensorflow as tf

from crossbow_tf.errors import ConfigError


def split_cpu(num_devices, cluster=None):
    """Splits the physical CPU into NUM_DEVICES logical devices (idempotent); returns their names.

    TensorFlow fixes its device list at first use; asking for a different split afterwards is an
    error that names both numbers. A multi-worker CLUSTER is started between the split and the
    first use (see ``start_cluster``).
    """
    if num_devices < 1:
        raise ConfigError(f"logical CPU devices must be at least 1, got {num_devices}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != num_devices:
            raise ConfigError(
                f"TensorFlow was already initialised with {have} logical CPU device(s); "
                f"{num_devices} were asked for. Split the CPU before TensorFlow runs anything.") from None
    start_cluster(cluster)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def start_cluster(cluster):
    """Starts CLUSTER's server (before TensorFlow's first use) and waits for every worker; no-op for None.

    Afterwards the devices TensorFlow lists are this worker's own, with their full names
    (/job:worker/replica:0/task:N/device:...)."""
    if cluster is not None:
        cluster.start()
        cluster.wait_for_workers()


def default_devices():
    """Every GPU when there is one, else the first CPU device."""
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [d.name for d in gpus]
    return [tf.config.list_logical_devices("CPU")[0].name]


def gpus_are_distinct_physical(devices):
    """True when DEVICES are GPUs and no two of them share a physical GPU."""
    if not devices or any("GPU" not in d.upper() for d in devices):
        return False
    return len(tf.config.list_logical_devices("GPU")) == len(tf.config.list_physical_devices("GPU"))
