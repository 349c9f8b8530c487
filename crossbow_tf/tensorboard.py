"""TensorBoard event files: a run's curves (``--tensorboard DIR``) and a harness trial's hparams.

A run writes, per evaluation (step = epoch), with tf.summary: z's test accuracy and loss, the train
loss, images/s, the learning rate and, for SMA-family runs, learner 0's test accuracy and the
learners' mean distance to z; and z's accuracy against training time (ACCURACY_BY_TIME_TAG).
Every method uses the same tags, so ``tensorboard --logdir`` over several runs overlays them.

Imports no TensorFlow at module level: the command lines check the folder before TensorFlow
starts, and the harness writes hparams without it (see write_hparams).
"""
import os
import socket
import time

from crossbow_tf.files import OutputError, check_creatable

# Evaluation keys (crossbow_tf.results) and their tags.
SCALARS = {
    "accuracy": "test/accuracy",
    "loss": "test/loss",
    "train_loss": "train/loss",
    "images_per_second": "train/images_per_second",
    "learner_accuracy": "learners/learner0_accuracy",
    "learner_distance": "learners/mean_distance_to_z",
}
LEARNING_RATE_TAG = "train/learning_rate"
# TensorBoard's x axis is the step or the wall clock, which also counts start-up, tracing apart,
# and evaluation; z's accuracy once more, at step = training time in milliseconds (the results'
# wall_time), puts time to accuracy on the x axis.
ACCURACY_BY_TIME_TAG = "test/accuracy_by_training_ms"


def check_logdir(path):
    """Raises OutputError unless PATH is a folder, or one can be made there (nothing is created)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"{path}: the TensorBoard folder is a file; give a folder")
    check_creatable(path, os.path.abspath(path), "TensorBoard folder")


class EvaluationWriter:
    """Called with each evaluation (a RunResults evaluation mapping) and the learning rate of its
    last iteration; writes their scalars to LOGDIR. Create it after the devices are set up (it
    starts TensorFlow's runtime)."""

    def __init__(self, logdir):
        import tensorflow as tf
        self._tf = tf
        self.logdir = logdir
        self._writer = tf.summary.create_file_writer(logdir)

    def __call__(self, evaluation, learning_rate):
        tf = self._tf
        with self._writer.as_default(step=int(evaluation["epoch"])):
            for key, tag in SCALARS.items():
                value = evaluation.get(key)
                if value is not None:
                    tf.summary.scalar(tag, float(value))
            tf.summary.scalar(LEARNING_RATE_TAG, float(learning_rate))
        with self._writer.as_default(step=int(round(evaluation["wall_time"] * 1000))):
            tf.summary.scalar(ACCURACY_BY_TIME_TAG, float(evaluation["accuracy"]))
        self._writer.flush()   # a run stopped by a signal keeps every epoch written so far

    def close(self):
        self._writer.close()


def write_hparams(logdir, hparams, group=None):
    """Writes HPARAMS ({name: bool, int, float or str}) of the run whose events are in LOGDIR, with
    TensorBoard's hparams API; GROUP names the trial its seeds share.

    Without TensorFlow, for the harness: tensorboard.plugins.hparams.api re-exports summary_v2
    beside a Keras callback that imports TensorFlow, and TensorBoard's EventFileWriter opens files
    through TensorFlow when it is installed; summary_v2's protocol buffer and TensorBoard's
    RecordWriter on a plain file need neither."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import summary_v2
    from tensorboard.summary.writer.record_writer import RecordWriter

    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    # TensorBoard reads files named events.out.tfevents.*; this one's own suffix keeps it apart from
    # the run's, which tf.summary names the same way.
    name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.hparams"
    with open(os.path.join(logdir, name), "wb") as f:
        writer = RecordWriter(f)
        writer.write(event_pb2.Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        writer.write(event_pb2.Event(wall_time=now, summary=summary_v2.hparams_pb(hparams, trial_id=group))
                     .SerializeToString())
