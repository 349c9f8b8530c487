"""The epoch loop: feed iterations to the engine, evaluate z, record results."""
import time

import numpy as np
import tensorflow as tf

from crossbow_tf.data.pipeline import eval_batches, iterations_per_epoch, train_batches
from crossbow_tf.engine.replicated import per_example_loss_fn
from crossbow_tf.engine.schedule import is_drop


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


def train(engine, data, batch_size, epochs, schedule, results, *, seed=0, target_accuracy=None,
          stop_at_target=True, eval_batch_size=500, shuffle=True, log=print):
    """Trains ENGINE on DATA (a DataSource) and evaluates z after every epoch.

    Returns RESULTS with one evaluation per epoch; wall time counts training only.
    """
    k = engine.num_learners
    global_batch = k * batch_size
    per_epoch = iterations_per_epoch(data.train.size, global_batch)
    evaluator = Evaluator(engine.model, engine.learners.per_example_loss)
    if engine.strategy.cluster is not None:
        # Once per epoch on the chief; the other workers receive its figures (same z on every worker).
        evaluator = engine.strategy.cluster.on_chief(evaluator, num_values=2)
    iteration, examples, train_time = 0, 0, 0.0
    step_times = []
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
        engine.write_center_to_model()
        accuracy, test_loss = evaluator(data.test, eval_batch_size, data.eval_map)
        results.add_evaluation(epoch=epoch, iteration=iteration, examples=examples, wall_time=train_time,
                               accuracy=accuracy, loss=test_loss, train_loss=loss_sum / max(seen, 1),
                               epoch_time=epoch_time, images_per_second=seen / epoch_time)
        log(f"epoch {epoch:3d}/{epochs}  test accuracy {accuracy:.4f}  test loss {test_loss:.4f}  "
            f"train loss {loss_sum / max(seen, 1):.4f}  time {epoch_time:6.2f}s  "
            f"{seen / epoch_time:8.0f} images/s  lr {schedule(iteration - 1):.4g}")
        if target_accuracy is not None and stop_at_target and accuracy >= target_accuracy:
            break
    if len(step_times) > 1:
        results.extra["first_step_time"] = step_times[0]
        results.extra["trace_time"] = max(step_times[0] - float(np.median(step_times[1:])), 0.0)
    results.extra["iterations_per_epoch"] = per_epoch
    return results
