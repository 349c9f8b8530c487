"""The epoch loop: feed iterations to the engine, evaluate z, record results."""
import dataclasses
import math
import signal
import time

import numpy as np
import tensorflow as tf

from crossbow_tf import training_hooks
from crossbow_tf.data.pipeline import eval_batches, iterations_per_epoch, train_batches
from crossbow_tf.engine import diagnostics
from crossbow_tf.engine.checkpoint import Progress
from crossbow_tf.engine.replicated import per_example_loss_fn
from crossbow_tf.engine.schedule import is_drop
from crossbow_tf.errors import TrainingDiverged, TrainingInterrupted
from crossbow_tf.results import at_chance, reaches


class Evaluator:
    """Accuracy and mean loss of a Keras model over a split, in inference mode."""

    def __init__(self, model, loss):
        self.model = model
        self.per_example_loss = per_example_loss_fn(loss)
        # A compute_loss of the model's own is its loss in evaluation too, as in Keras's test_step.
        self.own_loss = training_hooks.overrides(type(model), "compute_loss")
        self._batch = tf.function(self._batch_fn, autograph=False)

    def _batch_fn(self, x, y):
        logits = self.model(x, training=False)
        if self.own_loss:
            mean = self.model._compute_loss(x=x, y=y, y_pred=logits, training=False)
            loss = tf.cast(mean, tf.float32) * tf.cast(tf.shape(y)[0], tf.float32)
        else:
            loss = tf.reduce_sum(self.per_example_loss(y, logits))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                                                 tf.cast(y, tf.int32)), tf.float32))
        return loss, correct

    def __call__(self, split, batch_size, map_fn=None):
        loss = correct = count = 0.0
        for x, y in eval_batches(split, batch_size, map_fn):
            l, c = self._batch(x, y)
            loss += float(l)
            correct += float(c)
            count += int(y.shape[0])
        return correct / count, loss / count


BATCHNORM_EVAL = ("averaged", "recomputed", "both")


def batchnorm_batches(data, batch_size, count, seed):
    """COUNT batches of training inputs (a fixed, seeded sample) for recomputing BatchNorm statistics."""
    ds = data.train.dataset.shuffle(min(data.train.size, 10000), seed=seed, reshuffle_each_iteration=False)
    ds = ds.take(count * batch_size)
    if data.eval_map is not None:
        ds = ds.map(data.eval_map)
    return (x for x, _ in ds.batch(batch_size))


@dataclasses.dataclass
class TrainOptions:
    """How ``train`` runs (see its docstring for each)."""
    seed: int = 0
    target_accuracy: float = None
    stop_at_target: bool = True
    eval_batch_size: int = 500
    shuffle: bool = True
    log: object = print
    learner_diagnostics: bool = True
    collapse_epochs: int = 2
    batchnorm_eval: str = "averaged"
    batchnorm_batches_count: int = 8
    checkpoints: object = None
    progress: object = None
    on_divergence: str = "stop"
    max_rollbacks: int = 3
    stop_signals: object = None
    on_evaluation: object = None


def train(engine, data, batch_size, epochs, schedule, results, options=None, **settings):
    """Trains ENGINE on DATA (a DataSource) and evaluates z after every epoch, as OPTIONS (a
    TrainOptions; SETTINGS, its fields by name, override it) say.

    Returns RESULTS with one evaluation per epoch; wall time counts training only: evaluation is
    excluded, tracing included once (a resumed run's tracing again is excluded and recorded as
    ``retrace_times``, so its time to target is that of the run had it not stopped).
    LEARNER_DIAGNOSTICS: also record learner 0's test accuracy and the learners' mean distance to z.
    COLLAPSE_EPOCHS: stop, recorded as collapsed, when z sits at chance accuracy for this many
    epochs after the first (0: never). BATCHNORM_EVAL: evaluate z with the learners' averaged
    BatchNorm statistics, with statistics "recomputed" on BATCHNORM_BATCHES_COUNT training batches
    (their cost counts as training time), or "both" (averaged counts; recomputed is recorded beside).

    CHECKPOINTS (crossbow_tf.engine.checkpoint.Checkpoints) saves the run at the start (unless
    PROGRESS says it resumes), every ``every_iterations`` and at epoch ends; PROGRESS (a Progress
    restored from a checkpoint, with RESULTS) continues a run where it stopped. STOP_SIGNALS
    (StopSignals) stops at an iteration boundary after a checkpoint: TrainingInterrupted.
    A non-finite loss, learner or z stops training with TrainingDiverged (RESULTS keep the epochs
    so far); ON_DIVERGENCE="rollback" first restores the newest checkpoint with the learning rate
    halved, at most MAX_ROLLBACKS times. ON_EVALUATION(evaluation, learning_rate), when given, is
    called with each evaluation recorded (e.g. crossbow_tf.tensorboard.EvaluationWriter).
    """
    options = dataclasses.replace(options or TrainOptions(), **settings)
    if options.batchnorm_eval not in BATCHNORM_EVAL:
        raise ValueError(f"batchnorm_eval: choose one of {', '.join(BATCHNORM_EVAL)}, got {options.batchnorm_eval!r}")
    run = _Run(engine, data, batch_size, epochs, schedule, results, options)
    return _train_with_rollbacks(run, results, options)


def _train_with_rollbacks(run, results, options):
    """RUN's epochs, rolled back to the newest checkpoint on a divergence as OPTIONS say; RESULTS."""
    checkpoints, progress, stop_signals, log = options.checkpoints, options.progress, options.stop_signals, options.log
    on_divergence, max_rollbacks = options.on_divergence, options.max_rollbacks
    run.on_evaluation = options.on_evaluation
    # A run resumed after training began traced its step in the process that trained first, and that
    # time is in its training time: this process's tracing again is restart cost, not training.
    run.retrace_pending = progress is not None and progress.iteration > 0
    if stop_signals is not None:
        stop_signals.deferred = True
    try:
        if progress is None:
            progress = Progress()
            if checkpoints is not None:
                checkpoints.save(progress, results)   # a run always has a good checkpoint to return to
        while True:
            try:
                run.epochs(progress)
                break
            except _NonFinite as e:
                if on_divergence != "rollback" or checkpoints is None or progress.rollbacks >= max_rollbacks:
                    results.extra["diverged"] = dict(iteration=e.iteration, epoch=e.epoch, non_finite=e.what)
                    tried = f" after {progress.rollbacks} roll-back(s)" if on_divergence == "rollback" else ""
                    kept = f"; last good checkpoint {checkpoints.last_saved}" if checkpoints is not None else ""
                    diverged = TrainingDiverged(f"diverged{tried}: {e}{kept}")
                    diverged.results = results
                    raise diverged from None
                lr_scale, rollbacks = progress.lr_scale / 2, progress.rollbacks + 1
                path, progress = checkpoints.restore_newest(results, log=log)
                progress.lr_scale, progress.rollbacks = lr_scale, rollbacks
                log(f"{e}: rolling back to {path} (iteration {progress.iteration}) with the learning rate "
                    f"scaled by {lr_scale:g} (roll-back {rollbacks} of {max_rollbacks})")
    finally:
        if stop_signals is not None:
            stop_signals.deferred = False
    if progress.rollbacks:
        results.extra["rollbacks"] = progress.rollbacks
        results.extra["lr_scale"] = progress.lr_scale
    if len(run.step_times) > 1:
        results.extra["first_step_time"] = run.step_times[0]
        results.extra["trace_time"] = max(run.step_times[0] - float(np.median(run.step_times[1:])), 0.0)
    results.extra["iterations_per_epoch"] = run.per_epoch
    return results


class _NonFinite(Exception):
    def __init__(self, what, iteration, epoch, position, per_epoch):
        self.what, self.iteration, self.epoch = what, iteration, epoch
        super().__init__(f"not finite at iteration {iteration} (epoch {epoch}, iteration {position} of "
                         f"{per_epoch}): {describe_non_finite(what)}")


def describe_non_finite(what):
    """WHAT (Engine.non_finite's names) in words, runs of learners as ranges: "the loss, learners 0-127"."""
    words, learners = [], []
    for name in list(what) + [None]:
        if name is not None and name.startswith("learner ") and name[8:].isdigit():
            learners.append(int(name[8:]))
            continue
        if learners:
            runs, start = [], learners[0]
            for previous, current in zip(learners, learners[1:] + [None]):
                if current != previous + 1:
                    runs.append(f"{start}" if start == previous else f"{start}-{previous}")
                    start = current
            words.append(("learner " if len(learners) == 1 else "learners ") + ", ".join(runs))
            learners = []
        if name is not None:
            words.append(name)
    return ", ".join(words)


class _Run:
    """The epoch loop of ``train``, resumable from any Progress."""
    on_evaluation = None   # train's ON_EVALUATION

    def __init__(self, engine, data, batch_size, epochs, schedule, results, options):
        self.engine, self.data, self.epochs_total, self.schedule, self.results = engine, data, epochs, schedule, results
        o = options
        self.seed, self.target_accuracy, self.stop_at_target = o.seed, o.target_accuracy, o.stop_at_target
        self.eval_batch_size, self.shuffle, self.log = o.eval_batch_size, o.shuffle, o.log
        self.learner_diagnostics, self.collapse_epochs = o.learner_diagnostics, o.collapse_epochs
        self.batchnorm_eval, self.batchnorm_batches_count = o.batchnorm_eval, o.batchnorm_batches_count
        self.checkpoints, self.stop_signals = o.checkpoints, o.stop_signals
        self.global_batch = engine.num_learners * batch_size
        self.per_epoch = iterations_per_epoch(data.train.size, self.global_batch)
        engine.iterations_per_epoch = self.per_epoch   # post-local SGD's switch is counted in epochs
        self.evaluator = Evaluator(engine.model, engine.learner_computation.per_example_loss)
        if engine.strategy.cluster is not None:
            # Once per epoch on the chief; the other workers receive its figures (same z on every worker).
            self.evaluator = engine.strategy.cluster.on_chief(self.evaluator, num_values=2)
        # On several workers each decodes only its own learners' rows of every iteration.
        self.rows = engine.local_rows(self.global_batch) if engine.strategy.num_workers > 1 else None
        self.cluster = engine.strategy.cluster
        self.step_times = []

    retrace_pending = False   # set by ``train`` for a resumed run (see _exclude_retrace)

    def _exclude_retrace(self, p):
        """Takes this process's tracing of the step out of P's training time, once, in a resumed run:
        the first step's time beyond a typical step's (the median of this process's later steps, or
        with none yet the last recorded epoch's time per iteration). Recorded in
        results.extra["retrace_times"], one entry per resumption. Called whenever timed spans are
        added to P, before anything (a checkpoint, an evaluation) reads them."""
        if not self.retrace_pending or not self.step_times:
            return
        later = self.step_times[1:]
        if later:
            typical = float(np.median(later))
        else:
            last = self.results.evaluations[-1] if self.results.evaluations else None
            typical = last["epoch_time"] / self.per_epoch if last and last.get("epoch_time") else 0.0
        retrace = min(max(self.step_times[0] - typical, 0.0), p.epoch_time)
        p.epoch_time -= retrace
        self.results.extra.setdefault("retrace_times", []).append(retrace)
        self.retrace_pending = False

    def _signalled(self):
        return self.stop_signals is not None and self.stop_signals.received is not None

    def _stop_if_asked(self, p, segment_start=None, asked=None):
        """Stops (TrainingInterrupted, after a checkpoint) when a stop signal came, or ASKED says so.

        On several workers all must stop after the same iteration, so a signal on one worker is a
        vote carried by the next step's all-reduce (``Engine.vote_stop``), read after that step
        (ASKED); at an epoch's end, the workers agree with one collective of their own."""
        if asked is None:
            asked = self._signalled()
            if self.cluster is not None:
                asked = self.cluster.agree_any(asked)
        if asked:
            if segment_start is not None:
                p.epoch_time += time.perf_counter() - segment_start
                self._exclude_retrace(p)
            path = self._save(p) if self.checkpoints is not None else None
            received = self.stop_signals.received if self.stop_signals is not None else None
            raise TrainingInterrupted(received or signal.SIGTERM, path, p.iteration, p.epoch + 1,
                                      elsewhere=received is None)

    def _save(self, p):
        """Checkpoints P after making sure everything is finite: a checkpoint is always a good one.
        (The step checks the loss and z; a learner that went non-finite in the step just done would
        only show in its next loss.)"""
        what = self.engine.non_finite()
        if self.cluster is not None and self.cluster.agree_any(bool(what)) and not what:
            what = ["a learner of another worker"]   # every worker stops, or rolls back, alike
        if what:
            epoch, position = (p.epoch + 1, p.position) if p.position else (p.epoch, self.per_epoch)
            raise _NonFinite(what, p.iteration, epoch, position, self.per_epoch)
        return self.checkpoints.save(p, self.results)

    def epochs(self, p):
        engine, schedule = self.engine, self.schedule
        for epoch in range(p.epoch + 1, self.epochs_total + 1):
            if p.finished:
                break
            batches = train_batches(self.data.train, self.global_batch, epoch, seed=self.seed, shuffle=self.shuffle,
                                    map_fn=self.data.train_map, skip_iterations=p.position, rows=self.rows)
            segment_start = time.perf_counter()
            for x, y, mask, *count in batches:   # COUNT: the iteration's real examples, with ROWS
                if self.cluster is None:
                    self._stop_if_asked(p, segment_start)
                elif self._signalled():
                    engine.vote_stop()
                step_start = time.perf_counter()
                if engine.algorithm.reset_on_lr_drop and is_drop(schedule, p.iteration):
                    engine.reset_learners()
                loss, _ = engine.train_step(x, y, mask, schedule(p.iteration) * p.lr_scale, *count,
                                            iteration=p.iteration)
                loss = float(loss)   # NaN when the loss, a learner or z is not finite (Engine.train_step)
                if not math.isfinite(loss):
                    raise _NonFinite(engine.non_finite() or ["the loss"], p.iteration + 1, epoch, p.position + 1,
                                     self.per_epoch)
                n = int(count[0] if count else mask.numpy().sum())
                p.epoch_loss_sum += loss * n
                p.epoch_seen += n
                p.iteration += 1
                p.position += 1
                self.step_times.append(time.perf_counter() - step_start)
                last_of_epoch = p.position == self.per_epoch
                if (self.checkpoints is not None and self.checkpoints.due(p.iteration)
                        and not (last_of_epoch and self.checkpoints.at_epoch_end)):
                    # Checkpoint writing is not training time.
                    p.epoch_time += time.perf_counter() - segment_start
                    self._exclude_retrace(p)
                    self._save(p)
                    segment_start = time.perf_counter()
                if self.cluster is not None and not last_of_epoch:
                    self._stop_if_asked(p, segment_start, asked=engine.stop_voted())
            p.epoch_time += time.perf_counter() - segment_start
            self._exclude_retrace(p)
            self._end_epoch(p, epoch)
            if self.checkpoints is not None and (self.checkpoints.at_epoch_end or p.finished):
                self._save(p)
            if not p.finished and epoch < self.epochs_total:   # a finished run just ends
                self._stop_if_asked(p)

    def _end_epoch(self, p, epoch):
        engine, schedule, data, evaluator = self.engine, self.schedule, self.data, self.evaluator
        epoch_time, seen = p.epoch_time, p.epoch_seen
        train_loss = p.epoch_loss_sum / max(seen, 1)
        p.train_time += epoch_time
        p.examples += seen
        more = {}
        if self.learner_diagnostics and not engine.algorithm.gradient_at_center:
            diagnostics.write_learner_to_model(engine, 0)
            more["learner_accuracy"], _ = evaluator(data.test, self.eval_batch_size, data.eval_map)
            more["learner_distance"] = diagnostics.mean_distance_to_center(engine)
            more["center_norm"] = diagnostics.center_norm(engine)
        engine.write_center_to_model()
        if self.batchnorm_eval != "averaged":
            if self.batchnorm_eval == "both":
                averaged = evaluator(data.test, self.eval_batch_size, data.eval_map)
            bn_start = time.perf_counter()
            diagnostics.recompute_batchnorm(
                engine.model, batchnorm_batches(data, self.eval_batch_size, self.batchnorm_batches_count, self.seed))
            more["bn_recompute_time"] = time.perf_counter() - bn_start
            if self.batchnorm_eval == "recomputed":
                p.train_time += more["bn_recompute_time"]
        accuracy, test_loss = evaluator(data.test, self.eval_batch_size, data.eval_map)
        if self.batchnorm_eval == "both":   # the recorded accuracy stays the averaged statistics' one
            more["accuracy_bn_recomputed"] = accuracy
            accuracy, test_loss = averaged
            engine.write_center_to_model()
        self.results.add_evaluation(epoch=epoch, iteration=p.iteration, examples=p.examples, wall_time=p.train_time,
                                    accuracy=accuracy, loss=test_loss, train_loss=train_loss,
                                    epoch_time=epoch_time, images_per_second=seen / epoch_time,
                                    test_examples=data.test.size, **more)
        if self.on_evaluation is not None:
            self.on_evaluation(self.results.evaluations[-1], schedule(p.iteration - 1) * p.lr_scale)
        extra = "".join([f"  learner 0 {more['learner_accuracy']:.4f}" if "learner_accuracy" in more else "",
                         f"  distance to z {more['learner_distance']:.3g}" if "learner_distance" in more else "",
                         f"  recomputed-BN accuracy {more['accuracy_bn_recomputed']:.4f}"
                         if "accuracy_bn_recomputed" in more else ""])
        self.log(f"epoch {epoch:3d}/{self.epochs_total}  test accuracy {accuracy:.4f}  test loss {test_loss:.4f}  "
                 f"train loss {train_loss:.4f}  time {epoch_time:6.2f}s  "
                 f"{seen / epoch_time:8.0f} images/s  lr {schedule(p.iteration - 1) * p.lr_scale:.4g}{extra}")
        p.epoch, p.position, p.epoch_time, p.epoch_loss_sum, p.epoch_seen = epoch, 0, 0.0, 0.0, 0
        if (self.target_accuracy is not None and self.stop_at_target
                and reaches(accuracy, self.target_accuracy, data.test.size)):
            p.finished = True
            return
        p.chance_run = p.chance_run + 1 if epoch > 1 and at_chance(accuracy, data.num_classes) else 0
        if self.collapse_epochs and p.chance_run >= self.collapse_epochs:
            self.results.extra["collapsed"] = True
            self.log(f"collapsed: test accuracy at chance ({1 / data.num_classes:.0%}) for {p.chance_run} epochs "
                     f"after the first; stopped at epoch {epoch}")
            p.finished = True
