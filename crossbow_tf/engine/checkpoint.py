"""Checkpoints of a training run, complete enough that a resumed run continues bit for bit.

A checkpoint is a ``tf.train.Checkpoint`` written by a ``tf.train.CheckpointManager`` (TensorFlow
writes it under temporary names and renames it into place, then updates the directory's index, so
a killed process leaves the previous checkpoints intact; ``max_to_keep`` bounds the directory).
It holds every device's learners (weights, velocities and non-trainable state: BatchNorm
statistics, the seed state Dropout draws its masks from; with a Keras optimizer for the learners,
its step count and its slots, stacked per learner), z and u, under mixed_float16 the loss scale and
its good-step count, and one JSON record: the
configuration, the progress (``Progress``), the learners per device the run uses (the auto-tuner's
choice, so a resumed run does not re-tune) and the results so far (the tuner's curve among them).

The data order needs no state of its own: an epoch's order and augmentation are functions of
(seed, epoch, position), so the number of iterations done in the epoch is enough to continue it.
"""
import dataclasses
import json
import os

import tensorflow as tf

from crossbow_tf.errors import CheckpointError
from crossbow_tf.results import json_safe

FORMAT = 1
CHECKPOINT_NAME = "ckpt"
_RECORD_KEY = "record/.ATTRIBUTES/VARIABLE_VALUE"

# Keys of an experiment configuration that do not change the training trajectory: a resumed run
# may differ from its checkpoint in these (a prefix ending in "." covers a whole section).
# Evaluation is of z only and changes no weight; the auto-tuner's settings only choose m, which the
# checkpoint records.
NON_TRAJECTORY_KEYS = ("name", "epochs", "target_accuracy", "stop_at_target", "eval_batch_size",
                       "data.data_dir", "autotune.", "checkpoint.", "on_divergence", "max_rollbacks",
                       "learner_diagnostics", "collapse_epochs", "batchnorm_eval", "batchnorm_batches",
                       "algorithm.allow_unstable",
                       "data.path", "tensorboard")
# Keys added to the configuration since checkpoints were first written, with the value that a
# checkpoint without them was trained with.
ADDED_KEYS = {"precision": "float32"}


@dataclasses.dataclass
class Progress:
    """Where a run is: everything of the training loop's own state a checkpoint must carry."""
    iteration: int = 0            # iterations done
    epoch: int = 0                # epochs completed (evaluated and recorded)
    position: int = 0             # iterations done in epoch + 1
    examples: int = 0             # examples seen in the completed epochs
    train_time: float = 0.0       # training seconds of the completed epochs
    epoch_time: float = 0.0       # training seconds of epoch + 1 so far
    epoch_loss_sum: float = 0.0   # sum of the training loss over the examples of epoch + 1 so far
    epoch_seen: int = 0           # real examples of epoch + 1 so far
    lr_scale: float = 1.0         # every roll-back halves it
    rollbacks: int = 0
    chance_run: int = 0           # consecutive epochs (after the first) at chance accuracy
    finished: bool = False        # reached the target (or collapsed) and stopped


def _flatten(mapping, prefix=""):
    out = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def trajectory_differences(saved_config, config):
    """Dotted keys whose values differ between two configuration dicts and change the trajectory."""
    saved, current = dict(ADDED_KEYS, **_flatten(saved_config)), _flatten(config)
    def matters(key):
        return not any(key == k or (k.endswith(".") and key.startswith(k)) for k in NON_TRAJECTORY_KEYS)
    return [f"{key} ({saved.get(key)!r} in the checkpoint, {current.get(key)!r} now)"
            for key in sorted(set(saved) | set(current)) if matters(key) and saved.get(key) != current.get(key)]


def checkpoint_paths(directory):
    """The checkpoints in DIRECTORY, newest first (empty when there are none)."""
    try:
        state = tf.train.get_checkpoint_state(directory)
    except Exception as e:   # a damaged index file: TensorFlow raises a protobuf parse error
        raise CheckpointError(f"{os.path.join(directory, 'checkpoint')}: damaged checkpoint index "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if state is None:
        return []
    return list(reversed(state.all_model_checkpoint_paths))


def read_record(path):
    """The JSON record of the checkpoint at PATH (a prefix such as DIR/ckpt-63)."""
    try:
        record = json.loads(tf.train.load_checkpoint(path).get_tensor(_RECORD_KEY).decode())
    except Exception as e:   # missing or truncated files: NotFoundError, DataLossError, ...
        raise CheckpointError(f"{path}: damaged or incomplete checkpoint "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a crossbow_tf checkpoint of format {FORMAT}")
    return record


def newest_record(directory, log=print):
    """(path, record) of the newest readable checkpoint in DIRECTORY, or None when it holds none.

    A damaged newest checkpoint is passed over with one line saying so; all damaged is an error."""
    paths = checkpoint_paths(directory)
    problems = []
    for path in paths:
        try:
            return path, read_record(path)
        except CheckpointError as e:
            problems.append(str(e))
            log(f"skipping {e}")
    if problems:
        raise CheckpointError(f"{directory}: no usable checkpoint ({problems[0]})")
    return None


def _same_progress(state, other):
    """Whether two Progress dicts are at the same point (the times aside: each worker has its own)."""
    def point(progress):
        return {k: v for k, v in (progress or {}).items() if k not in ("train_time", "epoch_time")}
    return other is not None and point(state) == point(other)


class Checkpoints:
    """Saves and restores ENGINE's complete state with a run's record in DIRECTORY.

    On several workers only the chief writes and reads DIRECTORY. Its checkpoint holds every
    worker's learners: at a save each worker's learners are gathered to the chief (a collective of
    TensorFlow's, every worker calling ``save`` at the same point, as they do in lock-step), and
    listed by global device (worker w's device d is device w*D + d, the order of the learners).
    At a restore the chief reads the checkpoint and sends z, u and each worker's learners to every
    worker."""

    def __init__(self, directory, engine, *, every_iterations=None, at_epoch_end=True, max_to_keep=3):
        self.directory, self.engine = directory, engine
        self.every_iterations, self.at_epoch_end = every_iterations, at_epoch_end
        self.cluster = engine.strategy.cluster
        self.writes = self.cluster is None or self.cluster.is_chief
        state = engine.state
        # Each a list over devices, under the names checkpoints have always used: weights, velocities,
        # states and, with a Keras optimizer for the learners, its step count and slots, stacked per
        # learner like the weights.
        groups = state.learner_groups()
        # This worker's learner variables, in one fixed order (the order of the gather).
        self._local = [v for group in groups.values() for device in group for v in device]
        self._others = []   # on the chief: per other worker, variables mirroring its learners
        if self.cluster is not None and self.writes:
            with tf.device("/CPU:0"):
                mirrors = [{name: [[tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in device]
                                   for device in group] for name, group in groups.items()}
                           for _ in range(1, self.cluster.num_workers)]
            self._others = [[v for group in m.values() for device in group for v in device] for m in mirrors]
            groups = {name: group + [device for m in mirrors for device in m[name]] for name, group in groups.items()}
        self.base_record = {}   # the run's fixed part: configuration, learners per device, workers
        self.last_saved, self._last_state = None, None
        if not self.writes:
            return
        with tf.device("/CPU:0"):
            self._record = tf.Variable("", dtype=tf.string, trainable=False)
        if state.loss_scale is not None:
            # mixed_float16's dynamic loss scale and its good iterations since it last changed.
            groups["loss_scale"] = state.scale_variables()
        # z, u, z's state and noise matching's running means (the same on every device and worker).
        self.checkpoint = tf.train.Checkpoint(record=self._record, **state.center_groups(), **groups)
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep,
                                                  checkpoint_name=CHECKPOINT_NAME)

    def due(self, iteration):
        return bool(self.every_iterations) and iteration % self.every_iterations == 0

    def save(self, progress, results):
        """Writes a checkpoint of the engine, PROGRESS and RESULTS; returns its path.

        Nothing is written when the last save was of the same progress. Numbers only grow, so an
        existing checkpoint is never overwritten (which would not be atomic). On several workers
        every worker calls this at the same point; only the chief writes."""
        state = dataclasses.asdict(progress)
        if self.last_saved is not None and _same_progress(state, self._last_state):
            return self.last_saved
        if self.cluster is not None:
            # Every worker's learners to the chief. (All of them reach every worker: TensorFlow's
            # collectives have no gather to one; checkpoints are rare.)
            gathered = self.cluster.gather([v.numpy() for v in self._local])
            for worker, variables in enumerate(self._others, start=1):
                for variable, values in zip(variables, gathered):
                    variable.assign(values[worker])
        if self.writes:
            record = dict(self.base_record, format=FORMAT, devices=self.engine.strategy.num_devices, progress=state,
                          results={"evaluations": results.evaluations, "extra": results.extra})
            self._record.assign(json.dumps(json_safe(record)))
            numbers = [int(p.rsplit("-", 1)[1]) for p in self.manager.checkpoints]
            self.last_saved = self.manager.save(checkpoint_number=max(numbers, default=0) + 1)
        else:
            self.last_saved = "the chief's checkpoint"
        self._last_state = state
        return self.last_saved

    def restore(self, path, results):
        """Loads the checkpoint at PATH into the engine and RESULTS; returns its Progress (one process;
        on several workers use ``restore_newest``)."""
        record = read_record(path)
        self._check_devices(path, record)
        self._read(path)
        return self._adopt(path, record, results)

    def _check_devices(self, path, record):
        """Refuses a checkpoint of another device count: its per-device variables would be read in
        part (TensorFlow leaves a checkpoint's extra objects unread) and its learners lost."""
        saved, have = record.get("devices"), self.engine.strategy.num_devices
        if saved is not None and saved != have:
            raise CheckpointError(f"{path}: written by a run on {saved} device(s), this one has {have}: resume on "
                                  f"{saved} device(s) (devices.logical_cpu, or the GPUs in CUDA_VISIBLE_DEVICES)")

    def _read(self, path):
        try:
            self.checkpoint.read(path).assert_existing_objects_matched()
        except Exception as e:
            raise CheckpointError(f"{path}: cannot be restored into this model and strategy "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None

    def _adopt(self, path, record, results):
        saved = record["results"]
        results.evaluations[:] = saved["evaluations"]
        results.extra.update(saved["extra"])
        self.engine.write_center_to_model()
        self.last_saved, self._last_state = path, record["progress"]
        return Progress(**record["progress"])

    def _read_newest(self, log):
        """(path, record) of the newest checkpoint that loads (passing over damaged ones)."""
        problems = []
        for path in checkpoint_paths(self.directory):
            try:
                record = read_record(path)
            except CheckpointError as e:
                problems.append(str(e))
                log(f"skipping {e}")
                continue
            self._check_devices(path, record)   # not a damaged checkpoint: the wrong machine
            try:
                self._read(path)
                return path, record
            except CheckpointError as e:
                problems.append(str(e))
                log(f"skipping {e}")
        raise CheckpointError(f"{self.directory}: no usable checkpoint"
                              + (f" ({problems[0]})" if problems else ""))

    def restore_newest(self, results, log=print):
        """Restores the newest checkpoint that loads (passing over damaged ones); (path, Progress).
        On several workers every worker calls this at the same point: the chief reads, and every
        worker continues from what it read (or stops with its error)."""
        if self.cluster is None:
            path, record = self._read_newest(log)
            return path, self._adopt(path, record, results)
        path, record = self.cluster.decided_by_chief(lambda: self._read_newest(log), CheckpointError)
        self._receive_from_chief()
        return path, self._adopt(path, record, results)

    def _receive_from_chief(self):
        """The chief's z, u and every worker's learners as it restored them: each worker keeps its own."""
        state, cluster = self.engine.state, self.cluster
        center = state.shared_variables(0)
        learners = [self._local] + self._others if self.writes else [self._local] * cluster.num_workers
        arrays = cluster.broadcast_from_chief([v.numpy() for v in center + [v for w in learners for v in w]])
        center_values, arrays = arrays[:len(center)], arrays[len(center):]
        for d in range(len(state.devices)):
            for variable, values in zip(state.shared_variables(d), center_values, strict=True):
                variable.assign(values)
        own = cluster.worker_index * len(self._local)
        for variable, values in zip(self._local, arrays[own:own + len(self._local)]):
            variable.assign(values)
