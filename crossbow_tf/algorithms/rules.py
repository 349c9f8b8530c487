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
