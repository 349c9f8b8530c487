"""Update rules of SMA, synchronous SGD and synchronous elastic averaging SGD.

Every rule is a pure, elementwise function of tensors: it creates no variables and places nothing,
so one function serves NumPy arrays and TensorFlow tensors, one learner or a stack of learners
along a leading axis (the central model z then broadcasts against the stack).

Each algorithm splits one iteration in two halves that the engine places:
- ``local(w, v, g, z, lr, share)`` runs on the device of the learners and returns the learners' new
  weights and velocities and each learner's contribution to the cross-learner sum;
- ``central(z, u, total, lr)`` applies the summed contributions to the central model z and its
  velocity u, identically on every device's copy.

With a Keras optimizer for the learners (crossbow_tf.engine.optimizers), the engine takes the
optimizer's own step and the rule adds the rest: ``correct(w, stepped, z, share)`` gets each
learner's weights before the step (W) and after it (STEPPED) and returns its new weights and its
contribution, as ``local`` does around its momentum step.

Every rule subclasses crossbow_tf.algorithms.contract.Rule, which names the facts the rest of the
system asks of it, and is registered there (``ALGORITHMS``) under its name.

Averaging rules may synchronise only every H-th iteration (``synchronises``); the learners' own
step of the other iterations is ``learner_step(w, v, g, lr)``, with no contribution and no z. Which
of the two an iteration runs is the engine's choice (two compiled steps), never a branch in a rule.

The central loop of SMA and EASGD (with the learners held fixed) is stable exactly while the central
step beta stays below ``central_loop_bound(alpha, mu_z)``; binding a rule to k learners refuses
an unstable one (``allow_unstable=True`` runs it anyway).
"""
import dataclasses
import math
import numbers

from crossbow_tf.algorithms.contract import ALGORITHMS, Rule, register  # noqa: F401
from crossbow_tf.stability import central_loop_bound, check_central_loop, largest_stable_alpha  # noqa: F401


def _check_fraction(rule, name, value, low_closed, high_closed, allow_none=False):
    """Raises TypeError/ValueError naming RULE's parameter NAME unless VALUE is a finite number in the
    interval (closed at each end as told); creating a rule is the Python API's first check."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{rule}: {name} must be a number, got {value!r}")
    low, high = (0.0, 1.0)
    ok = math.isfinite(value) and (low <= value if low_closed else low < value) and (
        value <= high if high_closed else value < high)
    if not ok:
        interval = f"{'[' if low_closed else '('}0, 1{']' if high_closed else ')'}"
        raise ValueError(f"{rule}: {name} must be in {interval}{' or None' if allow_none else ''}, got {value!r}")


def _check_weight_decay(rule, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{rule}: weight_decay must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{rule}: weight_decay must be a finite number >= 0, got {value!r}")


def _check_period(rule, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{rule}: {name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{rule}: {name} must be at least 1, got {value!r}")


def _check_positive(rule, name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{rule}: {name} must be a number{' or None' if allow_none else ''}, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{rule}: {name} must be a finite number > 0{' or None' if allow_none else ''}, got {value!r}")


def _check_flag(rule, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{rule}: {name} must be True or False, got {value!r}")


def _learner_step(momentum, weight_decay, w, v, g, lr):
    """A learner's own momentum step: v = mu*v - lr*(g + wd*w); w = w + v (v None when mu is 0)."""
    v = _velocity(momentum, v, lr, g, weight_decay, w)
    return w + v, (v if momentum != 0 else None)


def _velocity(momentum, v, lr, g, weight_decay, w):
    """momentum*v - lr*(g + weight_decay*w), with zero coefficients left out rather than multiplied:
    0*x is not 0 for inf or NaN, so a compiler must still read x, and the update is memory-bound.
    V may be None when MOMENTUM is 0."""
    step = g if weight_decay == 0 else g + weight_decay * w
    return -lr * step if momentum == 0 else momentum * v - lr * step


@register
@dataclasses.dataclass(frozen=True)
class SMA(Rule):
    """Synchronous model averaging (Crossbow, Koliousis et al. 2019).

    Per learner j: s = w; v = mu*v - lr*(g + wd*w); w = w + v; delta = alpha*(s - z); w = w - delta.
    Central: u = mu_z*u + Delta; z = z + u, with Crossbow's Delta = sum_j delta_j (central_step None),
    or the decoupled Delta = beta * mean_j (s_j - z) (central_step=beta), which sets the central
    step apart from the learners' pull alpha. alpha=None means 1/k.
    SYNC_PERIOD H: iteration t (from 0 in the run) synchronises when (t + 1) % H == 0; the others are
    the learners' own steps only. ALLOW_UNSTABLE: run a central loop past its stability bound.
    """
    alpha: float | None = None
    momentum: float = 0.9
    central_momentum: float = 0.9
    weight_decay: float = 0.0
    central_step: float | None = None
    sync_period: int = 1
    allow_unstable: bool = False
    # k, set by for_learners: the decoupled step averages over the learners.
    num_learners: int | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    name = "sma"
    title = "SMA"
    has_central_loop = True
    total_pull = 1.0   # Crossbow's alpha = 1/k
    reset_on_lr_drop = True

    def __post_init__(self):
        # alpha = 0 is allowed: the learners train independently and z never moves (tests use it to
        # compare learners with plain SGD); an experiment config refuses it, as it evaluates z.
        _check_fraction("SMA", "alpha", self.alpha, True, True, allow_none=True)
        _check_fraction("SMA", "momentum", self.momentum, True, False)
        _check_fraction("SMA", "central_momentum", self.central_momentum, True, False)
        _check_weight_decay("SMA", self.weight_decay)
        _check_positive("SMA", "central_step", self.central_step, allow_none=True)
        _check_period("SMA", "sync_period", self.sync_period)
        _check_flag("SMA", "allow_unstable", self.allow_unstable)

    def check_central_loop(self, num_learners):
        check_central_loop("SMA", self.alpha_for(num_learners), self.central_step, self.central_momentum, num_learners,
                           self.allow_unstable)

    def for_learners(self, num_learners):
        self.check_central_loop(num_learners)
        bound = dataclasses.replace(self, alpha=self.alpha_for(num_learners))
        object.__setattr__(bound, "num_learners", num_learners)
        return bound

    def local(self, w, v, g, z, lr, share=None):
        v = _velocity(self.momentum, v, lr, g, self.weight_decay, w)
        difference = w - z
        delta = self.alpha * difference
        # Crossbow's Delta is the sum of the corrections themselves (kept bit for bit).
        contribution = delta if self.central_step is None else (self.central_step / self.num_learners) * difference
        return w + v - delta, v, contribution

    def correct(self, w, stepped, z, share=None):
        difference = w - z
        delta = self.alpha * difference
        contribution = delta if self.central_step is None else (self.central_step / self.num_learners) * difference
        return stepped - delta, contribution

    def learner_step(self, w, v, g, lr):
        return _learner_step(self.momentum, self.weight_decay, w, v, g, lr)

    def central(self, z, u, total, lr):
        u = self.central_momentum * u + total
        return z + u, u


@register
@dataclasses.dataclass(frozen=True)
class SynchronousSGD(Rule):
    """Crossbow's S-SGD: every learner's gradient is taken at z and z takes one momentum step.

    G = sum_j share_j * g_j (share_j = learner j's fraction of the iteration's examples, 1/k for
    full batches); v = mu*v - lr*(G + wd*z); z = z + v.
    """
    momentum: float = 0.9
    weight_decay: float = 0.0

    name = "ssgd"
    title = "Crossbow S-SGD"
    gradient_at_center = True
    keeps_learner_velocity = False

    def __post_init__(self):
        _check_fraction("SynchronousSGD", "momentum", self.momentum, True, False)
        _check_weight_decay("SynchronousSGD", self.weight_decay)

    def synchronises(self, iteration, iterations_per_epoch=None):
        return True

    def local(self, w, v, g, z, lr, share):
        return None, None, share * g

    def central(self, z, u, total, lr):
        u = _velocity(self.momentum, u, lr, total, self.weight_decay, z)
        return z + u, u


@register
@dataclasses.dataclass(frozen=True)
class ElasticAveragingSGD(Rule):
    """Synchronous elastic averaging SGD (Zhang et al. 2015), with optional learner momentum.

    delta = alpha*(w - z) (before the step); v = mu*v - lr*(g + wd*w); w = w + v - delta;
    z = z + sum_j delta_j.  alpha=None means 0.9/k (moving rate beta = k*alpha = 0.9, as Zhang et al.
    suggest). SYNC_PERIOD H as SMA's (Zhang et al.'s communication period tau). Its central loop is
    SMA's with mu_z = 0: stable while k*alpha < 2 - alpha.
    """
    alpha: float | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    sync_period: int = 1
    allow_unstable: bool = False

    name = "easgd"
    title = "EASGD"
    has_central_loop = True
    total_pull = 0.9   # Zhang et al.'s moving rate beta = k*alpha = 0.9

    def __post_init__(self):
        _check_fraction("ElasticAveragingSGD", "alpha", self.alpha, True, True, allow_none=True)
        _check_fraction("ElasticAveragingSGD", "momentum", self.momentum, True, False)
        _check_weight_decay("ElasticAveragingSGD", self.weight_decay)
        _check_period("ElasticAveragingSGD", "sync_period", self.sync_period)
        _check_flag("ElasticAveragingSGD", "allow_unstable", self.allow_unstable)

    def check_central_loop(self, num_learners):
        check_central_loop("EASGD", self.alpha_for(num_learners), None, 0.0, num_learners, self.allow_unstable)

    def for_learners(self, num_learners):
        self.check_central_loop(num_learners)
        return dataclasses.replace(self, alpha=self.alpha_for(num_learners))

    def local(self, w, v, g, z, lr, share=None):
        delta = self.alpha * (w - z)
        v = _velocity(self.momentum, v, lr, g, self.weight_decay, w)
        return w + v - delta, v, delta

    def correct(self, w, stepped, z, share=None):
        delta = self.alpha * (w - z)
        return stepped - delta, delta

    def learner_step(self, w, v, g, lr):
        return _learner_step(self.momentum, self.weight_decay, w, v, g, lr)

    def central(self, z, u, total, lr):
        return z + total, u


@register
@dataclasses.dataclass(frozen=True)
class LocalSGD(Rule):
    """Local SGD with an outer optimizer (Lin et al., ICLR 2020; DiLoCo's outer step, Douillard et al. 2023).

    Every learner steps every iteration: v = mu*v - lr*(g + wd*w); w = w + v. At a synchronising
    iteration, after that step: g_o = z - mean_j w_j; u = mu_o*u + g_o; z = z - eta_o*(g_o + mu_o*u)
    with Nesterov, else z = z - eta_o*u; then every learner restarts from z, keeping its velocity.
    Outer rate 1 and outer momentum 0 is plain local SGD (z becomes the learners' mean); 0.7 with
    Nesterov momentum 0.9 is DiLoCo's outer step. PERIOD H: iteration t synchronises when
    (t + 1) % H == 0; with LOCAL_AFTER_EPOCHS E (post-local SGD), every iteration of the first E
    epochs synchronises, then every H-th.
    """
    period: int = 1
    momentum: float = 0.9
    weight_decay: float = 0.0
    outer_learning_rate: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = False
    local_after_epochs: int | None = None
    num_learners: int | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    name = "localsgd"
    title = "local SGD"
    # Every learner restarts from z at every synchronisation: a step drop needs no reset of its own.
    restarts_learners = True

    def __post_init__(self):
        _check_period("LocalSGD", "period", self.period)
        _check_fraction("LocalSGD", "momentum", self.momentum, True, False)
        _check_weight_decay("LocalSGD", self.weight_decay)
        _check_positive("LocalSGD", "outer_learning_rate", self.outer_learning_rate)
        _check_fraction("LocalSGD", "outer_momentum", self.outer_momentum, True, False)
        _check_flag("LocalSGD", "nesterov", self.nesterov)
        if self.local_after_epochs is not None:
            if isinstance(self.local_after_epochs, bool) or not isinstance(self.local_after_epochs, numbers.Integral):
                raise TypeError(f"LocalSGD: local_after_epochs must be an integer or None, "
                                f"got {self.local_after_epochs!r}")
            if self.local_after_epochs < 0:
                raise ValueError(f"LocalSGD: local_after_epochs must not be negative, got {self.local_after_epochs!r}")

    def for_learners(self, num_learners):
        bound = dataclasses.replace(self)
        object.__setattr__(bound, "num_learners", num_learners)
        return bound

    @property
    def sync_period(self):
        """H once local steps have begun (after local_after_epochs): its parameter ``period``."""
        return self.period

    @property
    def synchronises_every_iteration(self):
        return self.period == 1 and self.local_after_epochs is None

    def synchronises(self, iteration, iterations_per_epoch=None):
        if self.local_after_epochs:
            if iterations_per_epoch is None:
                raise ValueError("LocalSGD(local_after_epochs=...) needs the iterations per epoch to know "
                                 "when local steps begin")
            if iteration < self.local_after_epochs * iterations_per_epoch:
                return True
        return (iteration + 1) % self.period == 0

    def local(self, w, v, g, z, lr, share=None):
        w, v = self.learner_step(w, v, g, lr)
        # Each learner's share of the outer gradient g_o = mean_j (z - w_j).
        return w, v, (z - w) / self.num_learners

    def correct(self, w, stepped, z, share=None):
        return stepped, (z - stepped) / self.num_learners

    def learner_step(self, w, v, g, lr):
        return _learner_step(self.momentum, self.weight_decay, w, v, g, lr)

    def central(self, z, u, total, lr):
        u = total if self.outer_momentum == 0 else self.outer_momentum * u + total
        step = total + self.outer_momentum * u if self.nesterov and self.outer_momentum else u
        return z - self.outer_learning_rate * step, u


