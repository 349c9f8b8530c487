"""Decisions that the configuration, the engine and the Keras path all make, in one place and without
TensorFlow, so that ``--check`` makes them before TensorFlow starts:

- which optimizers the learners can take, and why the others are refused;
- whether noise matching applies to an optimizer and a rule;
- whether a precision trains on the given number of workers;
- whether divergence handling has the checkpoints it needs.
"""
from crossbow_tf.algorithms.contract import NOISE_MATCHING_AT_CENTER, NOISE_MATCHING_PERIODIC  # noqa: F401
from crossbow_tf.optimizer_args import OPTIMIZER_ARGUMENTS

# keras.optimizers.get's names of the optimizers the learners (and the baselines) can take: those
# whose update of a weight reads only that weight's own elements, so that over the stacked learners
# it is one optimizer per learner (the table of their signatures is crossbow_tf.optimizer_args).
OPTIMIZER_NAMES = tuple(OPTIMIZER_ARGUMENTS)
ELEMENTWISE_CLASS_NAMES = tuple(class_name for class_name, _ in OPTIMIZER_ARGUMENTS.values())

# Keras optimizers whose update reads a whole weight tensor, by keras.optimizers.get's name:
# (class name, why, said short for the config and in full for a Keras object).
NOT_ELEMENTWISE = {
    "lamb": ("Lamb", "its layer-wise trust ratio is a norm over a whole weight tensor",
             "its layer-wise trust ratio divides by the norm of a whole weight tensor, which over the stacked "
             "learners would be one norm for all of them"),
    "adafactor": ("Adafactor", "it factors its second moments over a whole weight tensor",
                  "it factors its second moments over a weight's last two axes and clips by the RMS of a whole "
                  "update, which over the stacked learners would mix them"),
    "muon": ("Muon", "it orthogonalises whole weight matrices",
             "it orthogonalises whole weight matrices, which over the stacked learners would mix them"),
}
REFUSED_OPTIMIZERS = {name: short for name, (_, short, _) in NOT_ELEMENTWISE.items()}

NOISE_MATCHING_LINEAR = ("it applies to an adaptive optimizer (Adam, RMSprop, ...); SGD's step is linear in the "
                         "gradient, so the learners' mean step is already one step at the global batch")


def noise_matching_excluded(adaptive, rule):
    """Why noise matching cannot apply to learners of RULE (a crossbow_tf.algorithms.Rule) whose
    optimizer is ADAPTIVE (not SGD, whose step is linear in the gradient), or None when it applies.
    The reason is one of NOISE_MATCHING_LINEAR, NOISE_MATCHING_AT_CENTER, NOISE_MATCHING_PERIODIC."""
    if not adaptive:
        return NOISE_MATCHING_LINEAR
    return rule.noise_matching_excluded()


def noise_matching_on(setting, adaptive, rule):
    """Whether noise matching runs for SETTING ("auto", True, False): True asks for it (the caller has
    refused it where it does not apply), auto turns it on exactly where it applies."""
    return setting is True or (setting == "auto" and noise_matching_excluded(adaptive, rule) is None)


MIXED_FLOAT16_WORKERS = ("mixed_float16 (loss scaling) across several workers needs a rule that synchronises "
                         "every iteration (no sync period or local_after_epochs): every worker skips an "
                         "overflowing iteration together by the flag in its all-reduce")


def precision_refused(precision, workers, rule):
    """Why PRECISION cannot train RULE through the engine on WORKERS workers, or None: across workers,
    every worker skips an overflowing iteration together only where that iteration's all-reduce
    carries the flags; a local step has none, and the workers' loss scales would part."""
    if precision == "mixed_float16" and workers > 1 and not rule.synchronises_every_iteration:
        return MIXED_FLOAT16_WORKERS
    return None


ROLLBACK_NEEDS_CHECKPOINTS = "rollback needs checkpoints to roll back to"


def divergence_refused(on_divergence, checkpoint_dir):
    """Why ON_DIVERGENCE cannot run with CHECKPOINT_DIR (None: no checkpoints), or None."""
    if on_divergence == "rollback" and not checkpoint_dir:
        return ROLLBACK_NEEDS_CHECKPOINTS
    return None
