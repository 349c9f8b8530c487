"""CrossbowStrategy: the devices, the learners on each, and how devices reduce."""
from crossbow_tf.distribute import cluster as cluster_lib
from crossbow_tf.distribute.devices import check_device_names, split_cpu, start_cluster
from crossbow_tf.distribute.reduce import IMPLEMENTATIONS, cross_device_ops_for
from crossbow_tf.errors import ConfigError, ConfigTypeError


class CrossbowStrategy:
    """Hosts LEARNERS_PER_DEVICE learners on each of DEVICES, like MirroredStrategy hosts one.

    Args:
      devices: device names; default every GPU, else the CPU.
      learners_per_device: m, the learners on each device (k = workers * len(devices) * m in all).
      logical_cpu_devices: split the CPU into this many logical devices and use them all, on a
        machine without GPUs (not together with DEVICES). Where GPUs are visible every GPU is used,
        as by ``python -m crossbow_tf.run`` with ``devices.logical_cpu``, and one line on stderr
        says so.
      cross_device_reduction: "auto" (NCCL between distinct GPUs, else reduce-to-one-device),
        "nccl", "one_device" or "hierarchical_copy".
      cluster_resolver: a tf.distribute.cluster_resolver.ClusterResolver (TFConfig, Slurm,
        Kubernetes, ...) for training on several workers: every worker creates the same strategy;
        DEVICES and the learners are then this worker's, and k counts the learners of all workers.
        Create the strategy before TensorFlow runs anything (it starts this worker's server and
        waits for the others).
      worker_timeout: seconds any wait for another worker may take before every worker stops with
        an error naming the missing one (default 60).
      cluster: an already constructed ``crossbow_tf.distribute.cluster.Cluster`` instead of
        CLUSTER_RESOLVER.

    Bad arguments raise TypeError or ValueError (crossbow_tf.errors.ConfigError) naming the argument,
    before any device is touched; device names must exist on this machine.
    """

    def __init__(self, devices=None, learners_per_device=1, logical_cpu_devices=None,
                 cross_device_reduction="auto", cluster_resolver=None,
                 worker_timeout=cluster_lib.DEFAULT_TIMEOUT, cluster=None):
        _check_positive_int("learners_per_device", learners_per_device)
        if logical_cpu_devices is not None:
            _check_positive_int("logical_cpu_devices", logical_cpu_devices, MAX_LOGICAL_CPU_DEVICES)
        if not isinstance(cross_device_reduction, str) or cross_device_reduction not in IMPLEMENTATIONS:
            raise ConfigError(f"cross_device_reduction must be one of {', '.join(IMPLEMENTATIONS)}, "
                              f"got {cross_device_reduction!r}")
        if cluster is None and cluster_resolver is not None:
            cluster = cluster_lib.from_resolver(cluster_resolver, worker_timeout)
        self.cluster = cluster
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
            if cluster is not None and not cluster.started:
                raise ConfigError("with an explicit device list, start the cluster first "
                                  "(crossbow_tf.distribute.devices.start_cluster)")
            check_device_names(devices)
        else:
            devices = _chosen_devices(logical_cpu_devices, cluster)
        self.devices = devices
        self.learners_per_device = learners_per_device
        self.reduction_name, self.cross_device_ops = cross_device_ops_for(devices, cross_device_reduction)

    @property
    def num_devices(self):
        return len(self.devices)

    @property
    def num_workers(self):
        return 1 if self.cluster is None else self.cluster.num_workers

    @property
    def worker_index(self):
        return 0 if self.cluster is None else self.cluster.worker_index

    @property
    def is_chief(self):
        return self.worker_index == 0

    @property
    def local_learners(self):
        """The learners of this worker: devices x learners per device."""
        return self.num_devices * self.learners_per_device

    @property
    def num_learners(self):
        """k: the learners of every worker (each worker has the same devices and m)."""
        return self.num_workers * self.local_learners

    @property
    def first_learner(self):
        """The global index of this worker's first learner: worker w holds learners w*D*m ... (w+1)*D*m - 1."""
        return self.worker_index * self.local_learners

    def learner_device(self, learner):
        """Learner j = d*m + i of this worker lives on device d."""
        return self.devices[learner // self.learners_per_device]

    def __repr__(self):
        workers = "" if self.cluster is None else f", worker={self.worker_index} of {self.num_workers}"
        return (f"CrossbowStrategy(devices={self.devices}, learners_per_device={self.learners_per_device}, "
                f"reduction={self.reduction_name!r}{workers})")


# Each logical CPU device has its own thread pools and copies of z; more than this is a typo.
from crossbow_tf.config import MAX_LOGICAL_CPU_DEVICES  # noqa: E402  (one definition, shared)


def _chosen_devices(logical_cpu_devices, cluster):
    """The devices crossbow_tf.device_choice chooses (every GPU, else the logical CPU split, else the
    CPU), the cluster started in between."""
    import sys

    from crossbow_tf.device_choice import apply_choice, choose_devices, physical_gpus
    choice = choose_devices(physical_gpus(), logical_cpu_devices)
    if choice.note:
        print(f"CrossbowStrategy: {choice.note.replace('devices.logical_cpu', 'logical_cpu_devices')}",
              file=sys.stderr)
    if not choice.logical_cpu:
        start_cluster(cluster)
    return apply_choice(choice, lambda n: split_cpu(n, cluster))


def _check_positive_int(name, value, maximum=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be a positive integer, got {value!r}")
    if value < 1 or (maximum is not None and value > maximum):
        raise ConfigError(f"{name} must be in [1, {maximum}], got {value}" if maximum
                          else f"{name} must be a positive integer, got {value}")
