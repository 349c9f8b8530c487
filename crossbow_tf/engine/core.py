"""The compiled training step: k = D x m learners, their update rule and the synchronisation."""
import math
import numbers
import sys

import keras
import numpy as np
import tensorflow as tf

from crossbow_tf import policy
from crossbow_tf.algorithms import Rule, noise_matching
from crossbow_tf.distribute.cross_worker import CrossWorkerReduction
from crossbow_tf.distribute.reduce import all_reduce_sum
from crossbow_tf.engine.fused import make_learners
from crossbow_tf.engine.optimizers import (StackedOptimizers, check_learner_optimizer, check_noise_matching,
                                         second_moment_decay)
from crossbow_tf.engine.state import EngineState, SyncPayload, WorkerPayload


def _groups_by_layer(variables):
    """Indices of VARIABLES grouped by the layer that owns them, in order."""
    groups, last = [], None
    for i, variable in enumerate(variables):
        owner = variable.path.rsplit("/", 1)[0]
        if owner != last:
            groups.append([])
            last = owner
        groups[-1].append(i)
    return groups


# Groups are at least this large and at most MAX_UPDATE_GROUPS: every group is one more XLA compile at
# start-up (ResNet-32 with 13 groups of >= 1 MB: 0.8 s more for its first iteration, no faster after).
MIN_GROUP_BYTES = 1 << 20
MAX_UPDATE_GROUPS = 4


def _update_groups(variables, learners):
    """Indices of VARIABLES in groups of whole consecutive layers, formed from the output side (the
    order in which backpropagation finishes their gradients), each but the first holding at least
    MIN_GROUP_BYTES and 1/MAX_UPDATE_GROUPS of the LEARNERS' copies."""
    layers = _groups_by_layer(variables)
    sizes = [sum(learners * int(np.prod(variables[i].shape)) * np.dtype(variables[i].dtype).itemsize
                 for i in layer) for layer in layers]
    threshold = max(MIN_GROUP_BYTES, sum(sizes) / MAX_UPDATE_GROUPS)
    groups, group, size = [], [], 0
    for layer, layer_size in zip(reversed(layers), reversed(sizes)):
        group = layer + group
        size += layer_size
        if size >= threshold:
            groups.insert(0, group)
            group, size = [], 0
    return [group] + groups if group else groups


def _checked_learning_rate(lr):
    """LR as a float (None for a symbolic tensor); raises for anything but a finite number >= 0."""
    if isinstance(lr, (tf.Tensor, tf.Variable)) and not tf.executing_eagerly():
        return None
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise TypeError(f"Engine.train_step: lr must be a number, got {lr!r}") from None
    if isinstance(lr, bool) or not (isinstance(lr, numbers.Real) or hasattr(lr, "dtype")):
        raise TypeError(f"Engine.train_step: lr must be a number, got {lr!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"Engine.train_step: lr must be a finite number >= 0, got {value}")
    return value


# What XLA raises when it cannot compile (its message names XLA, ptxas or libdevice, or an op it
# has no kernel for).
XLA_ERRORS = (tf.errors.InternalError, tf.errors.InvalidArgumentError, tf.errors.UnimplementedError,
              tf.errors.NotFoundError, tf.errors.UnknownError)
_XLA_WORDS = ("xla", "ptxas", "libdevice", "jit_compile", "must-compile", "unsupported operations")


def _is_xla_failure(error):
    text = str(error).lower()
    return any(word in text for word in _XLA_WORDS)


def _host_of(device):
    """The CPU of DEVICE's machine (its job and task kept): where the global batch is cut."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def _is_float(variable):
    return tf.as_dtype(variable.dtype).is_floating


def _chief_start(strategy, trainable, states):
    """The chief's initial weights and state on every worker, after checking that every worker
    builds the same step (the same devices x learners and weights)."""
    cluster = strategy.cluster
    layout = np.array([strategy.num_devices, strategy.learners_per_device, len(trainable), len(states),
                       sum(w.size for w in trainable)], np.int64)
    chief_layout = cluster.broadcast_from_chief([layout])[0]
    if not np.array_equal(layout, chief_layout):
        from crossbow_tf.distribute.cluster import ClusterError
        raise ClusterError(f"{cluster.describe(cluster.worker_index)} has {strategy.num_devices} device(s) x "
                           f"{strategy.learners_per_device} learners and {len(trainable)} weights; the chief has "
                           f"{chief_layout[0]} x {chief_layout[1]} and {chief_layout[2]}: every worker must "
                           "build the same model on the same number of devices")
    arrays = cluster.broadcast_from_chief(trainable + states)
    return arrays[:len(trainable)], arrays[len(trainable):]


def _check_optimizer_with_rule(optimizer, algorithm):
    """Refuses a Keras OPTIMIZER for the learners together with the rule's own step options."""
    check_learner_optimizer(optimizer)
    if getattr(algorithm, "weight_decay", 0):
        raise ValueError(f"Engine: with a Keras optimizer the learners take its step, not the rule's: give "
                         f"{type(optimizer).__name__} its own weight_decay instead of the rule's "
                         f"weight_decay={algorithm.weight_decay}")
    if getattr(algorithm, "momentum", 0):
        raise ValueError(f"Engine: with a Keras optimizer the learners take its step, not the rule's momentum "
                         f"step: give {type(algorithm).__name__} momentum=0.0 (the rule's "
                         f"momentum={algorithm.momentum} would be unused; {type(optimizer).__name__}'s own "
                         "momentum options apply)")
    if not algorithm.follows_keras_optimizer:
        raise ValueError(f"Engine: {type(algorithm).__name__} has no correct() to follow a Keras "
                         "optimizer's step")


def _check_loss_scale_options(initial_scale, dynamic_growth_steps, strategy, algorithm):
    if not (isinstance(initial_scale, numbers.Real) and math.isfinite(initial_scale)
            and initial_scale >= np.finfo(np.float32).tiny):
        raise ValueError(f"Engine: initial_scale must be a finite positive number, got {initial_scale!r}")
    if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, numbers.Integral) \
            or dynamic_growth_steps < 1:
        raise ValueError(f"Engine: dynamic_growth_steps must be an integer >= 1, got {dynamic_growth_steps!r}")
    refused = policy.precision_refused("mixed_float16", strategy.num_workers, algorithm)
    if refused:
        from crossbow_tf.errors import ConfigError
        raise ConfigError(f"loss scaling: {refused}")


class _Held:
    """The learners' new values of a step whose assignment waits for a flag (``assign``), and the old
    values of variables already assigned, to put back should the flag say no (``restore``)."""

    def __init__(self):
        self._new, self._old = [], []

    def hold(self, variables, values):
        self._new.extend(zip(variables, values, strict=True))

    def keep(self, variables):
        self._old.extend((v, v.read_value()) for v in variables)

    def assign(self):
        for variable, value in self._new:
            variable.assign(value)

    def restore(self):
        for variable, value in self._old:
            variable.assign(value)
        return tf.constant(False)


class Engine:
    """Trains the learners of MODEL with ALGORITHM, placed by STRATEGY.

    Per device d it keeps one variable per model weight with a leading axis of m learners (their
    weights, velocities and non-trainable state), and its own copy of the central model z and its
    velocity u, all in ``self.state`` (crossbow_tf.engine.state.EngineState), which is what
    checkpoints, the Keras path and the diagnostics use. MODEL itself is left alone until
    ``write_center_to_model`` copies z into it.
    """

    def __init__(self, model, loss, algorithm, strategy, jit_compile=False, learners="auto", jit_update=True,
                 reset_on_lr_drop=True, optimizer=None, loss_scale=False, initial_scale=2.0 ** 15,
                 dynamic_growth_steps=2000, noise_matching=False):
        """RESET_ON_LR_DROP: ``train_step`` restarts every learner from z when its learning rate is
        lower than the previous call's (Crossbow's rule for step schedules; SMA only). Pass False
        for a smoothly decaying rate, which falls at every step, and call ``reset_learners()`` at
        your own step boundaries.

        OPTIMIZER: a Keras optimizer (elementwise: Adam, AdamW, RMSprop, Nesterov SGD, ...) whose own
        step the learners take, each with its own state, instead of the rule's momentum step (the
        rule's correction follows it; for S-SGD it is z's optimizer). Its learning rate is
        ``train_step``'s. None (default): the rule's own fused momentum SGD.

        LOSS_SCALE: dynamic loss scaling for float16, as Keras's LossScaleOptimizer: every learner's
        loss is multiplied by one shared scale (INITIAL_SCALE first) and its float32 gradients divided
        by it; an iteration in which any gradient of any learner is not finite is skipped by every
        learner and z alike (nothing changes) and halves the scale, and DYNAMIC_GROWTH_STEPS good
        iterations in a row double it. Off (default): no scaling op in the step at all.

        NOISE_MATCHING (an adaptive OPTIMIZER under an averaging rule that synchronises every
        iteration): z and every learner move on by (f - 1) times the learners' mean step, f =
        sqrt(E[g_b^2] / E[g_B^2]) per coordinate estimated from the learners' gradients
        (crossbow_tf.algorithms.noise_matching), so that z advances one step of the optimizer at the
        global batch B. The steps and statistics travel in the iteration's one all-reduce (four
        times the bytes of the corrections alone)."""
        self._check_arguments(model, algorithm, strategy, learners, reset_on_lr_drop, optimizer, noise_matching,
                              jit_compile)
        if not isinstance(loss_scale, bool):
            raise TypeError(f"Engine: loss_scale must be True or False, got {loss_scale!r}")
        if loss_scale:
            _check_loss_scale_options(initial_scale, dynamic_growth_steps, strategy, algorithm)
        self.model = model
        self.strategy = strategy
        self._host = _host_of(strategy.devices[0])
        self.algorithm = algorithm.for_learners(strategy.num_learners)
        self.reset_on_lr_drop = reset_on_lr_drop and self.algorithm.reset_on_lr_drop
        self._previous_lr = None          # the learning rate of the last train_step
        self._learners_at_center = True   # no step since the learners were last set to z
        # learners: "auto" (fused when every layer allows it), "fused" or "replicated": how the
        # learner computation (every learner's forward and backward pass) runs.
        self.learner_computation = make_learners(model, loss, learners)
        self.state = self._make_state(optimizer, noise_matching)
        # Noise matching's running means decay as the optimizer's second moment does.
        self.noise_decay = second_moment_decay(optimizer) if noise_matching else None
        # The learners' update touches every learner's copy of every weight several times and is
        # memory-bound; compiling it with XLA fuses those passes (tools/ab_step.py, LeNet with 8
        # learners: 24.6 instead of 29.3 ms per iteration). The central update touches one copy: compiling
        # it cost 0.13 s at start-up and saved nothing per iteration (LeNet, 8 learners), so it is not.
        # The rest of the step stays un-jitted unless JIT_COMPILE asks: XLA is slower for the
        # convolutions on CPU. No AutoGraph: the step has no tensor-dependent Python control flow,
        # and converting it took 1.2 of its 1.4 s of tracing.
        # One XLA launch per group of layers rather than one for all weights: a group's update starts
        # as soon as its gradients exist and overlaps backpropagation through the layers below
        # (tools/ab_step.py, LeNet with 8 learners: 25.8 -> 24.6 ms per iteration).
        self._update_groups = _update_groups(model.trainable_variables, strategy.learners_per_device)
        self._central_update = tf.function(self._central_update_fn, autograph=False)
        self._build_steps(jit_compile, jit_update)
        self.iteration = 0                # the next train_step's iteration, unless it is given one
        self.iterations_per_epoch = None  # for rules whose period changes after some epochs
        self._reset = tf.function(self.state.restart_from_center, autograph=False)
        self._make_flags()
        if loss_scale:
            self.dynamic_growth_steps = int(dynamic_growth_steps)
            self.state.add_loss_scale(initial_scale)

    @staticmethod
    def _check_arguments(model, algorithm, strategy, learners, reset_on_lr_drop, optimizer, noise_matching,
                         jit_compile):
        from crossbow_tf.distribute.strategy import CrossbowStrategy
        if not isinstance(model, keras.Model):
            raise TypeError(f"Engine: model must be a keras.Model, got {type(model).__name__}")
        if not isinstance(strategy, CrossbowStrategy):
            raise TypeError(f"Engine: strategy must be a crossbow_tf.CrossbowStrategy, got {type(strategy).__name__}")
        if not isinstance(algorithm, Rule):
            raise TypeError(f"Engine: algorithm must be an update rule such as crossbow_tf.algorithms.SMA(), "
                            f"got {algorithm!r}")
        if learners not in ("auto", "fused", "replicated"):
            raise ValueError(f"Engine: learners must be \"auto\", \"fused\" or \"replicated\", got {learners!r}")
        if not isinstance(reset_on_lr_drop, bool):
            raise TypeError(f"Engine: reset_on_lr_drop must be True or False, got {reset_on_lr_drop!r}")
        if not model.built:
            raise ValueError(f"model {model.name!r} is not built: give it an Input or call build() first")
        if optimizer is not None:
            _check_optimizer_with_rule(optimizer, algorithm)
        if not isinstance(noise_matching, bool):
            raise TypeError(f"Engine: noise_matching must be True or False, got {noise_matching!r}")
        if noise_matching:
            check_noise_matching(optimizer, algorithm)
        if jit_compile and strategy.reduction_name == "nccl":
            from crossbow_tf.errors import ConfigError
            raise ConfigError("jit_compile: the NCCL all-reduce has no XLA kernel (TensorFlow issue 48502): set "
                              "jit_compile false (jit_update still compiles the learners' update with XLA)")

    def _make_state(self, optimizer, noise_matching):
        """The engine's variables, every learner and z starting from the model's weights (across
        workers, the chief's), and the learners' (or, for S-SGD, z's) Keras optimizer, one clone per
        device on its stacks."""
        model, strategy = self.model, self.strategy
        trainable = [np.asarray(v.numpy()) for v in model.trainable_variables]
        states = [np.asarray(v.numpy()) for v in model.non_trainable_variables]
        # Across workers: one all-reduce per iteration, and every worker starts from the chief's z.
        self._cross_worker = None
        if strategy.cluster is not None:
            trainable, states = _chief_start(strategy, trainable, states)
            self._cross_worker = CrossWorkerReduction(strategy.cluster, strategy.devices[0])
        keeps_learners = not self.algorithm.gradient_at_center
        state = EngineState(
            strategy.devices, trainable, states, [_is_float(v) for v in model.non_trainable_variables],
            strategy.learners_per_device, strategy.first_learner, keeps_learners=keeps_learners,
            # Without learner momentum the velocities would only be written, never read: not kept.
            keeps_velocity=self.algorithm.keeps_learner_velocity and optimizer is None,
            noise_matching=noise_matching)
        if optimizer is not None:
            stacks = state.per_device("weights" if keeps_learners else "center")
            state.attach_optimizers(StackedOptimizers(optimizer, stacks, strategy.devices, model.trainable_variables,
                                                      stacked=keeps_learners))
        return state

    def _make_flags(self):
        """The step's flags, on the first device."""
        with tf.device(self.strategy.devices[0]):
            # Whether the last step's loss and z were finite: written by every step, read only when the
            # loss it returned says something was not.
            self._finite = tf.Variable(tf.ones([2], tf.bool), trainable=False, name="finite")
            if self._cross_worker is not None:
                self._stop_vote = tf.Variable(0.0, trainable=False, name="stop_vote")
                self._stop_votes = tf.Variable(0.0, trainable=False, name="stop_votes")
                # A non-finite loss in a local step waits for the next synchronisation, so that
                # every worker learns of it in the same iteration.
                self._pending_non_finite = tf.Variable(0.0, trainable=False, name="pending_non_finite")

    # The engine's variables, read through its state (see crossbow_tf.engine.state).
    center = property(lambda self: self.state.per_device("center"), doc="z, per device")
    center_velocity = property(lambda self: self.state.per_device("center_velocity"), doc="u, per device")
    center_states = property(lambda self: self.state.per_device("center_states"), doc="z's state, per device")
    weights = property(lambda self: self.state.per_device("weights"),
                       doc="the learners' weight stacks, per device (none for a rule at z)")
    velocities = property(lambda self: self.state.per_device("velocities"), doc="the learners' velocity stacks")
    states = property(lambda self: self.state.per_device("states"), doc="the learners' state stacks, per device")
    learner_square = property(lambda self: self.state.per_device("learner_square"))
    global_square = property(lambda self: self.state.per_device("global_square"))
    optimizers = property(lambda self: self.state.optimizers, doc="the learners' StackedOptimizers, or None")
    loss_scale = property(lambda self: self.state.loss_scale, doc="the dynamic loss scale, or None")
    good_steps = property(lambda self: self.state.good_steps)
    _float_state = property(lambda self: self.state.float_state)

    def _build_steps(self, jit_compile, jit_update):
        """The compiled step functions, the learners' updates with XLA when JIT_UPDATE."""
        self.jit_compile, self.jit_update = jit_compile, jit_update
        self._xla_checked = not (jit_compile or jit_update)
        self._local_update = tf.function(self._local_update_fn, jit_compile=jit_update, autograph=False)
        self._step = tf.function(self._step_fn, jit_compile=jit_compile, autograph=False)
        # The iterations between two synchronisations run a step of their own: the learners' own
        # updates, with no collective in its graph at all.
        self._own_update = tf.function(self._own_update_fn, jit_compile=jit_update, autograph=False)
        self._local_step = tf.function(self._local_step_fn, jit_compile=jit_compile, autograph=False)
        if self.optimizers is not None:
            # As the rule's update: memory-bound, so XLA fuses the optimizer's passes over the stacks
            # (tools/bench_learner_optimizers.py, LeNet with 2 devices x 4 learners of 16, Adam: 49.8
            # instead of 67.5 ms per iteration; the rule's fused momentum SGD 44.6).
            self._optimizer_apply = tf.function(self.optimizers.apply, jit_compile=jit_update, autograph=False)
            self._optimizer_update = tf.function(self._optimizer_update_fn, jit_compile=jit_update,
                                                 autograph=False)
            self._noise_update = tf.function(self._noise_update_fn, jit_compile=jit_update, autograph=False)

    def _first_step(self, step, args):
        """STEP(*ARGS) of the engine's first iteration: where XLA cannot compile here (on a GPU without
        ptxas or libdevice, or an op without an XLA kernel) the step runs again without XLA, said in
        one line. XLA fails as it compiles, at the first launch, before the update it would have run
        assigns anything (the jitted updates return their values; the callers assign them)."""
        try:
            result = step(*args)
        except XLA_ERRORS as e:
            synchronising = step is self._step
            if not self.fall_back_without_xla(e):
                raise
            step = self._step if synchronising else self._local_step
            result = step(*args)
        self._xla_checked = True
        return result

    @property
    def xla_checked(self):
        """Whether a step has run with the engine's XLA settings (or none asks for XLA)."""
        return self._xla_checked

    def confirm_xla(self):
        """Records that a step has run with the engine's XLA settings (Keras's fit runs the steps)."""
        self._xla_checked = True

    def fall_back_without_xla(self, error, note=""):
        """After ERROR, raised by the first step: when it is XLA's failure to compile, rebuilds the
        steps without XLA, says so in one line (with NOTE) and returns True; else False."""
        if not _is_xla_failure(error):
            return False
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"note: XLA failed on the first step ({message[:200]}); training without XLA "
              f"(jit_update and jit_compile off){note}", file=sys.stderr, flush=True)
        self._build_steps(False, False)
        self._xla_checked = True
        return True

    @property
    def num_learners(self):
        return self.strategy.num_learners

    def synchronises(self, iteration):
        """Whether ITERATION (counted from 0 in the run) is a synchronising one for the rule."""
        return self.algorithm.synchronises(iteration, self.iterations_per_epoch)

    def step_at(self, iteration, x, y, mask, lr, total_count=None):
        """The compiled step of ITERATION, a tensor (inside a tf.function such as Keras's train
        function): the synchronising step, or for a rule with a period H > 1 a tf.cond between it and
        the local step, on (ITERATION + 1) % H == 0. Only the branch taken runs, so a local iteration
        runs no collective."""
        period = self.algorithm.sync_period
        if period == 1:
            return self._step(x, y, mask, lr, total_count)
        # fit refuses post-local SGD, the one rule whose choice needs the epoch length.
        synchronises = self.algorithm.synchronises(tf.cast(iteration, tf.int64))
        return tf.cond(synchronises, lambda: self._step(x, y, mask, lr, total_count),
                       lambda: self._local_step(x, y, mask, lr, total_count))

    def train_step(self, x, y, mask, lr, total_count=None, iteration=None):
        """One iteration on a global batch of k*b examples cut into k consecutive slices of b.

        X and Y have k*b rows (NumPy arrays or tensors; float64 features are cast to float32); MASK
        (k*b values, or None for all real) marks real (1.0) and padding (0.0) examples; LR is this
        iteration's learning rate. When LR is lower than the previous call's and the engine resets on
        drops (see __init__), every learner restarts from z first. Returns (mean loss over real
        examples, predictions of every learner of this worker on its slice, in example order). The
        loss is NaN when the loss or z is not finite; ``non_finite`` says what. A learner whose
        weights the step made non-finite gives a non-finite loss at its next step (``non_finite``
        checks them directly). On several workers every worker is given the same global batch and
        trains its learners' slices (``local_rows``), or, with TOTAL_COUNT (the iteration's real
        examples on all workers), only those rows: X, Y and MASK then have D*m*b rows.

        ITERATION (from 0 in the run; default: the engine's own count of calls) decides whether the
        step synchronises (``algorithm.synchronises``); an iteration that does not runs the learners'
        own steps only (no correction, z unchanged, no cross-device or cross-worker reduction).
        """
        x, y, mask = self._checked_batch(x, y, mask, local=total_count is not None)
        lr_value = _checked_learning_rate(lr)
        if (self.reset_on_lr_drop and lr_value is not None and self._previous_lr is not None
                and lr_value < self._previous_lr and not self._learners_at_center):
            self.reset_learners()
        self._previous_lr = lr_value
        self._learners_at_center = False
        if total_count is not None:
            total_count = tf.cast(total_count, tf.float32)
        iteration = self.iteration if iteration is None else iteration
        self.iteration = iteration + 1
        step = self._step if self.synchronises(iteration) else self._local_step
        args = (x, y, mask, tf.cast(lr, tf.float32), total_count)
        return step(*args) if self._xla_checked else self._first_step(step, args)

    def _checked_batch(self, x, y, mask, local=False):
        k = self.strategy.local_learners if local else self.num_learners
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        if x.dtype == tf.float64:
            x = tf.cast(x, tf.float32)   # NumPy's default float; the model's weights are float32
        if y.dtype == tf.float64:
            y = tf.cast(y, tf.float32)
        rows = x.shape[0]
        if rows is None or rows == 0 or rows % k:
            what = "this worker's rows are D*m*b rows (D*m" if local else "a global batch is k*b rows (k"
            raise ValueError(f"Engine.train_step: x has {rows} rows; {what} = {k} learners, b examples each)")
        if y.shape[0] != rows:
            raise ValueError(f"Engine.train_step: y has {y.shape[0]} rows, x has {rows}")
        mask = tf.ones([rows], tf.float32) if mask is None else tf.cast(mask, tf.float32)
        if mask.shape != (rows,):
            raise ValueError(f"Engine.train_step: mask must have shape ({rows},), got {tuple(mask.shape)}")
        return x, y, mask

    def local_rows(self, global_batch):
        """(start, stop): the rows of a global batch that this worker's learners train on."""
        b = global_batch // self.num_learners
        start = self.strategy.first_learner * b
        return start, start + self.strategy.local_learners * b

    def _worker_slices(self, x, y, mask, total_count):
        """(x, y, mask) of this worker's learners, per device [m, b, ...], and the iteration's real count."""
        strategy = self.strategy
        D, m = strategy.num_devices, strategy.learners_per_device
        if total_count is None:   # the whole iteration: this worker trains its own rows of it
            total_count = tf.reduce_sum(mask)
            if strategy.num_workers > 1:
                start, stop = self.local_rows(x.shape[0])
                x, y, mask = x[start:stop], y[start:stop], mask[start:stop]
        b = x.shape[0] // (D * m)
        # Cut on the host, so that each device receives its own slice, not the whole global batch.
        with tf.device(self._host):
            x, y, mask = [tf.unstack(tf.reshape(t, [D, m, b] + t.shape[1:].as_list()), axis=0)
                          for t in (x, y, mask)]
        return x, y, mask, total_count

    def _local_step_fn(self, x, y, mask, lr, total_count=None):
        """An iteration between synchronisations: every learner takes its own step; z, u and z's
        state stay; nothing crosses a device or a worker but each device's loss sum (a scalar, for
        the reported loss)."""
        strategy = self.strategy
        x, y, mask, total_count = self._worker_slices(x, y, mask, total_count)
        m, b = strategy.learners_per_device, x[0].shape[1]
        computed = self._learners_on_devices([[w.read_value() for w in self.weights[d]] for d in range(strategy.num_devices)],
                                             x, y, mask)

        def own_steps():
            for d, device in enumerate(strategy.devices):
                with tf.device(device):
                    _, grads, new_states, _ = computed[d]
                    self.step_learners(d, grads, lr)
                    for variable, value in zip(self.states[d], new_states):
                        variable.assign(value)
        underflowed = self._unless_overflow(computed, own_steps)
        loss_sums, all_preds = [], []
        for d, device in enumerate(strategy.devices):
            with tf.device(device):
                losses, _, _, preds = computed[d]
                loss_sums.append(tf.reduce_sum(losses * tf.reduce_sum(mask[d], axis=1)))
                all_preds.append(preds)
        with tf.device(strategy.devices[0]):
            loss_sum = tf.reduce_sum(tf.stack(loss_sums))
            if self._cross_worker is None:
                loss = loss_sum / tf.maximum(total_count, 1.0)
            else:
                # This worker's learners only; a non-finite loss is told to every worker by the next
                # synchronisation's all-reduce (each worker stops there), not by this worker alone.
                loss = loss_sum / tf.maximum(tf.add_n([tf.reduce_sum(part) for part in mask]), 1.0)
                finite = tf.math.is_finite(loss)
                self._pending_non_finite.assign(tf.maximum(self._pending_non_finite, 1.0 - tf.cast(finite, tf.float32)))
                loss = tf.where(finite, loss, tf.zeros_like(loss))
            if self.loss_scale is not None:
                loss = tf.where(underflowed, tf.constant(float("nan"), loss.dtype), loss)
            self._finite.assign(tf.stack([tf.math.is_finite(loss), self._finite[1]]))
            loss = tf.where(tf.math.is_finite(loss), loss, tf.constant(float("nan"), loss.dtype))
        preds = tf.concat([tf.reshape(p, [m * b] + p.shape[2:].as_list()) for p in all_preds], 0)
        return loss, preds

    def _step_fn(self, x, y, mask, lr, total_count=None):
        strategy, alg = self.strategy, self.algorithm
        m = strategy.learners_per_device
        x, y, mask, total_count = self._worker_slices(x, y, mask, total_count)
        b = x[0].shape[1]
        weights = []
        for d, device in enumerate(strategy.devices):
            with tf.device(device):
                weights.append([tf.broadcast_to(z, [m] + z.shape.as_list()) for z in self.center[d]]
                               if alg.gradient_at_center else [w.read_value() for w in self.weights[d]])
        computed = self._learners_on_devices(weights, x, y, mask)
        if self.loss_scale is None:
            loss_sum = self._synchronise(computed, mask, lr, total_count)
        elif self._cross_worker is not None:
            # Every worker's "all finite" flag reaches every worker in the iteration's one all-reduce;
            # the learners' new values wait for it (see _synchronise).
            loss_sum, finite = self._synchronise(computed, mask, lr, total_count,
                                                 finite=self._gradients_finite(computed))
            underflowed = self._update_loss_scale(finite)
        else:   # one worker: the loss sum needs no reduction, and the update runs only when finite
            loss_sum = tf.reduce_sum(tf.stack([tf.reduce_sum(losses * tf.reduce_sum(mask[d], axis=1))
                                               for d, (losses, *_) in enumerate(computed)]))
            underflowed = self._unless_overflow(computed, lambda: self._synchronise(computed, mask, lr, total_count))
        loss = loss_sum / tf.maximum(total_count, 1.0)
        if self.loss_scale is not None:
            loss = tf.where(underflowed, tf.constant(float("nan"), loss.dtype), loss)
        # One pass over z, not over the k learners' copies: checking those in the step made a LeNet
        # iteration with 8 learners about 10% slower. A learner gone non-finite shows in its next loss.
        with tf.device(strategy.devices[0]):
            center_finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(z)) for z in self.center[0]]))
            finite = tf.stack([tf.math.is_finite(loss), center_finite])
            self._finite.assign(finite)
            loss = tf.where(tf.reduce_all(finite), loss, tf.constant(float("nan"), loss.dtype))
        preds = tf.concat([tf.reshape(p, [m * b] + p.shape[2:].as_list()) for *_, p in computed], 0)
        return loss, preds

    def _learners_on_devices(self, weights, x, y, mask):
        """Every device's learners on their slices: per device (losses, grads, new states, predictions),
        with the gradients of the scaled loss unscaled when the loss is scaled."""
        scale = {} if self.loss_scale is None else dict(scale=self.loss_scale.read_value())
        computed = []
        for d, device in enumerate(self.strategy.devices):
            with tf.device(device):
                states = [s.read_value() for s in self.states[d]]
                computed.append(self.learner_computation(weights[d], states, x[d], y[d], mask[d], **scale))
        return computed

    def _unless_overflow(self, computed, update):
        """Runs UPDATE (the iteration's changes to every variable); with loss scaling only when every
        gradient of every learner in COMPUTED is finite (otherwise nothing changes), then halves the
        loss scale after a skipped iteration and doubles it after dynamic_growth_steps good ones in a
        row, as Keras's LossScaleOptimizer. Returns (with loss scaling) whether the scale has
        underflowed (fallen below the smallest normal float32): a divergence."""
        if self.loss_scale is None:
            update()
            return None
        finite = self._gradients_finite(computed)

        def run():
            update()
            return tf.constant(True)
        tf.cond(finite, run, lambda: tf.constant(False))
        return self._update_loss_scale(finite)

    def _gradients_finite(self, computed):
        """Whether every gradient of every learner of this worker in COMPUTED is finite."""
        # One boolean per device, computed where its gradients are: D booleans cross devices, not D x m stacks.
        per_device = []
        for device, (_, grads, *_) in zip(self.strategy.devices, computed):
            with tf.device(device):
                per_device.append(tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads])))
        with tf.device(self.strategy.devices[0]):
            return tf.reduce_all(tf.stack(per_device))

    def _update_loss_scale(self, finite):
        """The loss scale halved after a skipped iteration (not FINITE), doubled after
        dynamic_growth_steps good ones in a row; whether it has underflowed."""
        with tf.device(self.strategy.devices[0]):
            scale, good = self.loss_scale.read_value(), self.good_steps.read_value()
            grow = tf.logical_and(finite, tf.equal(good, self.dynamic_growth_steps - 1))
            self.loss_scale.assign(tf.where(finite, tf.where(grow, scale * 2.0, scale), scale * 0.5))
            self.good_steps.assign(tf.where(tf.logical_and(finite, tf.logical_not(grow)), good + 1,
                                            tf.zeros_like(good)))
            return self.loss_scale.read_value() < np.finfo(np.float32).tiny

    def _synchronise(self, computed, mask, lr, total_count, finite=None):
        """The synchronising iteration's update of the learners, z, u and the states from COMPUTED
        (``_learners_on_devices``); returns the iteration's loss sum (over every worker).

        FINITE (loss scaling across workers): this worker's "every gradient finite" flag. It travels
        in the cross-worker all-reduce; the learners' new values are held (with a Keras optimizer,
        which assigns as it steps, their old values and its slots' are kept instead) until the
        reduction has carried every worker's flag, then assigned (or restored) under it, with z's
        update. Returns (the loss sum, whether every worker's gradients were finite)."""
        strategy = self.strategy
        held = None if finite is None else _Held()
        payloads, new_states, loss_sums = [], [], []
        for d, device in enumerate(strategy.devices):
            with tf.device(device):
                payload, states, loss_sum = self._device_payload(d, computed[d], mask[d], lr, total_count, held)
                payloads.append(payload)
                new_states.append(states)
                loss_sums.append(loss_sum)
        reduced = [payloads[0].unpack(flat) for flat in
                   all_reduce_sum(strategy.cross_device_ops, [payload.pack() for payload in payloads])]
        # A stacked sum, not add_n: AddN's order (and so the reported loss's last bit) varies by run.
        loss_sum = tf.reduce_sum(tf.stack(loss_sums))
        if self._cross_worker is not None:
            totals, loss_sum, overflows = self._reduce_across_workers(reduced[0], loss_sum, finite)
            reduced = [totals] * strategy.num_devices

        def apply():
            if held is not None:
                held.assign()
            for d, device in enumerate(strategy.devices):
                with tf.device(device):
                    self._apply_reduced(d, reduced[d], new_states[d], lr)
            if self.algorithm.restarts_learners:
                self.state.restart_from_center()
            return tf.constant(True)
        if held is None:
            apply()
            return loss_sum
        all_finite = tf.equal(overflows, 0.0)
        tf.cond(all_finite, apply, held.restore)
        return loss_sum, all_finite

    def _device_payload(self, d, computed, mask, lr, total_count, held=None):
        """Device D's learners' update from COMPUTED (its ``_learners_on_devices`` entry), held in
        HELD when given: (its SyncPayload, the learners' new states, its loss sum)."""
        alg, m = self.algorithm, self.strategy.learners_per_device
        losses, grads, new_states, _ = computed
        counts = tf.reduce_sum(mask, axis=1)
        share = counts / tf.maximum(total_count, 1.0)
        shares = [tf.reshape(share, [m] + [1] * (len(g.shape) - 1)) for g in grads]
        noise = ([], [], [])
        if alg.gradient_at_center:
            sums = [tf.reduce_sum(alg.local(None, None, g, z, lr, s)[2], axis=0)
                    for g, z, s in zip(grads, self.center[d], shares)]
        else:
            sums, noise = self._update_learners(d, grads, lr, shares, held)
        # Each learner's state as its difference from z's: state that no learner changes (a
        # Normalization layer's adapted statistics) stays exactly z's, where a sum of k equal
        # values divided by k would round.
        state_sums = [tf.reduce_sum(s - zs, axis=0) for s, zs, f in
                      zip(new_states, self.center_states[d], self._float_state) if f]
        payload = SyncPayload(totals=sums, steps=noise[0], gradients=noise[1], squares=noise[2],
                              state_totals=state_sums)
        return payload, new_states, tf.reduce_sum(losses * counts)

    def _reduce_across_workers(self, sums, loss_sum, finite=None):
        """The worker's SUMS (a SyncPayload, from its first device) and LOSS_SUM summed over the
        workers in the iteration's one all-reduce: (the totals, the loss sum, NaN when a local step
        since the last synchronisation went non-finite on some worker, and the number of workers
        whose gradients were not FINITE). A worker's request to stop (a signal it received) travels
        in it too, so that every worker stops after the same iteration."""
        overflow = tf.constant(0.0) if finite is None else 1.0 - tf.cast(finite, tf.float32)
        mine = WorkerPayload(sums=sums, loss_sum=loss_sum, stop_vote=self._stop_vote.read_value(),
                             non_finite=self._pending_non_finite.read_value(), overflows=overflow)
        total = mine.unpack(self._cross_worker(mine.pack()))
        self._stop_votes.assign(total.stop_vote)
        self._pending_non_finite.assign(0.0)
        loss_sum = tf.where(total.non_finite > 0, tf.constant(float("nan"), loss_sum.dtype), total.loss_sum)
        return total.sums, loss_sum, total.overflows

    def _apply_reduced(self, d, reduced, new_states, lr):
        """Device D's z, u, noise statistics and states from the iteration's REDUCED SyncPayload and
        the learners' NEW_STATES."""
        k = float(self.num_learners)
        self.update_center(d, reduced.totals, lr)
        if self.noise_decay is not None:
            self._match_noise(d, reduced.steps + reduced.gradients + reduced.squares)
        float_states = iter(reduced.state_totals)
        for i, s in enumerate(new_states):
            self.states[d][i].assign(s)
            if self._float_state[i]:
                # z's BatchNorm statistics are the mean of all learners' statistics.
                self.center_states[d][i].assign(self.center_states[d][i] + next(float_states) / k)

    def noise_variables(self, d):
        """Device D's noise-matching statistics (none when it is off), the same on every device."""
        return self.state.devices[d].noise_statistics

    def _match_noise(self, d, sums):
        """Noise matching on device D from the iteration's reduced SUMS (the learners' steps, weighted
        gradients, weighted square gradients)."""
        variables = (self.center[d], self.weights[d], self.learner_square[d], self.global_square[d])
        new = self._noise_update(*[[v.read_value() for v in group] for group in variables], sums)
        for group, values in zip(variables, new):
            for variable, value in zip(group, values):
                variable.assign(value)

    def _noise_update_fn(self, centers, weights, learner_squares, global_squares, sums):
        """z and every learner moved on by the part of the global batch's step that the learners'
        mean step lacks, then the statistics with this iteration taken in (one XLA launch; the new
        values are returned, as in _local_update_fn)."""
        n, k = len(centers), self.num_learners
        steps, gradients, squares = sums[:n], sums[n:2 * n], sums[2 * n:]   # _apply_reduced's order
        new = ([], [], [], [])
        for z, w, a, c, step, mean_gradient, mean_square in zip(centers, weights, learner_squares, global_squares,
                                                                steps, gradients, squares):
            shift = noise_matching.translation(step / k, a, c, k)
            new_a, new_c = noise_matching.update_statistics(a, c, mean_square, mean_gradient, self.noise_decay)
            for values, value in zip(new, (z + tf.cast(shift, z.dtype), w + tf.cast(shift, w.dtype), new_a, new_c)):
                values.append(value)
        return new

    def noise_factors(self, d=0):
        """Noise matching's factors f on device D, one tensor per weight (None when it is off)."""
        if self.noise_decay is None:
            return None
        return [noise_matching.step_factor(a.read_value(), c.read_value(), self.num_learners)
                for a, c in zip(self.learner_square[d], self.global_square[d])]

    def _local_update_fn(self, weights, velocities, grads, centers, lr, shares):
        """The learners' rule on a group of weights of a device (one XLA launch): their new weights
        and velocities, and the sums of their contributions.

        The new values are returned, not assigned here: assigning inside the XLA computation makes it
        copy every weight stack first (the sum still reads the old weights after the in-place write),
        one more pass over the largest tensors; the assignment outside adopts the new buffers."""
        new_weights, new_velocities, sums = [], [], []
        for w, v, g, z, share in zip(weights, velocities or [None] * len(weights), grads, centers, shares):
            new_w, new_v, contribution = self.algorithm.local(w, v, g, z, lr, share)
            new_weights.append(new_w)
            if velocities:
                new_velocities.append(new_v)
            sums.append(tf.reduce_sum(contribution, axis=0))
        return new_weights, new_velocities, sums

    def _own_update_fn(self, weights, velocities, grads, lr):
        """The learners' own step on a group of weights of a device (one XLA launch), as
        ``_local_update_fn`` but with no correction and no contribution."""
        new_weights, new_velocities = [], []
        for w, v, g in zip(weights, velocities or [None] * len(weights), grads):
            new_w, new_v = self.algorithm.learner_step(w, v, g, lr)
            new_weights.append(new_w)
            if velocities:
                new_velocities.append(new_v)
        return new_weights, new_velocities

    def step_learners(self, d, grads, lr):
        """The learners' own steps on device D (inside a tf.function), group by group."""
        if self.optimizers is not None:
            self._optimizer_apply(d, grads, lr)
            return
        for group in self._update_groups:
            weights = [self.weights[d][i] for i in group]
            velocities = [self.velocities[d][i] for i in group] if self.velocities[d] else []
            new_weights, new_velocities = self._own_update(weights, velocities, [grads[i] for i in group], lr)
            for variable, value in zip(weights + velocities, new_weights + new_velocities):
                variable.assign(value)

    def _central_update_fn(self, centers, center_velocities, totals, lr):
        new = [self.algorithm.central(z, u, total, lr) for z, u, total in zip(centers, center_velocities, totals)]
        return [z for z, _ in new], [u for _, u in new]

    def update_learners(self, d, grads, lr, shares):
        """Applies the learners' rule on device D (inside a tf.function); returns the sums of the
        learners' contributions, one per weight."""
        return self._update_learners(d, grads, lr, shares)[0]

    def _update_learners(self, d, grads, lr, shares, held=None):
        """``update_learners``, or with HELD (a _Held) leaving the learners' new values to it; returns
        the sums of the learners' contributions, one per weight, and noise matching's sums (the
        learners' steps, weighted gradients and weighted square gradients; three empty lists when
        it is off)."""
        if self.optimizers is not None:
            if held is not None:   # the Keras optimizer assigns as it steps: its old values are kept
                held.keep(self.weights[d] + self.optimizers.state(d))
            return self._optimizer_update(d, grads, lr, shares, self.noise_decay is not None)
        sums = [None] * len(grads)
        for group in self._update_groups:
            def pick(values):
                return [values[i] for i in group]
            weights, velocities = pick(self.weights[d]), pick(self.velocities[d]) if self.velocities[d] else []
            new_weights, new_velocities, group_sums = self._local_update(
                weights, velocities, pick(grads), pick(self.center[d]), lr, pick(shares))
            if held is not None:
                held.hold(weights + velocities, new_weights + new_velocities)
            else:
                for variable, value in zip(weights + velocities, new_weights + new_velocities):
                    variable.assign(value)
            for i, total in zip(group, group_sums):
                sums[i] = total
        return sums, ([], [], [])

    def _optimizer_update_fn(self, d, grads, lr, shares, noise_sums=False):
        """The Keras optimizer's step on device D's learners, then the rule's correction of it; the
        sums of the learners' contributions, and with NOISE_SUMS then those of their steps, of their
        gradients and of their squared gradients (both weighted by the learners' SHARES of the
        examples: the B-example gradient and the learners' mean square gradient), computed in the
        same XLA launch as the step, which reads every gradient and weight anyway."""
        before = [w.read_value() for w in self.weights[d]]
        self.optimizers.apply(d, grads, lr)
        sums, steps = [], []
        for w, s, z, share in zip(self.weights[d], before, self.center[d], shares):
            stepped = w.read_value()
            new_w, contribution = self.algorithm.correct(s, stepped, z, share)
            w.assign(new_w)
            sums.append(tf.reduce_sum(contribution, axis=0))
            if noise_sums:
                steps.append(tf.reduce_sum(tf.cast(stepped - s, tf.float32), axis=0))
        if not noise_sums:
            return sums, ([], [], [])
        grads = [tf.cast(g, tf.float32) for g in grads]
        return sums, (steps, [tf.reduce_sum(p * g, axis=0) for g, p in zip(grads, shares)],
                      [tf.reduce_sum(p * g * g, axis=0) for g, p in zip(grads, shares)])

    @property
    def optimizer_states(self):
        """Per device, the variables of its optimizer clone (empty lists without a Keras optimizer)."""
        return self.state.per_device("optimizer_states")

    def vote_stop(self):
        """On several workers: asks every worker to stop after the next step (this worker received
        a stop signal). The vote travels in that step's cross-worker all-reduce."""
        self._stop_vote.assign(1.0)

    def stop_voted(self):
        """On several workers: whether some worker voted to stop in the last step."""
        return float(self._stop_votes.numpy()) > 0

    def non_finite(self):
        """What is not finite, in words: "the loss" (of the last step), "z", "learner j" (its weights,
        velocities or float state); empty when everything is finite. Reads every variable: for
        diagnosis and before a checkpoint, not for every iteration."""
        loss_finite, _ = self._finite.numpy()
        names = [] if loss_finite else ["the loss"]
        if self.loss_scale is not None and self.loss_scale.numpy() < np.finfo(np.float32).tiny:
            names.append(f"the loss scale (underflowed to {self.loss_scale.numpy():.3g}: every iteration's "
                         "gradients overflowed in float16)")
        if not all(np.isfinite(v.numpy()).all() for v in self.center[0] + self.center_velocity[0]):
            names.append("z")
        m = self.strategy.learners_per_device
        for d in range(self.strategy.num_devices):
            finite = np.ones(m, bool)
            stacks = [s for s, f in zip(self.states[d], self._float_state) if f]
            if self.weights:
                stacks += self.weights[d] + self.velocities[d]
                # The optimizer's slots are stacks too; its step count and rate are scalars.
                stacks += [v for v in self.optimizer_states[d] if v.shape.rank and v.dtype.is_floating]
            for stack in stacks:
                values = stack.numpy()
                finite &= np.isfinite(values.reshape(m, -1)).all(axis=1)
            names += [f"learner {d * m + i}" for i in range(m) if not finite[i]]
        return names

    def update_center(self, d, totals, lr):
        """Applies the summed contributions TOTALS to device D's copy of z (inside a tf.function)."""
        if self.optimizers is not None and self.algorithm.gradient_at_center:
            # S-SGD: TOTALS is the iteration's gradient at z; z takes the optimizer's step with it.
            self._optimizer_apply(d, totals, lr)
            return
        new_center, new_center_velocity = self._central_update(
            self.center[d], self.center_velocity[d], totals, lr)
        for variable, value in zip(self.center[d] + self.center_velocity[d], new_center + new_center_velocity):
            variable.assign(value)

    def reset_learners(self):
        """Sets every learner's weights and float state to the central model's (velocities kept)."""
        if not self.algorithm.gradient_at_center:
            self._reset()
        self._learners_at_center = True

    def center_weights(self):
        """The central model z (trainable weights) as NumPy arrays, from the first device."""
        return self.state.center_arrays()

    def run_learners_through(self, computation):
        """From the next trace on, the learners run through COMPUTATION (the Keras path's replicated
        learners over a model whose nested inputs and outputs travel packed)."""
        self.learner_computation = computation

    def learner_weights(self):
        """Every learner's trainable weights: list over learners j of lists of arrays."""
        if self.algorithm.gradient_at_center:
            return [self.center_weights() for _ in range(self.num_learners)]
        return self.state.learner_arrays()

    def write_center_to_model(self):
        """Copies z (weights and averaged float state) into the user's model."""
        self.state.write_center_to(self.model)
