"""What every update rule is: the facts the rest of the system asks of it, and the registry of rules.

A rule is a frozen dataclass subclassing ``Rule``. Its init fields are its parameters, and they are
also its configuration keys (``algorithm.<field>`` in an experiment's YAML). Everything else that
config, engine, Keras path, harness, report and baselines need to know about a rule is a class
attribute or method here, so that none of them decides anything by a rule's name:

- ``name``: its key in ``ALGORITHMS`` and its ``algorithm.name``; ``title``: how reports name it;
- ``gradient_at_center``: the learners take their gradients at z (synchronous SGD), so there is
  nothing to average;
- ``has_central_loop``: z follows the learners through a loop with a stability bound
  (crossbow_tf.stability), which ``allow_unstable`` lifts; ``total_pull``: its default alpha is
  ``total_pull / k`` (``default_alpha``);
- ``sync_period`` and ``synchronises_every_iteration``: how often it synchronises;
- ``reset_on_lr_drop``, ``restarts_learners``: what a step drop and a synchronisation do to the learners;
- ``noise_matching_excluded()``: why noise matching cannot apply to it (None when it can);
- ``follows_keras_optimizer``: it can correct a Keras optimizer's own step (``correct``).

The module imports nothing of TensorFlow or of the engine: the configuration (and so ``--check``
and the stock baseline's command line) reads the registry before TensorFlow starts.
"""
import dataclasses
import typing

# Why noise matching does not apply to a rule (crossbow_tf.policy adds the optimizer's reason).
NOISE_MATCHING_AT_CENTER = "it applies to averaging rules; synchronous SGD already steps z with the global batch's gradient"
NOISE_MATCHING_PERIODIC = ("it needs the learners' steps of every iteration, and this rule does not synchronise "
                           "every iteration")


class Rule:
    """The base of every update rule (see the module's docstring for the facts, and
    crossbow_tf.algorithms.rules for the halves ``local``/``central``/``correct``/``learner_step``)."""
    name: typing.ClassVar[str]
    title: typing.ClassVar[str]
    gradient_at_center: typing.ClassVar[bool] = False
    has_central_loop: typing.ClassVar[bool] = False
    total_pull: typing.ClassVar[typing.Optional[float]] = None
    reset_on_lr_drop: typing.ClassVar[bool] = False
    restarts_learners: typing.ClassVar[bool] = False
    # Iterations between synchronisations (once local steps have begun, for post-local SGD).
    sync_period: int = 1

    @classmethod
    def config_keys(cls):
        """The rule's parameters: the ``algorithm:`` keys it takes."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def default_alpha(cls, num_learners):
        """Alpha when none is given for NUM_LEARNERS learners (None: the rule has no alpha)."""
        return None if cls.total_pull is None else cls.total_pull / num_learners

    def alpha_for(self, num_learners):
        """The rule's alpha with NUM_LEARNERS learners: its own, else its default (None: it has none)."""
        alpha = getattr(self, "alpha", None)
        return self.default_alpha(num_learners) if alpha is None else alpha

    @property
    def synchronises_every_iteration(self):
        return self.sync_period == 1

    @property
    def keeps_learner_velocity(self):
        """Whether learners need a velocity: with momentum 0 they take plain gradient steps."""
        return getattr(self, "momentum", 0) != 0

    @property
    def follows_keras_optimizer(self):
        """Whether the learners may take a Keras optimizer's step, which ``correct`` then follows."""
        return self.gradient_at_center or type(self).correct is not Rule.correct

    def noise_matching_excluded(self):
        """Why noise matching cannot apply to this rule's learners, or None when it can."""
        if self.gradient_at_center:
            return NOISE_MATCHING_AT_CENTER
        if not self.synchronises_every_iteration:
            return NOISE_MATCHING_PERIODIC
        return None

    def check_central_loop(self, num_learners):
        """Raises ValueError when the rule's central loop is unstable with NUM_LEARNERS learners."""

    def for_learners(self, num_learners):
        """This rule bound to NUM_LEARNERS learners (alpha's default taken, the stability checked)."""
        return self

    def synchronises(self, iteration, iterations_per_epoch=None):
        """Whether ITERATION (from 0 in the run) synchronises: the H-th, 2H-th, ... one."""
        return (iteration + 1) % self.sync_period == 0

    def local(self, w, v, g, z, lr, share=None):
        raise NotImplementedError(f"{type(self).__name__}.local")

    def central(self, z, u, total, lr):
        raise NotImplementedError(f"{type(self).__name__}.central")

    def correct(self, w, stepped, z, share=None):
        raise NotImplementedError(f"{type(self).__name__} cannot follow a Keras optimizer's step")


# The registry: every rule by name. config, the Keras path, the harness and the baselines read it
# when they need it (not at import), so a rule registered later is everywhere at once.
ALGORITHMS = {}


def register(cls):
    """Adds rule class CLS to ALGORITHMS under CLS.name (a class decorator); returns CLS."""
    if not (isinstance(cls, type) and issubclass(cls, Rule) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register: {cls!r} is not a dataclass subclassing crossbow_tf.algorithms.Rule")
    if not isinstance(getattr(cls, "name", None), str) or not isinstance(getattr(cls, "title", None), str):
        raise TypeError(f"register: {cls.__name__} needs the class attributes name and title (strings)")
    known = ALGORITHMS.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"register: the name {cls.name!r} is {known.__name__}'s already")
    ALGORITHMS[cls.name] = cls
    return cls


def unregister(name):
    """Removes the rule NAME from ALGORITHMS (for tests that add one)."""
    ALGORITHMS.pop(name, None)


def rule_class(name):
    """The rule class registered as NAME; ValueError naming the choices for an unknown one."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]
