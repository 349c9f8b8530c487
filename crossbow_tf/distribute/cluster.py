"""The workers of a multi-worker run, on TensorFlow's own distributed runtime.

A cluster is described the way TensorFlow users already describe one: a ``TF_CONFIG`` cluster
spec or any ``tf.distribute.cluster_resolver`` (TFConfig, Slurm, Kubernetes, Simple). Every
worker starts TensorFlow's gRPC server in-process (``context.enable_collective_ops``, as
``MultiWorkerMirroredStrategy`` does) and talks to the others only through TensorFlow's collective
ops. Unlike that strategy we configure no coordination service: its start-up blocks until every
peer has connected, with no bound we control (a worker whose peer never starts hangs there).
Instead every wait is bounded: the start-up check polls each peer with TensorFlow's own
peer-health probe for at most ``timeout`` seconds; the training step's all-reduce carries the
same timeout; the agreements that follow uneven local work (auto-tuning, the chief's evaluation)
wait as long as every peer is alive: not gone (its server refuses the probe) and not silent for
the worker timeout. One unanswered probe proves nothing while a collective is under way: the probe
shares the peers' gRPC connection with the collective's data, and behind a slow link (100 Mbit/s
and a checkpoint's worth of learners in flight) it waits its turn for seconds. When a wait fails,
the peers are probed again so that the error names the worker that is missing.
"""
import contextlib
import re
import sys
import time

import numpy as np

from crossbow_tf.distribute.exposure import exposure_line
from crossbow_tf.errors import CrossbowError

DEFAULT_TIMEOUT = 60.0
# Group keys of our own: a collision with a tf.distribute strategy's keys (they count up from 1)
# aborts collectives for the life of the process. One group per device type, since a group's
# members must all be devices of one type.
GROUP_KEYS = {"CPU": 0x43420001, "GPU": 0x43420002}
INSTANCE_KEY_BASE = 0x43420000
_PROBE_MS = 2000
_POLL_SECONDS = 0.5


class ClusterError(CrossbowError):
    """A worker of the cluster is missing (never started, died or hung)."""
    exit_code = 4


def _packed(arrays, collective, copies):
    """ARRAYS through COLLECTIVE, one call per dtype on the arrays flattened into one vector.
    COLLECTIVE returns COPIES vectors of that length, concatenated (1: a reduction or broadcast;
    the number of workers: a gather); each array comes back with a leading axis of COPIES."""
    arrays = [np.asarray(a) for a in arrays]
    by_dtype = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.str, []).append(i)
    out = [None] * len(arrays)
    for indices in by_dtype.values():
        flat = np.concatenate([arrays[i].ravel() for i in indices])
        result = collective(flat).reshape(copies, flat.size)
        offset = 0
        for i in indices:
            size = arrays[i].size
            out[i] = result[:, offset:offset + size].reshape((copies,) + arrays[i].shape)
            offset += size
    return out


def _device_type(device):
    return "GPU" if "GPU" in device.upper() else "CPU"


class Cluster:
    """This process's place among the workers of RESOLVER's cluster.

    Workers are numbered as TensorFlow numbers them (``multi_worker_util.id_in_cluster``: a
    ``chief`` task first, then the ``worker`` tasks); worker 0 is the chief. Create it before
    TensorFlow runs anything, then ``start()`` it (after any logical split of the CPU).
    """

    def __init__(self, resolver, timeout=DEFAULT_TIMEOUT):
        from tensorflow.python.distribute import multi_worker_util
        if timeout is None or not timeout > 0:
            raise CrossbowError(f"the worker timeout must be a positive number of seconds, got {timeout!r}")
        spec = multi_worker_util.normalize_cluster_spec(resolver.cluster_spec())
        if resolver.task_type is None or resolver.task_id is None:
            raise CrossbowError("the cluster spec names no task for this process "
                                "(TF_CONFIG needs \"task\": {\"type\": \"worker\", \"index\": N})")
        self.resolver = resolver
        self.spec = spec
        self.task_type, self.task_id = resolver.task_type, int(resolver.task_id)
        self.timeout = float(timeout)
        self.tasks = [(job, i) for job in ("chief", "worker") if job in spec.jobs
                      for i in range(spec.num_tasks(job))]
        if (self.task_type, self.task_id) not in self.tasks:
            raise CrossbowError(f"this process's task {self.task_type}:{self.task_id} is not a chief or "
                                f"worker task of the cluster spec {spec.as_dict()}")
        self.worker_index = multi_worker_util.id_in_cluster(spec, self.task_type, self.task_id)
        self.num_workers = len(self.tasks)
        self._next_instance_key = INSTANCE_KEY_BASE
        self.started = False

    @property
    def is_chief(self):
        return self.worker_index == 0

    def task_name(self, worker):
        job, i = self.tasks[worker]
        return f"/job:{job}/replica:0/task:{i}"

    def describe(self, worker):
        job, i = self.tasks[worker]
        return f"worker {worker} ({job}:{i} at {self.spec.task_address(job, i)})"

    # ---------------------------------------------------------------------------------- start-up
    def start(self):
        """Starts this worker's TensorFlow server and enables collectives (before TF runs anything)."""
        if self.started:
            return self
        from tensorflow.core.protobuf import tensorflow_server_pb2
        from tensorflow.python.distribute import multi_worker_util
        from tensorflow.python.eager import context
        ctx = context.context()
        if ctx._context_handle is not None:   # the only way TensorFlow exposes "already initialised"
            raise CrossbowError("TensorFlow was already running when the cluster was set up; create the "
                                "multi-worker CrossbowStrategy before building models or tensors")
        ctx.configure_collective_ops(
            collective_leader=multi_worker_util.collective_leader(self.spec, self.task_type, self.task_id),
            device_filters=(f"/job:{self.task_type}/task:{self.task_id}",))
        server_def = tensorflow_server_pb2.ServerDef(
            cluster=self.spec.as_cluster_def(), job_name=self.task_type, task_index=self.task_id,
            protocol=self.resolver.rpc_layer or "grpc", default_session_config=ctx.config,
            port=getattr(self.resolver, "port", None) or 0)
        try:
            ctx.enable_collective_ops(server_def)
            ctx.ensure_initialized()
        except Exception as e:   # e.g. the port is taken: one line, not TensorFlow's traceback
            raise ClusterError(f"{self.describe(self.worker_index)}: could not start its TensorFlow server: "
                               f"{str(e).splitlines()[0]}") from None
        self.started = True
        job, i = self.tasks[self.worker_index]
        addresses = [self.spec.task_address(*task) for task in self.tasks]
        print(exposure_line(self.describe(self.worker_index), self.spec.task_address(job, i), addresses),
              file=sys.stderr, flush=True)
        return self

    def wait_for_workers(self):
        """Returns once every other worker's server answers; a ClusterError after ``timeout`` s."""
        deadline = time.monotonic() + self.timeout
        waiting = [w for w in range(self.num_workers) if w != self.worker_index]
        while waiting:
            waiting = [w for w in waiting if self._probe(w) is not None]
            if waiting and time.monotonic() > deadline:
                raise ClusterError(f"{', '.join(self.describe(w) for w in waiting)} did not start within "
                                   f"{self.timeout:g} s (worker timeout); every worker must run the same "
                                   "command with its own task index")
            if waiting:
                time.sleep(_POLL_SECONDS)

    HUNG = f"does not respond within {_PROBE_MS / 1000:g} s (hung)"

    def _probe(self, worker):
        """None when WORKER's server answers TensorFlow's peer-health probe, else the reason."""
        import tensorflow as tf
        from tensorflow.python.eager import context
        try:
            context.context().check_collective_ops_peer_health(self.task_name(worker), _PROBE_MS)
            return None
        except tf.errors.UnavailableError:
            return "does not answer (not running)"
        except tf.errors.DeadlineExceededError:
            return self.HUNG
        except tf.errors.FailedPreconditionError:
            return "restarted (a new process took its place)"

    # --------------------------------------------------------------------------------- collectives
    def next_instance_key(self):
        """A fresh instance key; every worker asks for keys in the same order (they run one program)."""
        self._next_instance_key += 1
        return self._next_instance_key

    def group_key(self, device):
        return GROUP_KEYS[_device_type(device)]

    def all_reduce(self, tensor, instance_key, device, ordering_token=None, merge_op="Add", timeout=None):
        """TENSOR (on DEVICE) reduced over the workers; call inside a tf.function or eagerly.
        TIMEOUT: seconds (default the worker timeout; 0 waits without bound)."""
        from tensorflow.python.ops import collective_ops
        return collective_ops.all_reduce_v2(
            tensor, group_size=self.num_workers, group_key=self.group_key(device), instance_key=instance_key,
            merge_op=merge_op, final_op="Id", timeout=self.timeout if timeout is None else timeout,
            ordering_token=ordering_token,
            # Between GPUs NCCL, as MultiWorkerMirroredStrategy's; without the hint a gRPC ring.
            communication_hint="NCCL" if _device_type(device) == "GPU" else "auto")

    def _eager_reduce(self, array, merge_op):
        """ARRAY reduced over the workers, waiting as long as every peer is alive (see _eager)."""
        import tensorflow as tf
        return self._eager(lambda key, device: self.all_reduce(tf.constant(array), key, device, merge_op=merge_op,
                                                               timeout=0))

    def _eager_gather(self, array):
        """ARRAY (1-D, the same length on every worker) of every worker, concatenated in worker order."""
        import tensorflow as tf
        from tensorflow.python.ops import collective_ops
        return self._eager(lambda key, device: collective_ops.all_gather_v2(
            tf.constant(array), group_size=self.num_workers, group_key=self.group_key(device),
            instance_key=key, timeout=0))

    def _eager(self, collective):
        """COLLECTIVE(instance_key, device)'s value as a NumPy array, waiting as long as every peer is alive.

        These collectives follow uneven local work (each worker's auto-tuning, the chief's
        evaluation or checkpoint) that can outlast the worker timeout. So the collective waits
        without a bound in a thread while this one probes the peers every few seconds: a peer that
        is gone, or has answered no probe for the worker timeout, aborts the wait and is named."""
        import threading

        import tensorflow as tf
        device = "/device:CPU:0"
        key = self.next_instance_key()
        outcome = {}

        def run():
            try:
                with tf.device(device):
                    outcome["value"] = collective(key, device).numpy()
            except Exception as e:   # handed to the waiting thread
                outcome["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(_PROBE_MS / 1000)
        silent_since = {}
        while thread.is_alive():
            lost = self._lost_workers(silent_since)
            if lost:
                self._abort_collectives("; ".join(lost))
                raise ClusterError(f"lost {'; '.join(lost)}; {self.describe(self.worker_index)} stops")
            thread.join(_PROBE_MS / 1000)
        if "error" in outcome:
            with self.guard():
                raise outcome["error"]
        return outcome["value"]

    @staticmethod
    def _abort_collectives(reason):
        """Aborts this process's pending collectives (the waiting thread's among them) with REASON."""
        import tensorflow as tf
        from tensorflow.python.eager import context
        context.context().abort_collective_ops(tf.errors.UNAVAILABLE, reason)

    def _lost_workers(self, silent_since=None):
        """Descriptions of the other workers that do not answer the peer-health probe, with why.

        With SILENT_SINCE ({worker: when its probes began to go unanswered}, kept by the caller
        across calls) a peer that only fails to answer within the probe's 2 s counts as lost once
        it has been silent for the worker timeout; a peer that is gone counts at once."""
        lost = []
        for w in range(self.num_workers):
            if w == self.worker_index:
                continue
            asked = time.monotonic()
            reason = self._probe(w)
            if reason is None:
                if silent_since is not None:
                    silent_since.pop(w, None)
                continue
            if silent_since is not None and reason == self.HUNG:
                since = silent_since.setdefault(w, asked)
                if time.monotonic() - since < self.timeout:
                    continue
                reason = f"does not respond: answered no probe for {self.timeout:g} s (hung)"
            lost.append(f"{self.describe(w)} {reason}")
        return lost

    def agree_min(self, value):
        """The minimum of VALUE (an integer) over all workers."""
        return int(self._eager_reduce(np.array([value], np.int64), "Min")[0])

    def broadcast_from_chief(self, arrays):
        """The chief's ARRAYS on every worker (a sum in which the others contribute zeros: exact)."""
        def from_chief(flat):
            return self._eager_reduce(flat if self.is_chief else np.zeros_like(flat), "Add")
        return [a[0] for a in _packed(arrays, from_chief, copies=1)]

    def agree_any(self, flag):
        """Whether FLAG is true on any worker."""
        return bool(self._eager_reduce(np.array([int(bool(flag))], np.int64), "Max")[0])

    def gather(self, arrays):
        """Every worker's ARRAYS (the same shapes and dtypes on every worker), on every worker: one
        array per entry with a leading axis of workers, in worker order."""
        return _packed(arrays, self._eager_gather, copies=self.num_workers)

    def text_from_chief(self, text):
        """The chief's TEXT (a str; the others pass anything) on every worker."""
        data = np.frombuffer(text.encode(), np.uint8).astype(np.int32) if self.is_chief else np.zeros(0, np.int32)
        size = self.broadcast_from_chief([np.array([data.size], np.int64)])[0][0]
        if not self.is_chief:
            data = np.zeros(int(size), np.int32)
        data = self.broadcast_from_chief([data])[0] if size else data
        return data.astype(np.uint8).tobytes().decode()

    def decided_by_chief(self, decide, error_type):
        """DECIDE()'s value (JSON-able), computed on the chief only, on every worker. An ERROR_TYPE
        it raises is raised on every worker alike, with the chief's message."""
        import json
        outcome = {}
        if self.is_chief:
            try:
                outcome = dict(value=decide())
            except error_type as e:
                outcome = dict(error=str(e))
        outcome = json.loads(self.text_from_chief(json.dumps(outcome)))
        if "error" in outcome:
            raise error_type(outcome["error"])
        return outcome["value"]

    def on_chief(self, function, num_values):
        """FUNCTION run on the chief only, its result (NUM_VALUES floats) given to every worker (who
        wait for it as long as the chief is alive)."""
        def run_on_chief(*args, **kwargs):
            values = np.zeros(num_values, np.float64)
            if self.is_chief:
                values = np.array(function(*args, **kwargs), np.float64).reshape(num_values)
            return tuple(float(v) for v in self.broadcast_from_chief([values])[0])
        return run_on_chief

    # ------------------------------------------------------------------------------------ failures
    @contextlib.contextmanager
    def guard(self):
        """Turns TensorFlow's errors from a failed collective into one ClusterError naming the missing
        worker(s)."""
        import tensorflow as tf
        try:
            yield
        except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError, tf.errors.CancelledError,
                tf.errors.AbortedError) as e:
            raise self.diagnose(e) from None

    def diagnose(self, error):
        """A ClusterError for ERROR (a TensorFlow error from a collective) naming the missing workers."""
        missing = self._lost_workers()
        first_line = next((line.strip() for line in str(error).splitlines()
                           if "timed out" in line or "abort" in line.lower()), type(error).__name__)
        # TensorFlow's node and op names around the reason say nothing to the user.
        first_line = re.sub(r"\s*\[Op:.*$", "", re.sub(r"\{\{.*?\}\}\s*", "", first_line))
        if missing:
            return ClusterError(f"lost {'; '.join(missing)}; {self.describe(self.worker_index)} stops "
                                f"(cross-worker all-reduce: {first_line})")
        return ClusterError(f"a cross-worker all-reduce failed within the {self.timeout:g} s worker timeout "
                            f"though every worker still answers (one is stuck or runs a different "
                            f"program): {first_line}")

    # ------------------------------------------------------------------------------------- logging
    def log_function(self, log=print):
        """LOG on the chief; on the other workers, lines on stderr with a worker prefix."""
        if self.is_chief:
            return log
        prefix = f"[worker {self.worker_index}] "

        def worker_log(message):
            print(prefix + str(message).replace("\n", "\n" + prefix), file=sys.stderr, flush=True)
        return worker_log


def from_resolver(resolver, timeout=DEFAULT_TIMEOUT):
    """A Cluster for RESOLVER, or None when its spec has a single worker (nothing to reduce across)."""
    cluster = Cluster(resolver, timeout)
    return cluster if cluster.num_workers > 1 else None


def from_environment(timeout=DEFAULT_TIMEOUT):
    """The cluster TF_CONFIG describes, or None without TF_CONFIG (or with a single worker)."""
    import json
    import os
    text = os.environ.get("TF_CONFIG", "").strip()
    if not text:
        return None
    try:
        json.loads(text)
    except ValueError as e:
        raise CrossbowError(f"TF_CONFIG is not valid JSON: {e}") from None
    from tensorflow.python.distribute.cluster_resolver import TFConfigClusterResolver
    return from_resolver(TFConfigClusterResolver(), timeout)


def local_tf_configs(num_workers, host="127.0.0.1"):
    """TF_CONFIG texts of NUM_WORKERS workers on HOST (free ports), one per worker: for trying a
    cluster on one machine. (A port could be taken between this call and the servers' start.)"""
    import json
    import socket
    sockets = [socket.socket() for _ in range(num_workers)]
    try:
        for s in sockets:
            s.bind((host, 0))
        addresses = [f"{host}:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()
    return [json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}})
            for i in range(num_workers)]
