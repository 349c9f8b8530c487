"""Auto-tuning the number of learners per device, as Crossbow does.

Crossbow starts every device with m = 1 learner and adds one learner per device while the training
throughput (images/s) improves by more than a threshold (10% by default); when it does not, the last
learner is removed and tuning stops. Here the rule is a pure function over a measurement callback
(``choose_learners``), so that it can be tested on synthetic curves, and ``measure_throughput``
is the real measurement: a throw-away Engine with m learners per device, timed on real batches.

    result = autotune_learners(model_factory, loss, algorithm, devices, data.train, batch_size=16)
    strategy = CrossbowStrategy(devices, learners_per_device=result.chosen)
"""
import dataclasses
import gc
import math
import random
import statistics
import sys
import time

import numpy as np

from crossbow_tf.errors import CrossbowError

DEFAULT_THRESHOLD = 0.10
DEFAULT_MAX_LEARNERS = 16
DEFAULT_WARMUP_ITERATIONS = 2
DEFAULT_MEASURE_ITERATIONS = 10

# Gains are ratios of measured floats: without a little slack a gain of exactly the threshold
# (110 after 100 with threshold 0.1) would count as "more than" it or not depending on rounding.
_GAIN_TOLERANCE = 1e-9


class DoesNotFit(CrossbowError):
    """m learners per device do not fit in the device's memory."""


# cuDNN under memory pressure finds no convolution algorithm whose workspace fits, and says so in
# these words (TensorFlow's conv kernels: NotFoundError and UnknownError, not ResourceExhaustedError).
CUDNN_OUT_OF_MEMORY = {"NotFoundError": "No algorithm worked",
                       "UnknownError": "Failed to get convolution algorithm"}


def is_out_of_memory(error):
    """Whether ERROR says that what was tried does not fit in the device's memory: DoesNotFit,
    MemoryError, TensorFlow's ResourceExhaustedError, or cuDNN's two forms of it."""
    if isinstance(error, (DoesNotFit, MemoryError)):
        return True
    tf = sys.modules.get("tensorflow")   # the decision rule itself needs no TensorFlow
    if tf is None or not isinstance(error, tf.errors.OpError):
        return False
    if isinstance(error, tf.errors.ResourceExhaustedError):
        return True
    return any(isinstance(error, getattr(tf.errors, name)) and words in str(error)
               for name, words in CUDNN_OUT_OF_MEMORY.items())


@dataclasses.dataclass
class TuningResult:
    """The tuner's choice and everything it measured on the way."""
    chosen: int
    curve: dict                  # m -> images/s, None where m did not fit in memory
    threshold: float
    max_learners: int
    stopped: str                 # why tuning stopped, in words
    seconds: float = 0.0         # wall time of tuning, tracing included

    def gains(self):
        """m -> relative throughput gain of m over m-1 (measured pairs only)."""
        out = {}
        for m, t in self.curve.items():
            before = self.curve.get(m - 1)
            if t is not None and before:
                out[m] = t / before - 1.0
        return out

    def to_dict(self):
        """JSON-ready record; keys of the curve are strings so that a saved file reads back equal."""
        return {"chosen": self.chosen, "curve": {str(m): t for m, t in sorted(self.curve.items())},
                "threshold": self.threshold, "max_learners_per_device": self.max_learners,
                "stopped": self.stopped, "seconds": self.seconds}

    def summary(self):
        """One readable line: the curve, with each step's gain, and the choice."""
        gains = self.gains()
        points = []
        for m, t in sorted(self.curve.items()):
            if t is None:
                points.append(f"m={m}: out of memory")
            else:
                gain = f" ({gains[m]:+.0%})" if m in gains else ""
                points.append(f"m={m}: {t:.0f}{gain}")
        return (f"auto-tuned learners per device: chose m={self.chosen} ({self.stopped}); "
                f"images/s {', '.join(points)}; threshold {self.threshold:.0%}, {self.seconds:.1f}s")


def choose_learners(throughput_of, threshold=DEFAULT_THRESHOLD, max_learners=DEFAULT_MAX_LEARNERS):
    """Crossbow's rule: the m learners per device at which adding one more stops paying.

    THROUGHPUT_OF(m) returns images/s with m learners per device and is called lazily, in order
    m = 1, 2, ..., never beyond the first m whose gain over m-1 is not more than THRESHOLD (a
    fraction: 0.1 is 10%), nor beyond MAX_LEARNERS. An out-of-memory error from it (DoesNotFit,
    MemoryError, tf.errors.ResourceExhaustedError, cuDNN's "No algorithm worked" and "Failed to get
    convolution algorithm": ``is_out_of_memory``) means m does not fit: m-1 is kept.

    Returns a TuningResult (chosen m, the measured curve, the reason for stopping).
    """
    if not (isinstance(max_learners, int) and max_learners >= 1):
        raise ValueError(f"max_learners must be a positive integer, got {max_learners!r}")
    if not (isinstance(threshold, (int, float)) and threshold >= 0 and math.isfinite(threshold)):
        raise ValueError(f"threshold must be a non-negative number, got {threshold!r}")
    curve = {}
    start = time.perf_counter()

    def result(chosen, stopped):
        return TuningResult(chosen, curve, float(threshold), max_learners, stopped,
                            time.perf_counter() - start)

    try:
        best = _checked(throughput_of(1), 1)
    except Exception as e:   # noqa: BLE001 - only out-of-memory is handled; anything else goes on up
        if not is_out_of_memory(e):
            raise
        # Nothing smaller to fall back to: training itself would fail the same way.
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DoesNotFit(f"one learner per device does not fit in the device's memory ({detail})") from None
    curve[1] = best
    m = 1
    while m < max_learners:
        try:
            t = _checked(throughput_of(m + 1), m + 1)
        except Exception as e:   # noqa: BLE001 - as above
            if not is_out_of_memory(e):
                raise
            curve[m + 1] = None
            return result(m, f"m={m + 1} does not fit in memory")
        curve[m + 1] = t
        if t / best - 1.0 <= threshold + _GAIN_TOLERANCE:
            return result(m, f"m={m + 1} gained {t / best - 1.0:+.1%}, not more than {threshold:.0%}")
        m, best = m + 1, t
    return result(m, f"reached the maximum of {max_learners}")


def _checked(value, m):
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"throughput with m={m} must be a positive number of images/s, got {value!r}")
    return value


def measure_throughput(model, loss, algorithm, devices, split, batch_size, learners_per_device, *,
                       warmup_iterations=DEFAULT_WARMUP_ITERATIONS,
                       measure_iterations=DEFAULT_MEASURE_ITERATIONS, learning_rate=0.01,
                       cross_device_reduction="auto", map_fn=None, seed=0, engine_factory=None, **engine_kwargs):
    """Median images/s of training with LEARNERS_PER_DEVICE learners on each of DEVICES.

    A throw-away Engine trains a fresh copy of MODEL (a built Keras model, cloned with its weights,
    or a function returning a new built model) on real batches of k*b examples of SPLIT. The first
    WARMUP_ITERATIONS (at least 1) absorb tracing and compilation and are not timed; each of the
    next MEASURE_ITERATIONS is timed alone and the median of their images/s is returned, so that a
    few iterations slowed by other work on the machine do not move the result. ENGINE_KWARGS go to
    Engine unchanged (jit_compile=..., and whatever else the caller's real Engine is built with);
    ENGINE_FACTORY, called as Engine is, builds the caller's kind of engine (crossbow_tf.run's: a
    model's own compute_loss or train_step is its objective).

    Raises DoesNotFit when the device runs out of memory.
    """
    import tensorflow as tf

    from crossbow_tf.data.pipeline import train_batches
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine.core import Engine

    if warmup_iterations < 1 or measure_iterations < 1:
        raise ValueError("warmup_iterations and measure_iterations must be at least 1 "
                         "(the first iteration traces the step and must not be timed)")
    strategy = CrossbowStrategy(devices=devices, learners_per_device=learners_per_device,
                                cross_device_reduction=cross_device_reduction)
    global_batch = strategy.num_learners * batch_size
    engine = None
    try:
        engine = (engine_factory or Engine)(_fresh_copy(model), loss, algorithm, strategy, **engine_kwargs)
        batches = _real_batches(train_batches, split, global_batch, warmup_iterations + measure_iterations,
                                seed, map_fn)
        rates = []
        for i, (x, y, mask) in enumerate(batches):
            started = time.perf_counter()
            loss_value, _ = engine.train_step(x, y, mask, learning_rate)
            float(loss_value)   # waits for the step to finish before the clock stops
            if i >= warmup_iterations:
                rates.append(float(np.sum(mask)) / (time.perf_counter() - started))
        return statistics.median(rates)
    except tf.errors.OpError as e:
        if not is_out_of_memory(e):
            raise
        raise DoesNotFit(f"{learners_per_device} learners per device: {str(e).splitlines()[0]}") from None
    finally:
        # The next, larger trial needs the memory this one holds.
        del engine
        gc.collect()


def _fresh_copy(model):
    if callable(model) and not hasattr(model, "get_weights"):
        return model()
    import keras
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


def _real_batches(train_batches, split, global_batch, count, seed, map_fn):
    """COUNT training batches of the first epoch's order, materialised before timing.

    Materialising them keeps the input pipeline's start-up out of the timed iterations. Only the
    first batches of the epoch are read (an ImageNet epoch is not); an epoch shorter than COUNT
    iterations is cycled, without its padded last batch unless that is the only one.
    """
    batches = list(train_batches(split, global_batch, 0, seed=seed, map_fn=map_fn).take(count))
    full = [b for b in batches if float(np.sum(b[2])) == global_batch] or batches[:1]
    return [full[i % len(full)] for i in range(count)]


def autotune_learners(model, loss, algorithm, devices, split, batch_size, *,
                      threshold=DEFAULT_THRESHOLD, max_learners=DEFAULT_MAX_LEARNERS,
                      warmup_iterations=DEFAULT_WARMUP_ITERATIONS,
                      measure_iterations=DEFAULT_MEASURE_ITERATIONS, learning_rate=0.01,
                      cross_device_reduction="auto", map_fn=None, seed=0, **engine_kwargs):
    """Chooses learners per device for MODEL on DEVICES by Crossbow's rule; returns a TuningResult.

    Every trial trains its own copy of MODEL, so MODEL's weights are left alone; the Python and
    NumPy random states are restored afterwards. Keras and TensorFlow random state may advance
    (new layers draw seeds): a caller that needs a reproducible run re-seeds after tuning, as
    crossbow_tf.experiment does.
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        return choose_learners(
            lambda m: measure_throughput(model, loss, algorithm, devices, split, batch_size, m,
                                         warmup_iterations=warmup_iterations,
                                         measure_iterations=measure_iterations,
                                         learning_rate=learning_rate,
                                         cross_device_reduction=cross_device_reduction,
                                         map_fn=map_fn, seed=seed, **engine_kwargs),
            threshold=threshold, max_learners=max_learners)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
