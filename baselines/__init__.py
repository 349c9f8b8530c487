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

This module imports no TensorFlow, so tools can read the registry cheaply.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    module: str                  # python -m MODULE --config FILE --results FILE
    algorithm: str               # algorithm.name the run's config is given (engine methods)
    engine: bool                 # True: trains through crossbow_tf's engine
    description: str


METHODS = {
    "sma": Method("sma", "crossbow_tf.run", "sma", True,
                  "Crossbow SMA: k learners of batch b, synchronous model averaging"),
    "tf_ssgd": Method("tf_ssgd", "baselines.tf_ssgd", "ssgd", False,
                      "stock TensorFlow S-SGD: MirroredStrategy (or one device) + Keras fit + SGD(momentum)"),
    "crossbow_ssgd": Method("crossbow_ssgd", "baselines.crossbow_ssgd", "ssgd", True,
                            "Crossbow S-SGD through the crossbow engine (k learners' gradients at z)"),
    "easgd": Method("easgd", "baselines.easgd", "easgd", True,
                    "synchronous elastic averaging SGD through the crossbow engine"),
    "localsgd": Method("localsgd", "crossbow_tf.run", "localsgd", True,
                       "local SGD with an outer optimizer (DiLoCo's with outer momentum) through the crossbow engine"),
}

BASELINES = {name: m for name, m in METHODS.items() if name != "sma"}

# Top-level YAML sections that belong to tools and baselines; crossbow_tf.config sets them aside.
from crossbow_tf.config import TOOL_SECTIONS  # noqa: E402  (one definition, shared)

__all__ = ["BASELINES", "METHODS", "Method", "TOOL_SECTIONS"]
