"""Device discovery and the logical split of the CPU into several devices."""
import tensorflow as tf

from crossbow_tf.errors import ConfigError, ConfigTypeError


def split_cpu(num_devices, cluster=None):
    """Splits the physical CPU into NUM_DEVICES logical devices (idempotent); returns their names.

    TensorFlow fixes its device list at first use; asking for a different split afterwards is an
    error that names both numbers. A multi-worker CLUSTER is started between the split and the
    first use (see ``start_cluster``).
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int):
        raise ConfigTypeError(f"logical CPU devices must be an integer, got {num_devices!r}")
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
                f"{num_devices} were asked for. Create the CrossbowStrategy right after the imports, before "
                "TensorFlow runs anything (a tf.data pipeline, a model, any op).") from None
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


def check_device_names(names):
    """Raises ConfigError unless every one of NAMES is a distinct device of this process (devices of
    other jobs of a cluster are left to TensorFlow)."""
    local = {}
    for d in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(d.name)
        local[(spec.device_type, spec.device_index or 0)] = d.name
    seen = {}
    for name in names:
        if not isinstance(name, str):
            raise ConfigTypeError(f"devices: expected device names (strings), got {name!r}")
        try:
            spec = tf.DeviceSpec.from_string(name)
        except ValueError as e:
            raise ConfigError(f"devices: {name!r} is not a device name ({e})") from None
        if spec.job not in (None, "localhost"):
            continue
        key = ((spec.device_type or "").upper(), spec.device_index or 0)
        if key not in local:
            raise ConfigError(f"devices: {name!r} does not exist here; this machine has "
                              f"{', '.join(sorted(local.values()))}")
        if key in seen:
            raise ConfigError(f"devices: {name!r} and {seen[key]!r} are the same device")
        seen[key] = name
