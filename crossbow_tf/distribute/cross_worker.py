"""The cross-worker step of the hierarchical reduction: learners -> device -> worker -> cluster.

After the cross-device reduction every device of a worker holds that worker's sums. This level packs
them, with the loss sum, into one vector per dtype (one for float32 models) and all-reduces it over
the workers with TensorFlow's collective ops: per iteration exactly one cross-worker all-reduce.
The result is the same bits on every worker (a ring all-reduce computes each chunk's sum once and
passes it on), so every worker applies the same Delta to its own copy of z.
"""
import numpy as np
import tensorflow as tf

from crossbow_tf.distribute import traffic


class CrossWorkerReduction:
    """One cross-worker all-reduce site of CLUSTER, on DEVICE (the worker's first device).

    It has its own instance key and ordering token: collectives of one device must be ordered
    (tf.distribute's CollectiveReplicaLauncher does the same), and a key reused by a differently
    shaped reduction would fail. It counts its all-reduces and the seconds from this worker's
    arrival at the all-reduce to its result (waiting for the slowest peer, then the transfer), for
    the run's results (``measurements``).
    """
    sites = []   # every reduction of this process (one per engine), for measurements()

    def __init__(self, cluster, device):
        self.cluster = cluster
        self.device = device
        self.instance_key = cluster.next_instance_key()
        self.payload_bytes = 0
        with tf.device(device):
            self._ordering_token = tf.Variable(0.0, trainable=False, name="cross_worker_ordering_token")
            self.calls = tf.Variable(0, dtype=tf.int64, trainable=False, name="cross_worker_all_reduces")
            self.seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="cross_worker_seconds")
        CrossWorkerReduction.sites.append(self)

    def __call__(self, tensors):
        """TENSORS (a list on this worker) summed over the workers, inside the compiled step."""
        # One vector in the widest dtype among them (casting up is exact): one collective, always.
        wide = max((t.dtype for t in tensors), key=lambda dtype: dtype.size)
        sizes = [int(np.prod(t.shape)) for t in tensors]
        self.payload_bytes = sum(sizes) * wide.size
        with tf.device(self.device):
            flat = tf.concat([tf.reshape(tf.cast(t, wide), [-1]) for t in tensors], 0)
            with tf.control_dependencies([flat]):
                arrived = tf.timestamp()
            with tf.control_dependencies([arrived]):
                total = self.cluster.all_reduce(flat, self.instance_key, self.device,
                                                ordering_token=self._ordering_token.handle)
            with tf.control_dependencies([total]):
                self.seconds.assign_add(tf.timestamp() - arrived)
                self.calls.assign_add(1)
            return [tf.cast(tf.reshape(part, t.shape), t.dtype)
                    for t, part in zip(tensors, tf.split(total, sizes))]


def measurements(iterations, train_seconds):
    """This process's cross-worker traffic and waits (crossbow_tf.distribute.traffic.summary) over
    ITERATIONS iterations that trained for TRAIN_SECONDS; None without a cross-worker reduction."""
    if not CrossWorkerReduction.sites:
        return None
    site = CrossWorkerReduction.sites[-1]   # the engine that trained (a tuner's engines came first)
    return traffic.summary(int(site.calls.numpy()), site.payload_bytes, float(site.seconds.numpy()),
                           site.cluster.num_workers, iterations, train_seconds)
