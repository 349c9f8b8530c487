"""python -m baselines.tf_ssgd --config FILE: stock TensorFlow synchronous SGD, as users run it.

``tf.distribute.MirroredStrategy`` over the chosen devices (plain single-device Keras when there is
one), ``model.compile``/``model.fit`` with the stock ``keras.optimizers.SGD(momentum)`` (or the YAML's
``optimizer:``, the Keras optimizer the engine's learners take too); the global
batch is ``batch_size`` per device times the devices. Nothing of crossbow's engine, strategy or
algorithms takes part: this module imports only crossbow_tf.config, .data, .models, .results,
.tensorboard, .cli (quiet TensorFlow start-up) and .errors (config raises it; a NaN loss stops the
run with its TrainingDiverged, exit code 3, as the engine's runs). It reads the same experiment YAML
as ``python -m crossbow_tf.run``; learners_per_device and algorithm.name do not apply (S-SGD has one
replica per device) and algorithm.momentum and .weight_decay go to the stock optimizer.

Options in the YAML's ``tf_ssgd:`` section (all optional):

  lr_scaling: none | linear   linear: the rate is learning_rate.base * global batch / reference_batch
                              (Goyal et al. 2017)
  reference_batch: 256        the global batch learning_rate.base was chosen for
  warmup_from: zero | unscaled
                              zero (default): over learning_rate.warmup_epochs the rate ramps
                              linearly from ~0 to its peak, exactly as in crossbow's engine
                              (StepSchedule); unscaled (needs lr_scaling: linear): Goyal et al.'s
                              gradual warm-up, from learning_rate.base to the scaled peak
  input: repeat | per_epoch   repeat (default): one iterator over all epochs with steps_per_epoch;
                              per_epoch: fit re-iterates the data set every epoch. Both are common
                              idioms, but here per_epoch also restarts the pipelines that give
                              every epoch crossbow's order (about 0.3 s per LeNet epoch on 2 cores,
                              where a plain shuffle().batch() restarts for free), so it is slower
                              than what users get and not the default
  jit_compile: auto           Keras's default (XLA off on CPU-only machines); or true / false

What is the same as crossbow's runs, for a fair comparison: the model and its initial weights (same
seed), every epoch's example order and augmentation (crossbow_tf.data.pipeline.train_batches with
its padding dropped again), the learning-rate schedule (warm-up, step drops), the evaluation after
every epoch on the test split, excluded from the training wall time, and the results format.
"""
import contextlib
import math
import os
import sys
import time

from baselines import _cli
from baselines._cli import parse_tf_ssgd_options
from crossbow_tf import training_hooks
from crossbow_tf.device_choice import choose_devices, device_line, reduction_problem
from crossbow_tf.errors import ConfigError, TrainingDiverged

PROG = "python -m baselines.tf_ssgd"
WORKER_TIMEOUT = 60.0   # seconds a collective may wait for another worker (as crossbow_tf.run's default)
LOST_WORKER = 4         # the exit code of a run that lost a worker (as crossbow_tf.run's)


def select_devices(logical_cpu, log=print):
    """Device names to train on; splits the CPU first when asked (before TensorFlow runs anything).

    As crossbow's runs choose them (crossbow_tf.device_choice): every visible GPU when there is one
    (LOG gets one line if LOGICAL_CPU is given too), else LOGICAL_CPU logical CPU devices, else the CPU.
    """
    import tensorflow as tf

    from crossbow_tf.device_choice import apply_choice, physical_gpus
    choice = choose_devices(physical_gpus(), logical_cpu)
    if choice.note:
        log(choice.note)

    def split(n):
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            if have != n:
                raise ConfigError(f"TensorFlow was already initialised with {have} logical CPU device(s); "
                                  f"{n} were asked for") from None
    return apply_choice(choice, split)


def make_strategy(devices, reduction):
    """MirroredStrategy over DEVICES with REDUCTION's stock cross-device ops; None for one device."""
    import tensorflow as tf
    if len(devices) == 1:
        return None
    problem = reduction_problem(reduction, len(devices))
    if problem:
        raise ConfigError(problem)
    ops = {"auto": None,   # TensorFlow's own choice
           "nccl": tf.distribute.NcclAllReduce,
           "one_device": tf.distribute.ReductionToOneDevice,
           "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce}[reduction]
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=ops() if ops else None)


def _keras_schedule_base():
    # Keras (and TensorFlow under it) load when this module does: quietly, as the commands start
    # TensorFlow, so that a bad argument is still one line.
    from crossbow_tf import cli
    cli.quiet_tensorflow("--verbose" in sys.argv[1:])
    cli.import_tensorflow("--verbose" in sys.argv[1:])
    import keras
    return keras.optimizers.schedules.LearningRateSchedule


class GoyalSchedule(_keras_schedule_base()):
    """lr(t) = PEAK * FACTOR**(drops at or before t); during the first WARMUP iterations it is
    multiplied by START + (1 - START) * (t + 1) / WARMUP.

    START = 0 is crossbow's StepSchedule warm-up (from ~0); Goyal et al.'s gradual warm-up starts
    at the unscaled rate, START = base / PEAK.
    """

    def __init__(self, peak, drops=(), factor=0.1, warmup=0, start=0.0):
        super().__init__()
        self.peak, self.drops, self.factor = float(peak), sorted(int(d) for d in drops), float(factor)
        self.warmup, self.start = int(warmup), float(start)

    def __call__(self, step):
        from keras import ops
        t = ops.cast(step, "float32")
        lr = ops.convert_to_tensor(self.peak, "float32")
        if self.drops:
            passed = ops.sum(ops.cast(ops.greater_equal(t, ops.convert_to_tensor(self.drops, "float32")),
                                      "float32"))
            lr = lr * ops.power(ops.convert_to_tensor(self.factor, "float32"), passed)
        if self.warmup:
            ramp = self.start + (1.0 - self.start) * (t + 1.0) / self.warmup
            lr = lr * ops.where(ops.less(t, float(self.warmup)), ramp, 1.0)
        return lr

    def value(self, t):
        """lr(T) in plain Python (for logs and tests)."""
        lr = self.peak * self.factor ** sum(1 for d in self.drops if t >= d)
        if self.warmup and t < self.warmup:
            lr *= self.start + (1.0 - self.start) * (t + 1) / self.warmup
        return lr

    def get_config(self):
        return dict(peak=self.peak, drops=self.drops, factor=self.factor, warmup=self.warmup, start=self.start)


def make_schedule(cfg, opts, global_batch, per_epoch):
    """The stock-optimizer schedule for CFG: (GoyalSchedule, scale of the base rate)."""
    lr = cfg.learning_rate
    scale = global_batch / opts["reference_batch"] if opts["lr_scaling"] == "linear" else 1.0
    # warmup_from zero: learning_rate.warmup_epochs means what it means in the engine (a ramp from
    # ~0 to the peak); unscaled: Goyal et al.'s gradual warm-up from the unscaled rate.
    start = min(1.0, 1.0 / scale) if opts["warmup_from"] == "unscaled" else 0.0
    return GoyalSchedule(lr.base * scale, [round(e * per_epoch) for e in lr.drops_at_epochs], lr.drop_factor,
                         round(lr.warmup_epochs * per_epoch), start), scale


def stock_optimizer(cfg, schedule):
    """The Keras optimizer CFG's runs use, at SCHEDULE: its ``optimizer:`` (the same one the engine's
    learners take, so a comparison with Adam is like for like), else SGD with algorithm.momentum
    and algorithm.weight_decay."""
    import keras
    from crossbow_tf.config import build_keras_optimizer
    if cfg.optimizer is not None:
        return build_keras_optimizer(cfg.optimizer, schedule)
    return keras.optimizers.SGD(learning_rate=schedule, momentum=cfg.algorithm.momentum,
                                weight_decay=cfg.algorithm.weight_decay or None)


def describe_optimizer(cfg):
    if cfg.optimizer is None:
        return f"SGD(momentum={cfg.algorithm.momentum})"
    arguments = ", ".join(f"{k}={v!r}" for k, v in cfg.optimizer.items() if k != "name")
    return f"{cfg.optimizer['name']}({arguments})"


def _drop_padding(x, y, mask):
    import tensorflow as tf
    keep = mask > 0
    return tf.boolean_mask(x, keep), tf.boolean_mask(y, keep)


def epoch_batches(data, global_batch, epoch, seed):
    """Epoch EPOCH's batches of GLOBAL_BATCH real examples in crossbow's order (last one smaller).

    crossbow_tf.data.pipeline.train_batches fixes each epoch's order and augmentation; its padding
    of the last batch exists for the engine's fixed shapes and is removed here, so Keras sees an
    ordinary ``shuffle().map().batch()`` data set.
    """
    import tensorflow as tf
    from crossbow_tf.data.pipeline import train_batches
    padded = train_batches(data.train, global_batch, epoch, seed=seed, map_fn=data.train_map)
    return padded.map(_drop_padding, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def training_dataset(data, global_batch, epochs, seed, mode):
    """(dataset for fit, a tf.Variable selecting the epoch or None, steps_per_epoch for fit or None)."""
    import tensorflow as tf
    per_epoch = math.ceil(data.train.size / global_batch)
    by_epoch = [epoch_batches(data, global_batch, e, seed) for e in range(1, epochs + 1)]
    if mode == "repeat":
        ds = by_epoch[0]
        for d in by_epoch[1:]:
            ds = ds.concatenate(d)
        return ds.prefetch(tf.data.AUTOTUNE), None, per_epoch
    # One data set that fit iterates afresh each epoch (the stock pattern); which epoch's order it
    # yields is read from EPOCH when the iterator starts, so orders match crossbow's epoch by epoch.
    epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch_order")
    selector = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).repeat().map(lambda _: epoch.read_value())
    ds = tf.data.Dataset.choose_from_datasets(by_epoch, selector, stop_on_empty_dataset=True)
    # A finite data set of known length, as a plain shuffle().batch() would be.
    ds = ds.apply(tf.data.experimental.assert_cardinality(per_epoch))
    return ds.prefetch(tf.data.AUTOTUNE), epoch, None


def _callbacks():
    import keras

    class EpochOrder(keras.callbacks.Callback):
        """Points the per-epoch data set at this epoch's order before fit starts iterating it."""

        def __init__(self, variable):
            super().__init__()
            self.variable = variable

        def on_epoch_begin(self, epoch, logs=None):
            self.variable.assign(epoch)

    class EpochClock(keras.callbacks.Callback):
        """Times every training epoch and evaluates the model after it, outside the timed span.

        Step start times come from on_train_batch_begin: Keras calls it synchronously between
        steps, and unlike on_train_batch_end it neither pulls the step's outputs to the host nor
        turns off Keras's asynchronous callback dispatch, so the measured fit runs as it would
        without us.
        """

        def __init__(self, evaluate, record, diverged=lambda: False):
            super().__init__()
            self.evaluate, self.record, self.diverged = evaluate, record, diverged
            self.train_time, self.step_times, self.stalls = 0.0, [], []
            self.fit_called = self.train_begin = None

        def on_train_begin(self, logs=None):
            self.train_begin = time.perf_counter()

        def on_epoch_begin(self, epoch, logs=None):
            self.starts = []
            self.begin = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            self.starts.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            end = time.perf_counter()
            if self.diverged():   # the epoch did not finish: nothing to record (as the engine's stop)
                return
            epoch_time = end - self.begin
            self.train_time += epoch_time
            if self.starts:
                marks = self.starts + [end]
                self.step_times.extend(b - a for a, b in zip(marks, marks[1:]))
                self.stalls.append(self.starts[0] - self.begin)
            accuracy, loss = self.evaluate()
            if self.record(epoch + 1, epoch_time, self.train_time, accuracy, loss, dict(logs or {})):
                self.model.stop_training = True

    class DivergenceStop(keras.callbacks.Callback):
        """keras.callbacks.TerminateOnNaN, recording where: the first batch whose loss (Keras's running
        mean over the epoch, so it stays non-finite) is NaN or infinite stops fit. Safe for Keras's
        asynchronous dispatch (it only reads the logs Keras already hands to a worker thread), so
        the measured fit keeps running as it would without it."""
        async_safe = True

        def __init__(self, per_epoch):
            super().__init__()
            self.per_epoch, self.epoch, self.found = per_epoch, 0, None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            loss = (logs or {}).get("loss")
            if self.found is None and loss is not None and not math.isfinite(float(loss)):
                self.found = dict(iteration=self.epoch * self.per_epoch + batch + 1, epoch=self.epoch + 1,
                                  position=batch + 1, non_finite=["the loss"])
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):   # also a mean loss that overflowed only at the end
            loss = (logs or {}).get("loss")
            if self.found is None and loss is not None and not math.isfinite(float(loss)):
                self.found = dict(iteration=None, epoch=epoch + 1, position=None, non_finite=["the loss"])
                self.model.stop_training = True

    return EpochOrder, EpochClock, DivergenceStop


def crossbow_modules():
    """The crossbow_tf modules loaded in this process (the proof that no engine code ran)."""
    return sorted(m for m in sys.modules if m == "crossbow_tf" or m.startswith("crossbow_tf."))


def multi_worker_strategy(cfg, timeout=WORKER_TIMEOUT):
    """MultiWorkerMirroredStrategy over the workers TF_CONFIG names (None without TF_CONFIG or with
    one worker). Made first, as TensorFlow requires; its collectives time out after TIMEOUT s, so
    that a lost peer is an error (exit code 4) rather than a wait without end."""
    import json
    import os
    text = os.environ.get("TF_CONFIG", "").strip()
    try:
        cluster = json.loads(text).get("cluster", {}) if text else {}
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"TF_CONFIG is not valid JSON: {e}") from None
    if sum(len(cluster.get(job) or []) for job in ("chief", "worker")) < 2:
        return None
    if cfg.devices.logical_cpu not in (None, 1):
        raise ConfigError(f"devices.logical_cpu {cfg.devices.logical_cpu} on several workers: "
                          "MultiWorkerMirroredStrategy takes each worker's GPUs, or its one CPU")
    import tensorflow as tf
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def train(cfg, opts, log=print):
    """Trains CFG with stock TensorFlow S-SGD; returns RunResults (one evaluation per epoch)."""
    workers = multi_worker_strategy(cfg)   # first: it starts this worker's TensorFlow server
    devices = select_devices(cfg.devices.logical_cpu, log) if workers is None else workers.extended.worker_devices
    from crossbow_tf.config import to_dict
    from crossbow_tf.data import load_dataset
    from crossbow_tf.data.pipeline import eval_batches
    from crossbow_tf.results import RunResults

    if cfg.learners_per_device != 1:
        log(f"note: learners_per_device {cfg.learners_per_device} ignored: S-SGD runs one replica per device")
    if cfg.algorithm.name != "ssgd":
        log(f"note: algorithm.name {cfg.algorithm.name} ignored: this is synchronous SGD")
    data = load_dataset(cfg.data.name, cfg.data.data_dir, path=cfg.data.path)
    strategy = workers or make_strategy(devices, cfg.devices.cross_device_reduction)
    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    chief = workers is None or workers.cluster_resolver.task_id == 0
    global_batch = cfg.batch_size * replicas
    per_epoch = math.ceil(data.train.size / global_batch)
    schedule, scale = make_schedule(cfg, opts, global_batch, per_epoch)

    model, optimizer = compiled_model(cfg, opts, strategy, data, schedule)
    # Several workers: one iterator over all epochs, as fit's own (its per_epoch idiom is fit's).
    train_ds, epoch_variable, steps_per_epoch = training_dataset(data, global_batch, cfg.epochs, cfg.seed,
                                                                 "repeat" if workers else opts["input"])
    test_ds = eval_batches(data.test, cfg.eval_batch_size, data.eval_map)

    log(f"{cfg.name}: {cfg.model} on {data.name} ({data.train.size} train / {data.test.size} test), "
        f"stock TensorFlow S-SGD: {describe_strategy(strategy, workers, devices)}, "
        f"Keras fit + {describe_optimizer(cfg)}, "
        f"batch {cfg.batch_size} per device (global {global_batch}), peak lr {schedule.peak:.4g}"
        f"{f' (linear scaling x{scale:.3g})' if opts['lr_scaling'] == 'linear' else ''}, "
        f"{per_epoch} iterations per epoch, input {opts['input']}"
        f"{'' if cfg.precision == 'float32' else f', precision {cfg.precision} ({type(model.optimizer).__name__})'}"
        f"{', a custom loop (Keras 3 fit does not run under MultiWorkerMirroredStrategy)' if workers else ''}")

    results = RunResults("tf_ssgd", to_dict(cfg), devices=devices, num_learners=replicas,
                         global_batch=global_batch, tf_ssgd_options=opts)
    tensorboard = None
    if workers is not None:
        results.extra["workers"] = workers.extended._num_workers
    if cfg.tensorboard and chief:   # on several workers only the chief writes files
        from crossbow_tf.tensorboard import EvaluationWriter
        tensorboard = EvaluationWriter(cfg.tensorboard)
    # A test_step of the model's own is not the harness's measure: accuracy and loss come from the model's
    # outputs, as the engine's methods evaluate z (crossbow_tf/training_hooks.py, RUN_PATH_HONOURS).
    own_test_step = training_hooks.overrides(type(model), "test_step")

    def evaluate():
        if workers is not None or own_test_step:   # workers: every one alike (the same stop decisions)
            return evaluate_outside_fit(model, test_ds)
        out = model.evaluate(test_ds, verbose=0, return_dict=True)
        return float(out["accuracy"]), float(out["loss"])

    record = Recorder(cfg, data, results, optimizer, schedule, tensorboard, log)
    EpochOrder, EpochClock, DivergenceStop = _callbacks()
    divergence = DivergenceStop(per_epoch)
    # The divergence check runs before the clock at each epoch's end, so that a diverged epoch is
    # neither evaluated nor recorded.
    clock = record.clock = EpochClock(evaluate, record, diverged=lambda: divergence.found is not None)
    callbacks = ([EpochOrder(epoch_variable)] if epoch_variable is not None else []) + [divergence, clock]
    start = time.perf_counter()
    if workers is not None:
        fit_on_workers(model, workers, train_ds, cfg.epochs, steps_per_epoch, callbacks)
    else:
        model.fit(train_ds, epochs=cfg.epochs, steps_per_epoch=steps_per_epoch, verbose=0, callbacks=callbacks)
    results.extra["total_time"] = time.perf_counter() - start
    if tensorboard is not None:
        tensorboard.close()
    if divergence.found is not None:
        raise _diverged(results, divergence.found, per_epoch)
    results.extra["fit_setup_time"] = clock.train_begin - start if clock.train_begin else None
    _add_extras(results, model, optimizer, strategy, clock.step_times, per_epoch)
    results.extra["chief"] = chief
    if workers is not None and results.evaluations:
        results.extra["cross_worker"] = gradient_traffic(model, results.extra["workers"], results.evaluations[-1])
    if cfg.target_accuracy is not None:
        log(results.target_summary(cfg.target_accuracy))
    return results


def compiled_model(cfg, opts, strategy, data, schedule):
    """(model, its stock optimizer) built and compiled in STRATEGY's scope, as a Keras user does."""
    import keras

    from crossbow_tf.models import build_model
    keras.utils.set_random_seed(cfg.seed)   # as crossbow's runs: same seed, same initial weights and orders
    # As a Keras user sets it before building the model; under mixed_float16 compile wraps the
    # optimizer in Keras's LossScaleOptimizer (dynamic loss scaling), as it does for every user.
    keras.mixed_precision.set_global_policy(cfg.precision)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build_model(cfg.model, data.input_shape, data.num_classes)
        optimizer = stock_optimizer(cfg, schedule)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                      jit_compile=opts["jit_compile"])
    return model, optimizer


def describe_strategy(strategy, workers, devices):
    """The start line's words for how the run is distributed."""
    if workers is not None:
        return (f"MultiWorkerMirroredStrategy over {workers.extended._num_workers} workers x "
                f"{len(devices)} device(s) ({device_line(devices, 'collective ring')})")
    if strategy is None:
        return f"one device, no strategy ({device_line(devices)}: {devices[0]})"
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return (f"MirroredStrategy over {strategy.num_replicas_in_sync} devices "
            f"({device_line(devices, type(ops).__name__ if ops else 'default reduction')})")


class Recorder:
    """Records an epoch's evaluation (EpochClock calls it): the results, TensorBoard, the log line;
    returns True when the run should stop (target reached, or collapsed at chance)."""

    def __init__(self, cfg, data, results, optimizer, schedule, tensorboard, log):
        self.cfg, self.data, self.results, self.optimizer = cfg, data, results, optimizer
        self.schedule, self.tensorboard, self.log = schedule, tensorboard, log
        self.examples, self.at_chance, self.clock = 0, 0, None

    def __call__(self, epoch, epoch_time, train_time, accuracy, loss, logs):
        from crossbow_tf.results import at_chance, reaches
        cfg, data, log = self.cfg, self.data, self.log
        # Keras feeds every example once per epoch (the last batch is smaller, never padded).
        self.examples += data.train.size
        iteration = int(self.optimizer.iterations.numpy())
        train_loss = float(logs.get("loss", float("nan")))
        stalls = self.clock.stalls
        self.results.add_evaluation(epoch=epoch, iteration=iteration, examples=self.examples, wall_time=train_time,
                                    accuracy=accuracy, loss=loss, train_loss=train_loss, epoch_time=epoch_time,
                                    images_per_second=data.train.size / epoch_time,
                                    epoch_start_time=stalls[-1] if stalls else None, test_examples=data.test.size)
        if self.tensorboard is not None:
            self.tensorboard(self.results.evaluations[-1], self.schedule.value(iteration - 1))
        log(f"epoch {epoch:3d}/{cfg.epochs}  test accuracy {accuracy:.4f}  test loss {loss:.4f}  "
            f"train loss {train_loss:.4f}  time {epoch_time:6.2f}s  "
            f"{data.train.size / epoch_time:8.0f} images/s  lr {self.schedule.value(iteration - 1):.4g}")
        self.at_chance = self.at_chance + 1 if epoch > 1 and at_chance(accuracy, data.num_classes) else 0
        if cfg.collapse_epochs and self.at_chance >= cfg.collapse_epochs:
            self.results.extra["collapsed"] = True
            log(f"collapsed: test accuracy at chance ({1 / data.num_classes:.0%}) for {self.at_chance} epochs "
                f"after the first; stopped at epoch {epoch}")
            return True
        return (cfg.target_accuracy is not None and cfg.stop_at_target
                and reaches(accuracy, cfg.target_accuracy, data.test.size))


def _add_extras(results, model, optimizer, strategy, steps, per_epoch):
    """What a finished run's results say beyond its evaluations: first step and tracing, the classes
    that trained (the proof that this is stock Keras), the crossbow modules loaded."""
    import numpy as np
    if len(steps) > 1:
        results.extra["first_step_time"] = steps[0]
        results.extra["trace_time"] = max(steps[0] - float(np.median(steps[1:])), 0.0)
    results.extra["iterations_per_epoch"] = per_epoch
    results.extra["strategy"] = type(strategy).__name__ if strategy is not None else None
    results.extra["train_step"] = f"{type(model).train_step.__module__}.{type(model).train_step.__qualname__}"
    results.extra["optimizer"] = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    results.extra["compiled_optimizer"] = f"{type(model.optimizer).__module__}.{type(model.optimizer).__qualname__}"
    results.extra["crossbow_modules"] = crossbow_modules()


def distributed_step(model, strategy):
    """One S-SGD iteration under STRATEGY, as TensorFlow's custom-loop guide writes it: each replica's
    loss averaged over the global batch, its gradients applied by the stock optimizer (which sums
    them over the replicas); returns the iteration's loss."""
    import tensorflow as tf

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = _per_example_loss(y, logits)
            loss = tf.nn.compute_average_loss(per_example)
            if model.losses:   # regularisation, once per replica's share, as fit adds it
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            scaled = model.optimizer.scale_loss(loss) if hasattr(model.optimizer, "scale_loss") else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(batch):
        x, y = batch
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(x, y)), axis=None)
    return step


def _per_example_loss(y, logits):
    import keras
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def fit_on_workers(model, strategy, train_ds, epochs, steps_per_epoch, callbacks):
    """What model.fit does with CALLBACKS, in a custom loop under STRATEGY (Keras 3's fit does not
    run under MultiWorkerMirroredStrategy, keras-team/keras#20585). A collective that times out
    (a lost worker) stops this worker with one line, exit code 4."""
    import keras
    import tensorflow as tf
    step = distributed_step(model, strategy)
    hooks = keras.callbacks.CallbackList(callbacks, model=model)
    model.stop_training = False
    iterator = iter(strategy.experimental_distribute_dataset(train_ds))
    try:
        hooks.on_train_begin()
        for epoch in range(epochs):
            hooks.on_epoch_begin(epoch)
            total = 0.0
            for batch in range(steps_per_epoch):
                hooks.on_train_batch_begin(batch)
                total += float(step(next(iterator)))
                hooks.on_train_batch_end(batch, {"loss": total / (batch + 1)})
                if model.stop_training:
                    break
            hooks.on_epoch_end(epoch, {"loss": total / (batch + 1)})
            if model.stop_training:
                break
        hooks.on_train_end()
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError, tf.errors.CancelledError,
            tf.errors.AbortedError, tf.errors.InternalError) as e:
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        print(f"{PROG}: error: lost a worker (a collective failed: {reason[:200]})", file=sys.stderr, flush=True)
        os._exit(LOST_WORKER)   # TensorFlow's collective threads may still wait: no interpreter shutdown


def evaluate_outside_fit(model, test_ds):
    """(accuracy, mean loss) of MODEL on TEST_DS, computed here (Keras's evaluate is fit's sibling)."""
    import numpy as np
    own_loss = training_hooks.overrides(type(model), "compute_loss")   # the test loss, as in Keras's test_step
    correct = total = loss = 0.0
    for x, y in test_ds:
        logits = model(x, training=False)
        if own_loss:
            loss += float(model._compute_loss(x=x, y=y, y_pred=logits, training=False)) * len(y)
        y = np.asarray(y)
        correct += float(np.sum(np.argmax(np.asarray(logits), -1) == y))
        if not own_loss:
            loss += float(np.sum(np.asarray(_per_example_loss(y, logits))))
        total += len(y)
    return correct / total, loss / total


def gradient_traffic(model, workers, last):
    """The per-iteration figures a multi-worker run records (the keys of the engine's runs,
    crossbow_tf.distribute.traffic.summary) up to evaluation LAST: MultiWorkerMirroredStrategy
    all-reduces the float32 gradients once per iteration, 2(n-1)/n x their bytes per worker in a
    ring; the time its collectives wait is inside TensorFlow, not measured here (None)."""
    import numpy as np
    payload = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    iterations = max(last["iteration"], 1)
    sent = last["iteration"] * 2 * (workers - 1) / workers * payload
    return dict(workers=workers, iterations=last["iteration"], all_reduces=last["iteration"], payload_bytes=payload,
                bytes_sent_per_worker=sent, bytes_per_iteration=sent / iterations,
                step_ms_per_iteration=1000 * last["wall_time"] / iterations,
                collective_ms_per_iteration=None, compute_ms_per_iteration=None)


def _diverged(results, found, per_epoch):
    """TrainingDiverged (exit code 3) for a stock run whose loss went non-finite where FOUND says;
    RESULTS, with the epochs before and ``diverged``, go with it to be written."""
    results.extra["diverged"] = dict(iteration=found["iteration"], epoch=found["epoch"],
                                     non_finite=found["non_finite"])
    where = (f"at iteration {found['iteration']} (epoch {found['epoch']}, iteration {found['position']} of "
             f"{per_epoch})" if found["iteration"] is not None else f"in epoch {found['epoch']}")
    error = TrainingDiverged(f"diverged: not finite {where}: {', '.join(found['non_finite'])}")
    error.results = results
    return error


def _print(line):
    print(line, flush=True)   # a harness reads the lines as they come


def run(args, log=_print):
    cfg, sections = _cli.build(args)
    opts = parse_tf_ssgd_options(sections["tf_ssgd"])
    results = train(cfg, opts, log=log)
    if not results.extra.pop("chief", True):
        args.results = None   # on several workers only the chief writes the results
    return results


def main(argv=None):
    return _cli.main(PROG, __doc__.splitlines()[0], run, argv)


if __name__ == "__main__":
    sys.exit(main())
