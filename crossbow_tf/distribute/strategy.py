"""CrossbowStrategy: the devices, the learners on each, and how devices reduce."""
from crossbow_tf.distribute.devices import default_devices, split_cpu
from crossbow_tf.distribute.reduce import cross_device_ops_for
from crossbow_tf.errors import ConfigError


class CrossbowStrategy:
    """Hosts LEARNERS_PER_DEVICE learners on each of DEVICES, like MirroredStrategy hosts one.

    Args:
      devices: device names; default every GPU, else the CPU.
      learners_per_device: m, the learners on each device (k = len(devices) * m in all).
      logical_cpu_devices: split the CPU into this many logical devices and use them all
        (for machines without accelerators; ignored when DEVICES is given).
      cross_device_reduction: "auto" (NCCL between distinct GPUs, else reduce-to-one-device),
        "nccl", "one_device" or "hierarchical_copy".
    """

    def __init__(self, devices=None, learners_per_device=1, logical_cpu_devices=None,
                 cross_device_reduction="auto"):
        if not isinstance(learners_per_device, int) or learners_per_device < 1:
            raise ConfigError(f"learners_per_device must be a positive integer, got {learners_per_device!r}")
        if devices is None:
            devices = split_cpu(logical_cpu_devices) if logical_cpu_devices else default_devices()
        devices = list(devices)
        if not devices:
            raise ConfigError("no devices given")
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
