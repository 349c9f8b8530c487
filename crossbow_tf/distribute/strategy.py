"""CrossbowStrategy: the devices, the learners on each, and how devices reduce."""
from crossbow_tf.distribute.devices import check_device_names, default_devices, split_cpu
from crossbow_tf.distribute.reduce import IMPLEMENTATIONS, cross_device_ops_for
from crossbow_tf.errors import ConfigError, ConfigTypeError


class CrossbowStrategy:
    """Hosts LEARNERS_PER_DEVICE learners on each of DEVICES, like MirroredStrategy hosts one.

    Args:
      devices: device names; default every GPU, else the CPU.
      learners_per_device: m, the learners on each device (k = len(devices) * m in all).
      logical_cpu_devices: split the CPU into this many logical devices and use them all
        (for machines without accelerators; not together with DEVICES).
      cross_device_reduction: "auto" (NCCL between distinct GPUs, else reduce-to-one-device),
        "nccl", "one_device" or "hierarchical_copy".

    Bad arguments raise TypeError or ValueError (crossbow_tf.errors.ConfigError) naming the argument,
    before any device is touched; device names must exist on this machine.
    """

    def __init__(self, devices=None, learners_per_device=1, logical_cpu_devices=None,
                 cross_device_reduction="auto"):
        _check_positive_int("learners_per_device", learners_per_device)
        if logical_cpu_devices is not None:
            _check_positive_int("logical_cpu_devices", logical_cpu_devices, MAX_LOGICAL_CPU_DEVICES)
        if not isinstance(cross_device_reduction, str) or cross_device_reduction not in IMPLEMENTATIONS:
            raise ConfigError(f"cross_device_reduction must be one of {', '.join(IMPLEMENTATIONS)}, "
                              f"got {cross_device_reduction!r}")
        if devices is not None:
            if isinstance(devices, (str, bytes)):
                raise ConfigTypeError(f"devices must be a list of device names, not a string: "
                                      f"write devices=[{devices!r}]")
            try:
                devices = list(devices)
            except TypeError:
                raise ConfigTypeError(f"devices must be a list of device names, got {devices!r}") from None
            if logical_cpu_devices is not None:
                raise ConfigError("give devices or logical_cpu_devices, not both (logical_cpu_devices "
                                  "splits the CPU and uses every part)")
            if not devices:
                raise ConfigError("devices: the list is empty; give at least one device name")
            check_device_names(devices)
        else:
            devices = split_cpu(logical_cpu_devices) if logical_cpu_devices else default_devices()
        self.devices = devices
        self.learners_per_device = learners_per_device
        self.reduction_name, self.cross_device_ops = cross_device_ops_for(devices, cross_device_reduction)

    @property
    def num_devices(self):
        return len(self.devices)

    @property
    def num_learners(self):
        return self.num_devices * self.learners_per_device

    def learner_device(self, learner):
        """Learner j = d*m + i lives on device d."""
        return self.devices[learner // self.learners_per_device]

    def __repr__(self):
        return (f"CrossbowStrategy(devices={self.devices}, learners_per_device={self.learners_per_device}, "
                f"reduction={self.reduction_name!r})")


# Each logical CPU device has its own thread pools and copies of z; more than this is a typo.
from crossbow_tf.config import MAX_LOGICAL_CPU_DEVICES  # noqa: E402  (one definition, shared)


def _check_positive_int(name, value, maximum=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be a positive integer, got {value!r}")
    if value < 1 or (maximum is not None and value > maximum):
        raise ConfigError(f"{name} must be in [1, {maximum}], got {value}" if maximum
                          else f"{name} must be a positive integer, got {value}")
