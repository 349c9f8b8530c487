"""The methods SMA is compared against, by name, and how each one is run.

- ``tf_ssgd``: stock TensorFlow synchronous SGD as users run it (``tf.distribute.MirroredStrategy``,
  Keras ``fit``, ``keras.optimizers.SGD``); no crossbow engine code (baselines/tf_ssgd.py).
- ``crossbow_ssgd``: Crossbow's synchronous SGD through our engine (gradients of k learners at z).
- ``easgd``: synchronous elastic averaging SGD through our engine.
- ``localsgd``: local SGD with an outer optimizer (Lin et al. 2020; DiLoCo's outer step) through our engine.

``sma`` is our method; it is listed in METHODS so that tools treat every method alike. Every
method is a command ``python -m MODULE --config FILE --results FILE`` that writes one
crossbow_tf.results.RunResults file; tools run each in its own process (TensorFlow fixes its device
list once per process, and a fresh process keeps one run's timing free of another's).

The engine methods are the rules of crossbow_tf.algorithms' registry, read when asked: a rule
registered there is a method here. This module imports no TensorFlow, so tools can read it cheaply.
"""
import collections.abc
import dataclasses

from crossbow_tf.algorithms.contract import ALGORITHMS


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    module: str                  # python -m MODULE --config FILE --results FILE
    algorithm: str               # algorithm.name the run's config is given (engine methods)
    engine: bool                 # True: trains through crossbow_tf's engine
    description: str


# The one method that is no rule of crossbow_tf.algorithms.
STOCK = Method("tf_ssgd", "baselines.tf_ssgd", "ssgd", False,
               "stock TensorFlow S-SGD: MirroredStrategy (or one device) + Keras fit + SGD(momentum)")
# Rules offered under another name or command than crossbow_tf.run with the rule's own name:
# {rule name: (method name, module)}. Every other registered rule is the method of its own name.
RENAMED = {"ssgd": ("crossbow_ssgd", "baselines.crossbow_ssgd"), "easgd": ("easgd", "baselines.easgd")}


def _method_of_rule(rule):
    name, module = RENAMED.get(rule.name, (rule.name, "crossbow_tf.run"))
    doc = (rule.__doc__ or rule.title).strip().splitlines()[0].rstrip(".")
    return Method(name, module, rule.name, True, f"{doc} (through the crossbow engine)")


class _Methods(collections.abc.Mapping):
    """{method name: Method}: the stock baseline and one method per rule of the registry, read when
    asked, so that a rule registered later is a method at once. WHICH filters the methods."""

    def __init__(self, which=lambda method, rule: True):
        self._which = which

    def _table(self):
        table = {m.name: (m, ALGORITHMS.get(m.algorithm)) for m in map(_method_of_rule, ALGORITHMS.values())}
        table[STOCK.name] = (STOCK, None)
        return {name: method for name, (method, rule) in table.items() if self._which(method, rule)}

    def __getitem__(self, name):
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())

    def __repr__(self):
        return f"{type(self).__name__}({list(self)})"


METHODS = _Methods()
BASELINES = _Methods(lambda method, rule: method.name != "sma")
# Methods whose global batch is k learners x b (those of the engine).
LEARNER_METHODS = _Methods(lambda method, rule: method.engine)
# Methods whose learners are averaged (not synchronous SGD's gradients at z).
AVERAGING_METHODS = _Methods(lambda method, rule: rule is not None and not rule.gradient_at_center)


def rule_of(method):
    """The rule class of engine METHOD (a name), or None for the stock baseline."""
    return ALGORITHMS.get(METHODS[method].algorithm) if METHODS[method].engine else None


def method_title(method):
    """How reports name METHOD: its rule's title (the stock baseline has none: None)."""
    rule = rule_of(method) if method in METHODS else None
    return None if rule is None else rule.title


class _Titles(collections.abc.Mapping):
    """{engine method: its rule's title}, from the registry when asked."""

    def __getitem__(self, method):
        title = method_title(method)
        if title is None:
            raise KeyError(method)
        return title

    def __iter__(self):
        return iter(LEARNER_METHODS)

    def __len__(self):
        return len(LEARNER_METHODS)


METHOD_WORDS = _Titles()


def restarts_learners(method):
    """Whether METHOD's synchronisations restart every learner from z (local SGD's)."""
    rule = rule_of(method) if method in METHODS else None
    return rule is not None and rule.restarts_learners


def has_central_loop(algorithm):
    """Whether the rule named ALGORITHM (an algorithm.name) has a central loop with a stability bound."""
    rule = ALGORITHMS.get(algorithm)
    return rule is not None and rule.has_central_loop


# Top-level YAML sections that belong to tools and baselines; crossbow_tf.config sets them aside.
from crossbow_tf.config import TOOL_SECTIONS  # noqa: E402  (one definition, shared)

__all__ = ["AVERAGING_METHODS", "BASELINES", "LEARNER_METHODS", "METHODS", "METHOD_WORDS", "Method",
           "TOOL_SECTIONS", "has_central_loop", "restarts_learners", "rule_of"]
