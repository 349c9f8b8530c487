"""A Keras optimizer for the learners: its own update on the stacked learner variables.

The engine keeps the m learners of a device as one variable per weight with a leading axis of m.
An elementwise optimizer (Adam, RMSprop, Nesterov SGD, ...) applied to such a stack is exactly m
copies of the optimizer, one per learner: its slots are created with the stack's shape, so every
learner has its own moments, and its update math is Keras's own (``optimizer.apply``), run by a
per-device clone of the compiled optimizer. Everything that is not elementwise is handled per
learner here: gradient clipping by norm (``clipnorm``, ``global_clipnorm``) runs on each learner's
gradients with the compiled optimizer's own clipping function. Optimizers whose update reads a
whole weight tensor (a layer-wise trust ratio, a factored moment, an orthogonalisation) are refused.

The step count (``iterations``, Adam's bias correction) is the clone's and counts the learners'
steps, which all learners take together; the learning rate is the one the engine is given each
iteration (the compiled optimizer's rate or schedule, read by the caller at its own step count),
written into the clone's learning-rate variable before its update.
"""
import keras
import tensorflow as tf

from crossbow_tf import policy

# Keras optimizers whose update of a weight reads only that weight's own elements (crossbow_tf.policy).
ELEMENTWISE = tuple(getattr(keras.optimizers, name) for name in policy.ELEMENTWISE_CLASS_NAMES)
_ELEMENTWISE_WORDS = ", ".join(policy.ELEMENTWISE_CLASS_NAMES)
NOT_ELEMENTWISE = {
    **{class_name: reason for class_name, _, reason in policy.NOT_ELEMENTWISE.values()},
    "LossScaleOptimizer": "it wraps another optimizer for loss scaling, which the engine does itself: pass the "
                          "inner optimizer with Engine(..., loss_scale=True) (use_sma takes a LossScaleOptimizer "
                          "and does this for you)",
}
# Options of a Keras optimizer that change what one step is in ways the learners cannot follow.
_REFUSED_OPTIONS = {
    "use_ema": "the evaluated model is z, the learners' average, not an average over time of one model",
    "gradient_accumulation_steps": "SMA synchronises the learners every iteration, whether or not the "
                                   "optimizer steps",
    "loss_scale_factor": "a fixed loss scale is not applied; dynamic loss scaling is Engine(..., loss_scale=True) "
                         "(use_sma: a LossScaleOptimizer)",
}
_CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def check_learner_optimizer(optimizer):
    """Raises ValueError naming the reason unless OPTIMIZER can run as the learners' optimizer."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"the learners' optimizer must be a keras.optimizers.Optimizer, got {name}")
    for cls in type(optimizer).__mro__:
        if cls.__name__ in NOT_ELEMENTWISE and cls.__module__.startswith("keras"):
            raise ValueError(f"{name} cannot be the learners' optimizer: {NOT_ELEMENTWISE[cls.__name__]}; "
                             f"use an elementwise one ({_ELEMENTWISE_WORDS})")
    if not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(f"{name} cannot be the learners' optimizer: crossbow_tf cannot tell whether its update "
                         "is elementwise (the learners' stacked weights need that); use Keras's "
                         f"{' or '.join(_ELEMENTWISE_WORDS.rsplit(', ', 1))}, or a subclass of one")
    for option, reason in _REFUSED_OPTIONS.items():
        value = getattr(optimizer, option, None)
        if value:
            raise ValueError(f"{name}({option}={value!r}) is not supported by Crossbow training: {reason}")


def is_momentum_sgd(optimizer):
    """Whether OPTIMIZER is a plain momentum SGD, which the rules' own fused update runs (with its
    weight decay as an L2 term in the gradient, Crossbow's form)."""
    return (type(optimizer) is keras.optimizers.SGD and not optimizer.nesterov
            and not any(getattr(optimizer, option, None) for option in _CLIP_OPTIONS + tuple(_REFUSED_OPTIONS))
            and not getattr(optimizer, "_exclude_from_weight_decay", None)
            and not getattr(optimizer, "_exclude_from_weight_decay_pattern", None))


class StackedOptimizers:
    """One clone of TEMPLATE per device, built on that device's variables.

    STACKED: the variables are stacks of m learners (gradients are clipped per learner); else each
    is one model (z, for S-SGD), clipped as Keras clips it. MODEL_VARIABLES: the model's own
    variables, in the same order, for TEMPLATE's exclusions from weight decay."""

    def __init__(self, template, variables_per_device, devices, model_variables, stacked=True):
        check_learner_optimizer(template)
        self.template, self.stacked = template, stacked
        config = dict(template.get_config(), learning_rate=0.0)
        self.clips = stacked and any(getattr(template, option, None) for option in _CLIP_OPTIONS)
        if stacked:
            # Keras would clip by the norm over the whole stack; the learners are clipped one by one below.
            config.update({option: None for option in _CLIP_OPTIONS})
        self.variables = variables_per_device
        self.clones = []
        for variables, device in zip(variables_per_device, devices):
            with tf.device(device):
                clone = type(template).from_config(config)
                clone.build(variables)
                excluded = [v for v, model_variable in zip(variables, model_variables)
                            if not template._use_weight_decay(model_variable)]
                if excluded:
                    clone.exclude_from_weight_decay(var_list=excluded)
            self.clones.append(clone)
        # Not all zeros: Adagrad's accumulators start at initial_accumulator_value, Nadam's product at 1.
        self._initial = [[v.numpy() for v in self.state(d)] for d in range(len(self.clones))]

    def state(self, d):
        """Device D's optimizer variables (step count, learning rate, the stacked slots)."""
        return [v.value for v in self.clones[d].variables]

    def apply(self, d, grads, lr):
        """The optimizer's step on device D's variables (inside a tf.function)."""
        clone = self.clones[d]
        if self.clips:
            grads = self._clipped_per_learner(grads)
        clone.learning_rate.assign(tf.cast(lr, clone.learning_rate.dtype))
        clone.apply(grads, self.variables[d])

    def _clipped_per_learner(self, grads):
        learners = grads[0].shape[0]
        per_learner = [self.template._clip_gradients([g[j] for g in grads]) for j in range(learners)]
        return [tf.stack([clipped[i] for clipped in per_learner]) for i in range(len(grads))]

    def restart(self):
        """Every slot and the step count back to their values before the first step."""
        for d in range(len(self.clones)):
            for v, initial in zip(self.state(d), self._initial[d]):
                v.assign(initial)


def learner_optimizer(optimizer):
    """What the engine's ``optimizer=`` gets for a compiled OPTIMIZER: None for a plain momentum SGD
    (the rules' fused update runs it), else OPTIMIZER itself, checked."""
    if is_momentum_sgd(optimizer):
        return None
    check_learner_optimizer(optimizer)
    return optimizer


def second_moment_decay(optimizer):
    """The decay of OPTIMIZER's running mean square gradient (Adam's beta_2, RMSprop's rho), which
    noise matching's statistics share; 0.999 for an optimizer without one (Adagrad, Ftrl)."""
    for name in ("beta_2", "rho"):
        value = getattr(optimizer, name, None)
        if isinstance(value, float) and 0.0 < value < 1.0:
            return value
    return 0.999


def check_noise_matching(optimizer, rule):
    """Raises ValueError unless noise matching applies (crossbow_tf.policy): an adaptive Keras
    OPTIMIZER for the learners of an averaging RULE that synchronises every iteration."""
    adaptive = optimizer is not None and not isinstance(optimizer, keras.optimizers.SGD)
    reason = policy.noise_matching_excluded(adaptive, rule)
    if reason is not None:
        raise ValueError(f"noise matching: {reason}")
