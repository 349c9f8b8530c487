"""Train a compiled Keras model with SMA (or S-SGD, EASGD) through the model's own ``fit``.

``use_sma`` attaches a ``CrossbowTraining`` to the user's model object and routes the model's
training step through the engine: one Keras step is one Crossbow iteration of all k learners and
the synchronisation. The model object itself keeps being the user's (same class, same variables) and
holds the central model z after every step, so Keras's evaluate, predict, save, validation and
callbacks all see z without knowing about learners.
"""
import contextlib
import dataclasses
import math
import os
import warnings
import zipfile

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from crossbow_tf.algorithms import ALGORITHMS, Rule   # the registry: every rule there is a name use_sma takes
from crossbow_tf.distribute.strategy import CrossbowStrategy
from crossbow_tf.engine.core import XLA_ERRORS, Engine
from crossbow_tf.engine.optimizers import check_noise_matching, is_momentum_sgd, learner_optimizer
from crossbow_tf.engine.replicated import ReplicatedLearners
from crossbow_tf.errors import DamagedFile
from crossbow_tf.keras import data as data_lib
from crossbow_tf import training_hooks as hooks
from crossbow_tf.keras.user_step import UserTrainStep
from crossbow_tf.keras.structure import CompiledLoss, OverriddenLoss, Packer, PackedModel, check_compiled_loss

STATE_SUFFIX = ".crossbow.npz"
_ATTRIBUTE = "_crossbow_training"
_PATCHED = ("fit", "train_step", "train_on_batch", "make_train_function", "save_weights", "load_weights")


def _with_learner_optimizer(rule, momentum, weight_decay, alpha, central_momentum):
    """RULE (an instance) with the compiled optimizer's momentum and weight decay: the compiled
    optimizer is the learners' optimizer, so a rule may not say otherwise."""
    name = type(rule).__name__
    if alpha is not None or central_momentum is not None:
        raise ValueError(f"alpha and central_momentum are {name}'s own parameters: set them in the rule "
                         f"({name}(alpha=...)), not in use_sma")
    defaults = {f.name: f.default for f in dataclasses.fields(rule)}
    for field, value in (("momentum", momentum), ("weight_decay", weight_decay)):
        own = getattr(rule, field)
        if own != defaults[field] and own != value:
            raise ValueError(f"{name}({field}={own}) conflicts with the compiled optimizer's {field}={value}: "
                             "the learners' momentum and weight decay come from the compiled optimizer")
    if getattr(rule, "local_after_epochs", None):
        raise ValueError(f"{name}(local_after_epochs=...) is not supported by fit (it counts iterations, not "
                         "epochs): use period alone, or crossbow_tf.run")
    return dataclasses.replace(rule, momentum=momentum, weight_decay=weight_decay)


def algorithm_from_optimizer(optimizer, algorithm="sma", alpha=None, central_momentum=None, weight_decay=None):
    """The update rule for ALGORITHM (a name in ALGORITHMS, or a rule instance such as
    ``SMA(central_step=2.0, sync_period=4)``) with the learner momentum and weight decay of a Keras SGD."""
    is_rule = not isinstance(algorithm, str)
    if is_rule and not isinstance(algorithm, Rule):
        raise ValueError(f"algorithm must be a name ({', '.join(ALGORITHMS)}) or an update rule such as "
                         f"crossbow_tf.algorithms.SMA(), got {algorithm!r}")
    if not is_rule and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if optimizer is None:
        raise ValueError("the model is not compiled: call model.compile(optimizer=keras.optimizers.SGD(...), "
                         "loss=...) first")
    if is_momentum_sgd(optimizer):
        momentum = float(optimizer.momentum)
        sgd_decay = float(optimizer.weight_decay or 0.0)
        if weight_decay is None:
            weight_decay = sgd_decay
        elif sgd_decay and float(weight_decay) != sgd_decay:
            raise ValueError(f"weight_decay={weight_decay} conflicts with the optimizer's "
                             f"SGD(weight_decay={sgd_decay}); set it in one place")
    else:
        # Any other elementwise Keras optimizer is the learners' own step; the rule only corrects it.
        learner_optimizer(optimizer)   # refuses one that cannot run per learner, saying why
        if weight_decay is not None:
            raise ValueError(f"use_sma(weight_decay=...) is the L2 term of momentum-SGD learners; the learners "
                             f"take {type(optimizer).__name__}'s own step: give it its weight_decay instead")
        momentum, weight_decay = 0.0, 0.0
    weight_decay = float(weight_decay)
    if is_rule:
        return _with_learner_optimizer(algorithm, momentum, weight_decay, alpha, central_momentum)
    cls = ALGORITHMS[algorithm]
    given = dict(momentum=momentum, weight_decay=weight_decay, alpha=alpha,
                 central_momentum=None if central_momentum is None else float(central_momentum))
    for key in ("alpha", "central_momentum"):
        if given[key] is not None and key not in cls.config_keys():
            takers = [c.title for c in ALGORITHMS.values() if key in c.config_keys()]
            raise ValueError(f"{key} applies to {' and '.join(takers)} only, not to {algorithm!r}: pass "
                             f"algorithm={cls.__name__}(...) for its own parameters")
    return cls(**{key: value for key, value in given.items() if key in cls.config_keys() and value is not None})


def learner_rate_scale(rule, optimizer, scale=1.0):
    """use_sma's LEARNING_RATE_SCALE, checked: the factor on the compiled rate that the learners of
    RULE step at with OPTIMIZER (only an adaptive optimizer's learners, see docs/keras.md)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"learning_rate_scale must be a number > 0, got {scale!r}")
    scale = float(scale)
    if scale != 1.0 and (is_momentum_sgd(optimizer) or rule.gradient_at_center):
        why = ("momentum SGD learners average linearly" if is_momentum_sgd(optimizer)
               else "synchronous SGD steps z with the mean gradient, as Keras does")
        raise ValueError(f"learning_rate_scale={scale:g} applies to the learners of an averaging rule with an "
                         f"adaptive optimizer (Adam, RMSprop, ...); {why}: set the rate in compile instead")
    return scale


def noise_matching_for(rule, optimizer, setting="auto"):
    """use_sma's NOISE_MATCHING, resolved: whether the learners of RULE with OPTIMIZER have their
    steps matched to the global batch's gradient noise."""
    if setting not in ("auto", True, False) or not isinstance(setting, (str, bool)):
        raise ValueError(f"noise_matching must be \"auto\", True or False, got {setting!r}")
    if setting == "auto":
        try:
            check_noise_matching(optimizer, rule)
        except ValueError:
            return False
        return True
    if setting:
        check_noise_matching(optimizer, rule)
    return setting


# Keras schedules whose rate is constant between boundaries: a fall there is a real step drop.
def _steps_of(schedule):
    """A description of SCHEDULE's step boundaries when its rate moves in steps, else None."""
    schedules = keras.optimizers.schedules
    if isinstance(schedule, schedules.PiecewiseConstantDecay):
        return f"at its boundaries {list(schedule.boundaries)} where the rate falls"
    if isinstance(schedule, (schedules.ExponentialDecay, schedules.InverseTimeDecay)) and schedule.staircase:
        return f"every {schedule.decay_steps} iterations (staircase)"
    return None


def reset_decision(algorithm, optimizer, setting="auto"):
    """(whether learners restart from z when the rate falls, one line saying when) for ALGORITHM
    trained with OPTIMIZER's learning rate under SETTING ("auto", True or False, see use_sma)."""
    if not algorithm.reset_on_lr_drop:
        return False, f"learner reset: none ({algorithm.name} has no learner reset)"
    if setting is False:
        return False, "learner reset: never (reset_on_lr_drop=False)"
    rate = optimizer._learning_rate
    is_schedule = isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
    name = type(rate).__name__
    if setting is True:
        return True, ("learner reset: every learner restarts from z whenever the learning rate falls "
                      f"(reset_on_lr_drop=True{f'; {name} may fall every iteration' if is_schedule else ''})")
    if not is_schedule:
        return True, ("learner reset: every learner restarts from z when the learning rate falls "
                      "(a constant rate changed by callbacks moves in steps)")
    steps = _steps_of(rate)
    if steps is not None:
        return True, f"learner reset: every learner restarts from z when {name} drops, {steps}"
    return False, (f"learner reset: never ({name} is not a step schedule; "
                   "pass reset_on_lr_drop=True to reset whenever the rate falls)")


def _checked_model_and_strategy(model, strategy, per_learner_batch):
    """use_sma's STRATEGY (default: one learner per device of CrossbowStrategy()), after checking it,
    MODEL and PER_LEARNER_BATCH."""
    if strategy is None:
        strategy = CrossbowStrategy()
    if not isinstance(strategy, CrossbowStrategy):
        raise ValueError(f"strategy must be a crossbow_tf.CrossbowStrategy, got {type(strategy).__name__}")
    if not isinstance(model, keras.Model):
        raise ValueError(f"use_sma needs a keras.Model, got {type(model).__name__}")
    if model.built and not model.trainable_variables:
        raise ValueError(f"model {model.name!r} has no trainable weights")
    if not isinstance(per_learner_batch, bool):
        raise ValueError(f"per_learner_batch must be True or False, got {per_learner_batch!r}")
    if not getattr(model, "compiled", False):
        raise ValueError("the model is not compiled: call model.compile(optimizer=keras.optimizers.SGD(...), "
                         "loss=...) first")
    return strategy


def _unwrapped_optimizer(optimizer):
    """(the learners' optimizer, the Engine's loss-scale options) of a compiled OPTIMIZER."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer, {}
    # What Keras's compile puts around the optimizer under mixed_float16: the engine scales every
    # learner's loss with its rules, and the learners take the inner optimizer's steps.
    return optimizer.inner_optimizer, dict(loss_scale=True, initial_scale=float(optimizer.initial_scale),
                                           dynamic_growth_steps=int(optimizer.dynamic_growth_steps))


def use_sma(model, strategy=None, *, algorithm="sma", alpha=None, central_momentum=None, weight_decay=None,
            reset_on_lr_drop="auto", jit_compile=False, learners=None, per_learner_batch=False,
            learning_rate_scale=1.0, noise_matching="auto"):
    """Makes MODEL's ``fit`` train k learners with Crossbow's synchronous model averaging.

    Call after ``model.compile(optimizer=..., loss=..., metrics=...)`` (momentum SGD, Adam, RMSprop or
    any other elementwise Keras optimizer, each learner with its own state); returns
    MODEL itself. From then on ``model.fit(..., batch_size=B)`` runs k = strategy.num_learners
    learners of B / k examples each per step (tf.distribute's convention: B is the global batch),
    and MODEL holds the central average model z.

    Args:
      model: a compiled Keras model (Sequential, Functional or subclassed); one that is not built yet
        is built on the first batch of its first ``fit``, as Keras builds it.
      strategy: a CrossbowStrategy (devices x learners per device); default: one learner per device
        of ``CrossbowStrategy()``.
      algorithm: "sma" (default), "ssgd" (Crossbow's synchronous SGD), "easgd" (elastic averaging),
        "localsgd" (local SGD, averaging every iteration), or a rule instance with its own parameters:
        ``SMA(alpha=0.3, central_step=2.0, sync_period=4)``, ``LocalSGD(period=8, outer_learning_rate=0.7,
        outer_momentum=0.9, nesterov=True)``. The learners' momentum and weight decay are always the
        compiled SGD's.
      alpha: SMA/EASGD correction factor; None means 1/k (SMA) or 0.9/k (EASGD).
      central_momentum: mu_z of SMA; None means 0.9.
      weight_decay: lambda, added to every gradient as lambda*w; None takes SGD(weight_decay=...).
      reset_on_lr_drop: when SMA restarts every learner from z (Crossbow's rule for step schedules).
        "auto": when the rate falls, if it moves in steps (a float or variable that callbacks set,
        PiecewiseConstantDecay, a staircase ExponentialDecay or InverseTimeDecay); never for any other
        schedule (a smooth decay falls a little every step). True: whenever the rate falls from one
        iteration to the next. False: never. ``fit`` prints which rule is in force.
      jit_compile: compile the engine's step with XLA (slower on CPU).
      learners: the engine's learner computation ("auto", "fused", "replicated"); None: the engine's default.
      per_learner_batch: True gives ``batch_size`` (and a dataset's batch) Crossbow's meaning, the
        batch b of one learner, so that a step takes k*b examples.
      learning_rate_scale: the learners of an adaptive optimizer (Adam, RMSprop, ...) step at this
        times the compiled rate (schedules and callbacks still set the compiled rate); default 1.
        Noise matching (below) is what keeps z at plain Keras's pace: a fixed sqrt(k) here lets every
        learner walk further on its own noisy gradient and destabilises a rate at its edge
        (docs/keras.md has the figures).
      noise_matching: "auto" (default): on for an adaptive optimizer's learners under an averaging rule
        that synchronises every iteration, off for SGD (linear, already matched), for "ssgd" and for a
        sync period. On, after each iteration z and every learner move on by (f - 1) times the
        learners' mean step, f = sqrt(E[g_b^2] / E[g_B^2]) per coordinate (between 1 and sqrt(k))
        estimated from the learners' own gradients, so that z advances one optimizer step at the
        global batch B while the learners' distances to z stay the rule's
        (crossbow_tf.algorithms.noise_matching, docs/keras.md). True: on (refused where it does not
        apply); False: the learners take exactly the compiled optimizer's steps.
    """
    strategy = _checked_model_and_strategy(model, strategy, per_learner_batch)
    optimizer, loss_scale = _unwrapped_optimizer(model.optimizer)
    rule = algorithm_from_optimizer(optimizer, algorithm, alpha, central_momentum, weight_decay)
    check_compiled_loss(model)
    refused = hooks.refusal(type(model))
    if refused:
        raise ValueError(refused)
    if loss_scale and hooks.overrides(type(model), "train_step"):
        raise ValueError(f"{type(model).__name__} overrides train_step, and its LossScaleOptimizer (mixed_float16) "
                         "scales a loss use_sma cannot see: train it in float32 or mixed_bfloat16 with use_sma")
    detach(model)
    if reset_on_lr_drop not in ("auto", True, False) or not isinstance(reset_on_lr_drop, (str, bool)):
        raise ValueError(f"reset_on_lr_drop must be \"auto\", True or False, got {reset_on_lr_drop!r}")
    if model.jit_compile and not jit_compile:
        # Keras resolves compile(jit_compile="auto") to True on GPUs too: say what happens either way.
        print("crossbow_tf: the model's jit_compile=True (XLA) is not applied to the Crossbow step: XLA around "
              "Keras's step does not support the engine's cross-device step; use_sma(..., jit_compile=True) "
              "compiles the engine's own step with XLA (slower on CPU)", flush=True)
    training = CrossbowTraining(model, strategy, rule, reset_on_lr_drop=reset_on_lr_drop, jit_compile=jit_compile,
                                learners=learners, per_learner_batch=per_learner_batch,
                                optimizer=learner_optimizer(optimizer), loss_scale=loss_scale,
                                learning_rate_scale=learner_rate_scale(rule, optimizer, learning_rate_scale),
                                noise_matching=noise_matching_for(rule, optimizer, noise_matching))
    setattr(model, _ATTRIBUTE, training)
    for name in _PATCHED:
        setattr(model, name, getattr(training, name))
    model.train_function = None
    return model


def detach(model):
    """Undoes ``use_sma``: MODEL trains with its own optimizer again (it keeps z as its weights)."""
    if getattr(model, _ATTRIBUTE, None) is None:
        return model
    for name in _PATCHED:
        model.__dict__.pop(name, None)
    model.__dict__.pop(_ATTRIBUTE, None)
    model.train_function = None
    return model


def get_training(model):
    """The CrossbowTraining that ``use_sma`` attached to MODEL (engine, strategy, algorithm)."""
    training = getattr(model, _ATTRIBUTE, None)
    if training is None:
        raise ValueError(f"model {model.name!r} is not set up for Crossbow training: call use_sma first")
    return training


class _Synchronise(keras.callbacks.Callback):
    """Runs after the user's callbacks' on_train_begin (BackupAndRestore may have loaded weights)."""

    def __init__(self, training):
        super().__init__()
        self.training = training

    def on_train_begin(self, logs=None):
        self.training.adopt_model_weights()


class CrossbowTraining:
    """The learners, the synchronisation and their hook into one Keras model's training."""

    def __init__(self, model, strategy, algorithm, reset_on_lr_drop="auto", jit_compile=False, learners=None,
                 per_learner_batch=False, optimizer=None, loss_scale=None, learning_rate_scale=1.0,
                 noise_matching=False):
        self.model = model
        self.learning_rate_scale = float(learning_rate_scale)
        self.strategy = strategy
        # A compute_loss of the model's own is its objective, for every learner (crossbow_tf/training_hooks.py).
        self.loss = OverriddenLoss(model) if hooks.overrides(type(model), "compute_loss") else CompiledLoss(model)
        # A train_step of the model's own runs once per learner instead of the engine's loss and gradient.
        self.user_step = hooks.overrides(type(model), "train_step")
        self.per_learner_batch = per_learner_batch
        self._engine_options = dict(jit_compile=jit_compile, **({} if learners is None else {"learners": learners}))
        # The learners' Keras optimizer (None: the rule's own momentum SGD, from a plain SGD).
        self._engine_options["optimizer"] = optimizer
        self._engine_options["noise_matching"] = noise_matching
        self._engine_options.update(loss_scale or {})   # Engine's loss_scale options, from a LossScaleOptimizer
        self.engine = None
        self.algorithm = algorithm.for_learners(strategy.num_learners)
        if model.built:
            self._build_engine()
        self.reset_setting = reset_on_lr_drop
        self.reset_on_lr_drop, self.reset_notice = reset_decision(self.algorithm, model.optimizer, reset_on_lr_drop)
        # 0 means "no iteration yet": a learning rate is never below it, so the first step never resets.
        self.previous_lr = tf.Variable(0.0, trainable=False, name="crossbow_previous_lr")
        self.resets = tf.Variable(0, dtype=tf.int64, trainable=False, name="crossbow_resets")
        self.global_batch = None
        self._traced_batch = None
        self._prepared = False
        self._packers = None
        self._backup_paths = set()
        self._adopted_from_chief = False
        self._algorithm_args = _optimizer_signature(model.optimizer)

    @property
    def num_learners(self):
        return self.strategy.num_learners

    def _build_engine(self):
        model = self.model
        # Keras restores optimizer state only when the saved and the live optimizer hold the same
        # variables; building now makes BackupAndRestore's files agree across processes.
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        self.engine = Engine(model, self.loss, self.algorithm, self.strategy, **self._engine_options)

    def build_on(self, first_batch):
        """Builds a model that is not built yet on FIRST_BATCH ((x, y[, sample_weight]) or a callable
        giving it), as Keras's fit builds it, then the learners."""
        if self.engine is not None:
            return
        model = self.model
        # Keras's TensorFlow trainer builds a model with a train_step of its own only by running that
        # step (keras-io's VAE has no call): here its layers alone must be built.
        unbuilt = (any(not layer.built for layer in model._flatten_layers(include_self=False)) if self.user_step
                   else not model.built)
        if unbuilt:
            batch = first_batch() if callable(first_batch) else first_batch
            # Keras's own build from a data batch (what fit runs under a tf.distribute strategy).
            model._symbolic_build(data_batch=batch)
        elif not model.built:
            model.built = True   # its layers hold every weight; its own step never calls it
        if not model.trainable_variables:
            raise ValueError(f"model {model.name!r} has no trainable weights")
        self._build_engine()

    def _require_engine(self):
        if self.engine is None:
            raise ValueError(f"model {self.model.name!r} is not built yet: its learners are created on the "
                             "first batch of fit (or train_on_batch)")
        return self.engine

    # ----------------------------------------------------------------------------------- the step
    def train_step(self, data):
        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        first = next(leaf for leaf in tree.flatten(x) if leaf is not None)
        own_loss = isinstance(self.loss, OverriddenLoss) or self.user_step
        if isinstance(self.loss, OverriddenLoss):
            self.loss.targets_given = y is not None
        if y is None:
            if self.loss.has_loss and not own_loss:
                raise ValueError("Crossbow training needs targets y for the compiled loss")
            # The loss comes from add_loss alone; the engine still cuts a target tensor into slices.
            y_targets = tf.zeros([tf.shape(first)[0]], tf.float32)
        else:
            y_targets = y
        global_batch = self._global_batch_for(first)
        n = tf.shape(first)[0]
        fits = tf.debugging.assert_less_equal(
            n, global_batch, message=f"a training batch holds more than B = k*b = {global_batch} examples; "
                                     "every batch of a dataset or generator must have the size of its first")
        with tf.control_dependencies([fits]):
            index = tf.range(global_batch) % n
        # Padding repeats the iteration's own examples; the mask keeps them out of losses and metrics.
        pad = lambda structure: tree.map_structure(lambda t: tf.gather(t, index), structure)  # noqa: E731
        x_pad, y_pad = pad(x), pad(y_targets)
        mask = tf.cast(tf.range(global_batch) < n, tf.float32)
        self._prepare(x_pad, y_pad, targets_given=y is not None)
        weights = None
        targets = y_pad
        if sample_weight is not None:
            if not self.loss.has_loss and not own_loss:
                raise ValueError("sample weights apply to the compiled loss, and the model was compiled "
                                 "without one (its loss comes from add_loss alone)")
            _check_sample_weight(sample_weight)
            weights = pad(sample_weight)
            targets = (y_pad, weights, mask)
        self._pack_targets(targets, weighted=weights is not None)
        x_in = x_pad if self._packers is None else self._packers[0].pack(x_pad)
        y_in = targets if self.loss.target_packer is None else self.loss.target_packer.pack(targets)

        lr = tf.cast(tf.convert_to_tensor(model.optimizer.learning_rate), tf.float32)
        if self.reset_on_lr_drop:
            tf.cond(lr < self.previous_lr, self._reset_learners, lambda: tf.constant(False))
        self.previous_lr.assign(lr)
        # The iteration decides whether this step synchronises (a rule with a period > 1).
        learner_lr = lr if self.learning_rate_scale == 1.0 else lr * self.learning_rate_scale
        loss, predictions = self.engine.step_at(model.optimizer.iterations, x_in, y_in, mask, learner_lr)
        self.engine.write_center_to_model()
        self._scale_to_optimizer()
        model.optimizer.iterations.assign_add(1)
        if self.user_step:   # fit shows what the model's own train_step returned, as in Keras
            return self.engine.learner_computation.read_logs()

        if self._packers is not None:
            predictions = self._packers[2].unpack(predictions)
        # The loss is the iteration's (all workers'); the predictions are this worker's rows.
        model._loss_tracker.update_state(loss, sample_weight=tf.cast(n, tf.float32))
        rows = lambda structure, start, stop: tree.map_structure(  # noqa: E731
            lambda t: None if t is None else t[start:stop], structure)
        if self.strategy.num_workers > 1:
            start, stop = self.engine.local_rows(global_batch)
            y_pad, weights = rows((y_pad, weights), start, stop)
            n = tf.clip_by_value(n - start, 0, stop - start)
        # Padding rows come last and are cut off before Keras's metrics see the step.
        predictions, y_pad, weights = rows((predictions, y_pad, weights), 0, n)
        real = tf.cast(n, tf.float32)
        output_metrics = self.loss.output_metrics
        if output_metrics:
            ones = None if weights is None else tf.ones([n], tf.float32)
            for metric, values in zip(output_metrics, self.loss.per_output(y_pad, predictions, weights, ones)):
                metric.update_state(tf.reduce_mean(values), sample_weight=real)
        return model.compute_metrics(x, None if y is None else y_pad, predictions, sample_weight=weights)

    def _reset_learners(self):
        self.engine.reset_learners()
        self.resets.assign_add(1)
        return tf.constant(True)

    def _global_batch_for(self, first):
        if self.global_batch is not None:
            return self.global_batch
        n = first.shape[0]
        if n is None:
            raise ValueError("train_on_batch needs a batch of known size")
        return self.num_learners * math.ceil(n / self.num_learners)

    def _prepare(self, x, y, targets_given=True):
        """Resolves the loss structure (and packing of nested inputs and outputs) once, at the first trace."""
        if self._prepared:
            return
        if self.user_step:
            input_packer = Packer(x) if tree.is_nested(x) else None
            self._packers = None if input_packer is None else (input_packer, None, None)
            self.engine.run_learners_through(UserTrainStep(self.model, self.loss, input_packer, targets_given))
            self._prepared = True
            return
        spec = tree.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype), x)
        y_pred = self.model.compute_output_spec(spec)
        self.loss.build(y, y_pred)
        if not self.loss.has_loss and not isinstance(self.loss, OverriddenLoss):
            self._check_model_adds_a_loss(x)
        if tree.is_nested(x) or tree.is_nested(y_pred):
            # The engine slices single tensors; nested inputs and outputs travel packed.
            self._packers = (Packer(x), None, Packer(y_pred, differentiable=True))
            self.loss.output_packer = self._packers[2]
            if isinstance(self.loss, OverriddenLoss):
                self.loss.input_packer = self._packers[0]
            packed = PackedModel(self.model, self._packers[0], self._packers[2])
            self.engine.run_learners_through(ReplicatedLearners(packed, self.loss))
        self._prepared = True

    def _check_model_adds_a_loss(self, x):
        # Keras's own refusal when there is nothing to minimise; a symbolic call records no add_loss
        # terms, so the model runs once (unused by the step) on the traced batch.
        model = self.model
        training = {"training": True} if model._call_has_training_arg else {}
        _, _, losses = model.stateless_call([v.value for v in model.trainable_variables],
                                            [v.value for v in model.non_trainable_variables], x,
                                            return_losses=True, **training)
        if not losses:
            raise ValueError("No loss to compute: the model was compiled without a loss and adds none with "
                             "add_loss. Provide a `loss` argument in `compile()`.")

    def _pack_targets(self, targets, weighted):
        # Read when the engine's step is traced: nested targets, or targets with their sample
        # weights, reach every learner's loss packed into one tensor.
        self.loss.weighted = weighted
        self.loss.target_packer = Packer(targets) if tree.is_nested(targets) else None

    # ------------------------------------------------------------------------------ Keras entry points
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None, sample_weight=None,
            steps_per_epoch=None, validation_batch_size=None, **kwargs):
        """Keras's fit with batch_size = the global batch B per step, k learners of B / k each (or,
        with per_learner_batch, the per-learner batch b; see docs/keras.md)."""
        self._check_optimizer_unchanged()
        k = self.num_learners
        data = data_lib.plan(x, y, sample_weight, batch_size, k, self.per_learner_batch,
                             steps_per_epoch=steps_per_epoch, validation_split=validation_split)
        self.build_on(data.first_batch)
        self._resolve_reset_decision()
        self._use_global_batch(data.global_batch)
        if verbose != 0:
            steps = "an unknown number of" if data.steps_per_epoch is None else data.steps_per_epoch
            print(f"crossbow_tf: {k} learners x {data.per_learner} examples = {data.global_batch} per step, "
                  f"{steps} steps per epoch", flush=True)
            print(f"crossbow_tf: {self.reset_notice}", flush=True)
        if self.per_learner_batch and validation_batch_size is None:
            # Validation runs in the batch the user chose, as the progress and on_test_batch_* hooks expect.
            validation_batch_size = data.per_learner
        if isinstance(callbacks, keras.callbacks.CallbackList):
            raise ValueError("pass callbacks as a list, not a CallbackList")
        callbacks = list(callbacks or [])
        self._backup_paths = {os.path.abspath(cb._weights_path) for cb in callbacks
                              if isinstance(cb, keras.callbacks.BackupAndRestore)}
        cluster = self.strategy.cluster
        if cluster is not None:
            callbacks, verbose = _callbacks_of_worker(cluster, callbacks, verbose)
        callbacks.append(_Synchronise(self))
        try:
            with cluster.guard() if cluster is not None else contextlib.nullcontext():
                return type(self.model).fit(
                    self.model, x=data.x, y=y, batch_size=data.keras_batch_size, epochs=epochs, verbose=verbose,
                    callbacks=callbacks, validation_split=validation_split, validation_data=validation_data,
                    shuffle=shuffle, class_weight=class_weight, sample_weight=sample_weight,
                    steps_per_epoch=steps_per_epoch, validation_batch_size=validation_batch_size, **kwargs)
        finally:
            self._backup_paths = set()

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """One iteration on a global batch of x (cut into k slices, padded to a multiple of k)."""
        self._check_optimizer_unchanged()
        self.build_on((x, y, sample_weight))
        self._resolve_reset_decision()
        n = len(tree.flatten(x)[0])
        self._use_global_batch(self.num_learners * math.ceil(n / self.num_learners))
        # Across workers, the chief's weights are broadcast at the first call only: a broadcast per
        # call would be a second collective per iteration.
        self.adopt_model_weights(from_chief=not self._adopted_from_chief)
        cluster = self.strategy.cluster
        with cluster.guard() if cluster is not None else contextlib.nullcontext():
            return type(self.model).train_on_batch(self.model, x, y, sample_weight=sample_weight,
                                                   class_weight=class_weight, return_dict=return_dict)

    def make_train_function(self, force=False):
        # The engine has its own jit switch; XLA around its cross-device step is not supported.
        model = self.model
        saved = model._jit_compile
        model._jit_compile = False
        try:
            function = type(model).make_train_function(model, force=force)
        finally:
            model._jit_compile = saved
        if self.engine is not None and not self.engine.xla_checked and model.train_function is not None:
            model.train_function = self._falling_back_without_xla(model.train_function)
        return function

    def _falling_back_without_xla(self, train_function):
        """TRAIN_FUNCTION (Keras's) whose first call, where XLA cannot compile the engine's step here,
        is made again with a train function without XLA, as the engine's own first step does."""
        engine, model = self.engine, self.model

        def first_call(batches):
            try:
                logs = train_function(batches)
            except XLA_ERRORS as e:
                # Keras takes the batch from its iterator inside the same graph: an XLA launch that
                # failed has used it up (a failure while tracing has not).
                if not engine.fall_back_without_xla(e, "; fit: the failed step's batch may be left out of "
                                                       "this epoch"):
                    raise
                model.train_function = None
                self.make_train_function()
                return model.train_function(batches)
            engine.confirm_xla()
            model.train_function = train_function
            return logs
        return first_call

    def _use_global_batch(self, global_batch):
        # The step pads to a static k*b baked into the traced function: a new b needs a new trace.
        if global_batch != self._traced_batch:
            self.model.train_function = None
            self._traced_batch = global_batch
        self.global_batch = global_batch

    def _resolve_reset_decision(self):
        # The rule is baked into the traced step; a schedule swapped in since needs a new trace.
        reset, self.reset_notice = reset_decision(self.algorithm, self.model.optimizer, self.reset_setting)
        if reset != self.reset_on_lr_drop:
            self.reset_on_lr_drop = reset
            self.model.train_function = None

    def _check_optimizer_unchanged(self):
        if _optimizer_signature(self.model.optimizer) != self._algorithm_args:
            raise ValueError("the model was recompiled with a different optimizer after use_sma; "
                             "call crossbow_tf.keras.use_sma(model, strategy) again")

    # ----------------------------------------------------------------------- z, learners and the model
    def adopt_model_weights(self, from_chief=True):
        """Starts the learners from the model's weights if they are no longer z (set_weights, loading).

        On several workers (and FROM_CHIEF) every worker first takes the chief's model weights."""
        engine, model = self._require_engine(), self.model
        current = [v.numpy() for v in model.trainable_variables]
        states = [v.numpy() for v in model.non_trainable_variables]
        if self.strategy.cluster is not None and from_chief:
            self._adopted_from_chief = True
            # Every worker adopts the chief's weights and loss scale (only the chief may have loaded a file).
            scale = self._scale_variables_of_optimizer() or []
            with self.strategy.cluster.guard():
                arrays = self.strategy.cluster.broadcast_from_chief(
                    current + states + [v.numpy() for v in scale])
            current, states = arrays[:len(current)], arrays[len(current):len(current) + len(states)]
            for v, a in zip(model.trainable_variables + model.non_trainable_variables + scale, arrays, strict=True):
                v.assign(a)
        self._scale_from_optimizer()
        if engine.state.center_matches(current, states):
            return False
        engine.state.assign_center(current, states)   # noise matching's statistics too: of the old weights
        self.previous_lr.assign(0.0)
        return True

    def _scale_variables_of_optimizer(self):
        """The compiled LossScaleOptimizer's scale and good-step count, or None (not one, or not built)."""
        optimizer = self.model.optimizer
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or not optimizer.built:
            return None
        return [optimizer.dynamic_scale, optimizer.step_counter]

    def _scale_to_optimizer(self):
        """The engine's loss scale mirrored in the compiled LossScaleOptimizer's variables after every
        step, so that Keras's weight files (save_weights, ModelCheckpoint, BackupAndRestore) hold it."""
        keras_variables = self._scale_variables_of_optimizer()
        if keras_variables is None or self.engine.loss_scale is None:
            return
        for keras_variable, variable in zip(keras_variables, self.engine.state.scale_variables(), strict=True):
            keras_variable.assign(tf.cast(variable, keras_variable.dtype))

    def _scale_from_optimizer(self):
        """The engine's loss scale from the LossScaleOptimizer's variables: the same unless a weights
        file was loaded into them since the last step."""
        keras_variables = self._scale_variables_of_optimizer()
        if keras_variables is None or self.engine.loss_scale is None:
            return
        for keras_variable, variable in zip(keras_variables, self.engine.state.scale_variables(), strict=True):
            variable.assign(tf.cast(keras_variable.value, variable.dtype))

    def learner_weights(self):
        """Every learner's trainable weights (list over learners of lists of arrays)."""
        return self._require_engine().learner_weights()

    def center_weights(self):
        return self._require_engine().center_weights()

    def state_variables(self):
        """Every variable of the learners and z (all devices), in a fixed order."""
        return self._require_engine().state.variables() + [self.previous_lr, self.resets]

    def save_state(self, path):
        """Writes the learners and z to PATH atomically: a crash leaves the previous file or the new one."""
        from crossbow_tf.files import atomic_write
        atomic_write(path, lambda f: np.savez(f, *[v.numpy() for v in self.state_variables()]), binary=True)

    def load_state(self, path):
        """Restores the learners and z saved by ``save_state`` if they belong to the model's current z."""
        variables = self.state_variables()
        try:
            with np.load(path) as f:
                arrays = [f[f"arr_{i}"] for i in range(len(f.files))]
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
            raise DamagedFile(f"{path}: damaged Crossbow learners' state ({type(e).__name__}: {e}); delete "
                                  "it and the backup beside it to restart training from the beginning") from None
        if len(arrays) != len(variables) or any(a.shape != tuple(v.shape) for a, v in zip(arrays, variables)):
            warnings.warn(f"{path} does not match this model and strategy; learners restart from the model's weights")
            return False
        saved_center = arrays[:len(self.model.trainable_variables)]   # z of the first device comes first
        if not all(np.array_equal(a, v.numpy()) for a, v in zip(saved_center, self.model.trainable_variables)):
            warnings.warn(f"{path} belongs to other weights than the ones just loaded; learners restart from them")
            return False
        for v, a in zip(variables, arrays):
            v.assign(a)
        return True

    # BackupAndRestore saves and loads through these; its files then carry the learners as well.
    def save_weights(self, filepath, overwrite=True, **kwargs):
        if os.path.abspath(str(filepath)) in self._backup_paths:
            result = type(self.model).save_weights(self.model, filepath, overwrite=overwrite, **kwargs)
            self.save_state(str(filepath) + STATE_SUFFIX)
            return result
        # Any other weights file (save_weights, ModelCheckpoint) holds z and the optimizer state of
        # an SGD that has taken no step: SMA never uses SGD's momentum slots, and a freshly
        # compiled model's SGD then loads the file without Keras's "Skipping variable loading" warning.
        with _as_unbuilt(self.model.optimizer):
            return type(self.model).save_weights(self.model, filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath, **kwargs):
        backup = os.path.abspath(str(filepath)) in self._backup_paths
        try:
            result = type(self.model).load_weights(self.model, filepath, **kwargs)
        except Exception as e:
            if not backup:
                raise
            raise DamagedFile(f"{filepath}: damaged BackupAndRestore backup ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); delete it to restart training "
                                  "from the beginning") from None
        state = str(filepath) + STATE_SUFFIX
        if backup and os.path.exists(state):
            self.load_state(state)
        return result


# Callbacks that only write (files, the progress bar): on workers other than the chief they would
# collide with the chief's files or repeat its output. Every other callback runs on every worker,
# since it may change training (a learning-rate schedule, early stopping on the same z's metrics).
_WRITING_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger, keras.callbacks.TensorBoard,
                      keras.callbacks.ProgbarLogger)


def _check_sample_weight(sample_weight):
    for leaf in tree.flatten(sample_weight):
        if leaf is not None and leaf.shape.rank == 0:
            raise ValueError("sample weights need one weight per example (a leading batch dimension); got a scalar")


def _callbacks_of_worker(cluster, callbacks, verbose):
    """The callbacks and verbosity of fit on this worker: the chief runs them all."""
    if any(isinstance(cb, keras.callbacks.BackupAndRestore) for cb in callbacks):
        raise ValueError("BackupAndRestore is not supported on several workers yet: restart the cluster "
                         "from a ModelCheckpoint the chief wrote instead")
    if cluster.is_chief:
        return callbacks, verbose
    return [cb for cb in callbacks if not isinstance(cb, _WRITING_CALLBACKS)], 0


@contextlib.contextmanager
def _as_unbuilt(optimizer):
    """OPTIMIZER shows only the variables it has before ``build`` (iteration, learning rate) meanwhile."""
    unbuilt = len(type(optimizer).from_config(optimizer.get_config()).variables)
    saved = optimizer._variables
    optimizer._variables = saved[:unbuilt]
    try:
        yield
    finally:
        optimizer._variables = saved


def _optimizer_signature(optimizer):
    return (id(optimizer), type(optimizer).__name__, getattr(optimizer, "momentum", None),
            getattr(optimizer, "nesterov", None), getattr(optimizer, "weight_decay", None))
