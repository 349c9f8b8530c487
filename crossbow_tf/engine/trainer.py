"""The epoch loop: feed iterations to the engine, evaluate z, record results."""
import time

import numpy as np
import tensorflow as tf

from crossbow_tf.data.pipeline import eval_batches, iterations_per_epoch, train_batches
from crossbow_tf.engine import diagnostics
from crossbow_tf.engine.replicated import per_example_loss_fn
from crossbow_tf.engine.schedule import is_drop
from crossbow_tf.results import at_chance, reaches


class Evaluator:
    """Accuracy and mean loss of a Keras model over a split, in inference mode."""

    def __init__(self, model, loss):
        self.model = model
        self.per_example_loss = per_example_loss_fn(loss)
        self._batch = tf.function(self._batch_fn, autograph=False)

    def _batch_fn(self, x, y):
        logits = self.model(x, training=False)
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


def train(engine, data, batch_size, epochs, schedule, results, *, seed=0, target_accuracy=None,
          stop_at_target=True, eval_batch_size=500, shuffle=True, log=print, learner_diagnostics=True,
          collapse_epochs=2, batchnorm_eval="averaged", batchnorm_batches_count=8):
    """Trains ENGINE on DATA (a DataSource) and evaluates z after every epoch.

    Returns RESULTS with one evaluation per epoch; wall time counts training only.
    LEARNER_DIAGNOSTICS: also record learner 0's test accuracy and the learners' mean distance to z.
    COLLAPSE_EPOCHS: stop, recorded as collapsed, when z sits at chance accuracy for this many
    epochs after the first (0: never). BATCHNORM_EVAL: evaluate z with the learners' averaged
    BatchNorm statistics, with statistics "recomputed" on BATCHNORM_BATCHES_COUNT training batches
    (their cost counts as training time), or "both" (averaged counts; recomputed is recorded beside).
    """
    if batchnorm_eval not in BATCHNORM_EVAL:
        raise ValueError(f"batchnorm_eval: choose one of {', '.join(BATCHNORM_EVAL)}, got {batchnorm_eval!r}")
    k = engine.num_learners
    global_batch = k * batch_size
    per_epoch = iterations_per_epoch(data.train.size, global_batch)
    evaluator = Evaluator(engine.model, engine.learners.per_example_loss)
    iteration, examples, train_time = 0, 0, 0.0
    step_times = []
    chance_run = 0
    for epoch in range(1, epochs + 1):
        batches = train_batches(data.train, global_batch, epoch, seed=seed, shuffle=shuffle,
                                map_fn=data.train_map)
        epoch_start = time.perf_counter()
        loss_sum, seen = 0.0, 0
        for x, y, mask in batches:
            step_start = time.perf_counter()
            if engine.algorithm.reset_on_lr_drop and is_drop(schedule, iteration):
                engine.reset_learners()
            loss, _ = engine.train_step(x, y, mask, schedule(iteration))
            n = int(mask.numpy().sum())
            loss_sum += float(loss) * n
            seen += n
            step_times.append(time.perf_counter() - step_start)
            iteration += 1
        epoch_time = time.perf_counter() - epoch_start
        train_time += epoch_time
        examples += seen
        more = {}
        if learner_diagnostics and not engine.algorithm.gradient_at_center:
            diagnostics.write_learner_to_model(engine, 0)
            more["learner_accuracy"], _ = evaluator(data.test, eval_batch_size, data.eval_map)
            more["learner_distance"] = diagnostics.mean_distance_to_center(engine)
            more["center_norm"] = diagnostics.center_norm(engine)
        engine.write_center_to_model()
        if batchnorm_eval != "averaged":
            if batchnorm_eval == "both":
                averaged = evaluator(data.test, eval_batch_size, data.eval_map)
            bn_start = time.perf_counter()
            used = diagnostics.recompute_batchnorm(
                engine.model, batchnorm_batches(data, eval_batch_size, batchnorm_batches_count, seed))
            more["bn_recompute_time"] = time.perf_counter() - bn_start
            if batchnorm_eval == "recomputed":
                train_time += more["bn_recompute_time"]
        accuracy, test_loss = evaluator(data.test, eval_batch_size, data.eval_map)
        if batchnorm_eval == "both":   # the recorded accuracy stays the averaged statistics' one
            more["accuracy_bn_recomputed"] = accuracy
            accuracy, test_loss = averaged
            engine.write_center_to_model()
        results.add_evaluation(epoch=epoch, iteration=iteration, examples=examples, wall_time=train_time,
                               accuracy=accuracy, loss=test_loss, train_loss=loss_sum / max(seen, 1),
                               epoch_time=epoch_time, images_per_second=seen / epoch_time,
                               test_examples=data.test.size, **more)
        extra = "".join([f"  learner 0 {more['learner_accuracy']:.4f}" if "learner_accuracy" in more else "",
                         f"  distance to z {more['learner_distance']:.3g}" if "learner_distance" in more else "",
                         f"  recomputed-BN accuracy {more['accuracy_bn_recomputed']:.4f}"
                         if "accuracy_bn_recomputed" in more else ""])
        log(f"epoch {epoch:3d}/{epochs}  test accuracy {accuracy:.4f}  test loss {test_loss:.4f}  "
            f"train loss {loss_sum / max(seen, 1):.4f}  time {epoch_time:6.2f}s  "
            f"{seen / epoch_time:8.0f} images/s  lr {schedule(iteration - 1):.4g}{extra}")
        if target_accuracy is not None and stop_at_target and reaches(accuracy, target_accuracy, data.test.size):
            break
        chance_run = chance_run + 1 if epoch > 1 and at_chance(accuracy, data.num_classes) else 0
        if collapse_epochs and chance_run >= collapse_epochs:
            results.extra["collapsed"] = True
            log(f"collapsed: test accuracy at chance ({1 / data.num_classes:.0%}) for {chance_run} epochs "
                f"after the first; stopped at epoch {epoch}")
            break
    if len(step_times) > 1:
        results.extra["first_step_time"] = step_times[0]
        results.extra["trace_time"] = max(step_times[0] - float(np.median(step_times[1:])), 0.0)
    results.extra["iterations_per_epoch"] = per_epoch
    return results
