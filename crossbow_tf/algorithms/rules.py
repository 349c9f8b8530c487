"""Update rules of SMA, synchronous SGD and synchronous elastic averaging SGD.

Every rule is a pure, elementwise function of tensors: it creates no variables and places nothing,
so one function serves NumPy arrays and TensorFlow tensors, one learner or a stack of learners
along a leading axis (the central model z then broadcasts against the stack).

Each algorithm splits one iteration in two halves that the engine places:
- ``local(w, v, g, z, lr, share)`` runs on the device of the learners and returns the learners' new
  weights and velocities and each learner's contribution to the cross-learner sum;
- ``central(z, u, total, lr)`` applies the summed contributions to the central model z and its
  velocity u, identically on every device's copy.
"""
import dataclasses
import math
import numbers


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


def _velocity(momentum, v, lr, g, weight_decay, w):
    """momentum*v - lr*(g + weight_decay*w), with zero coefficients left out rather than multiplied:
    0*x is not 0 for inf or NaN, so a compiler must still read x, and the update is memory-bound.
    V may be None when MOMENTUM is 0."""
    step = g if weight_decay == 0 else g + weight_decay * w
    return -lr * step if momentum == 0 else momentum * v - lr * step


@dataclasses.dataclass(frozen=True)
class SMA:
    """Synchronous model averaging (Crossbow, Koliousis et al. 2019).

    Per learner j: s = w; v = mu*v - lr*(g + wd*w); w = w + v; delta = alpha*(s - z); w = w - delta.
    Central: u = mu_z*u + sum_j delta_j; z = z + u.  alpha=None means 1/k.
    """
    alpha: float | None = None
    momentum: float = 0.9
    central_momentum: float = 0.9
    weight_decay: float = 0.0

    name = "sma"
    gradient_at_center = False
    reset_on_lr_drop = True

    def __post_init__(self):
        # alpha = 0 is allowed: the learners train independently and z never moves (tests use it to
        # compare learners with plain SGD); an experiment config refuses it, as it evaluates z.
        _check_fraction("SMA", "alpha", self.alpha, True, True, allow_none=True)
        _check_fraction("SMA", "momentum", self.momentum, True, False)
        _check_fraction("SMA", "central_momentum", self.central_momentum, True, False)
        _check_weight_decay("SMA", self.weight_decay)

    @property
    def keeps_learner_velocity(self):
        """Whether learners need a velocity: with momentum 0 they take plain gradient steps."""
        return self.momentum != 0

    def resolve(self, num_learners):
        alpha = 1.0 / num_learners if self.alpha is None else self.alpha
        return dataclasses.replace(self, alpha=alpha)

    def local(self, w, v, g, z, lr, share=None):
        v = _velocity(self.momentum, v, lr, g, self.weight_decay, w)
        delta = self.alpha * (w - z)
        return w + v - delta, v, delta

    def central(self, z, u, total, lr):
        u = self.central_momentum * u + total
        return z + u, u


@dataclasses.dataclass(frozen=True)
class SynchronousSGD:
    """Crossbow's S-SGD: every learner's gradient is taken at z and z takes one momentum step.

    G = sum_j share_j * g_j (share_j = learner j's fraction of the iteration's examples, 1/k for
    full batches); v = mu*v - lr*(G + wd*z); z = z + v.
    """
    momentum: float = 0.9
    weight_decay: float = 0.0

    name = "ssgd"
    gradient_at_center = True
    reset_on_lr_drop = False
    keeps_learner_velocity = False

    def __post_init__(self):
        _check_fraction("SynchronousSGD", "momentum", self.momentum, True, False)
        _check_weight_decay("SynchronousSGD", self.weight_decay)

    def resolve(self, num_learners):
        return self

    def local(self, w, v, g, z, lr, share):
        return None, None, share * g

    def central(self, z, u, total, lr):
        u = _velocity(self.momentum, u, lr, total, self.weight_decay, z)
        return z + u, u


@dataclasses.dataclass(frozen=True)
class ElasticAveragingSGD:
    """Synchronous elastic averaging SGD (Zhang et al. 2015), with optional learner momentum.

    delta = alpha*(w - z) (before the step); v = mu*v - lr*(g + wd*w); w = w + v - delta;
    z = z + sum_j delta_j.  alpha=None means 0.9/k (moving rate beta = k*alpha = 0.9, as Zhang et al.
    suggest).
    """
    alpha: float | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0

    name = "easgd"
    gradient_at_center = False
    reset_on_lr_drop = False

    def __post_init__(self):
        _check_fraction("ElasticAveragingSGD", "alpha", self.alpha, True, True, allow_none=True)
        _check_fraction("ElasticAveragingSGD", "momentum", self.momentum, True, False)
        _check_weight_decay("ElasticAveragingSGD", self.weight_decay)

    @property
    def keeps_learner_velocity(self):
        return self.momentum != 0

    def resolve(self, num_learners):
        alpha = 0.9 / num_learners if self.alpha is None else self.alpha
        return dataclasses.replace(self, alpha=alpha)

    def local(self, w, v, g, z, lr, share=None):
        delta = self.alpha * (w - z)
        v = _velocity(self.momentum, v, lr, g, self.weight_decay, w)
        return w + v - delta, v, delta

    def central(self, z, u, total, lr):
        return z + total, u


ALGORITHMS = {"sma": SMA, "ssgd": SynchronousSGD, "easgd": ElasticAveragingSGD}
