"""A form module's context (FORMS_API: m, weight, set_state, dropout, to_stacked, to_fused) over
explicit arrays, for checking and timing a fused form outside the engine.

The engine's context is FusedLearners (crossbow_tf/engine/fused.py), which reads the learners'
stacks from a training step. Here the stacks are given: one (m, ...) array per variable, keyed by
the variable. Layouts and dropout draws are FusedLearners' own, so a form sees what it sees there.
"""
import tensorflow as tf
from keras.src.backend.tensorflow.random import _cast_seed

from crossbow_tf.engine.fused import FusedLearners


class ArrayContext:
    """The learners' stacks STACKS ({id(variable): (m, ...) tensor}); READ_DTYPE, when given, is the
    dtype autocast float weights are read in (a layer's compute dtype, as Keras's AutocastScope)."""

    def __init__(self, stacks, read_dtype=None, m=None):
        self.stacks = dict(stacks)
        self.read_dtype = None if read_dtype is None else tf.as_dtype(read_dtype)
        self.m = m if m is not None else int(next(iter(self.stacks.values())).shape[0])

    @classmethod
    def of(cls, variables, values, read_dtype=None):
        """The context whose stack of VARIABLES[i] is VALUES[i]."""
        return cls({id(v): s for v, s in zip(variables, values, strict=True)}, read_dtype)

    def weight(self, variable):
        value = self.stacks[id(variable)]
        if (self.read_dtype is not None and getattr(variable, "_autocast", True) and value.dtype.is_floating
                and value.dtype != self.read_dtype):
            return tf.cast(value, self.read_dtype)
        return value

    def set_state(self, variable, value):
        self.stacks[id(variable)] = value

    to_fused = staticmethod(FusedLearners._to_fused)
    to_stacked = staticmethod(FusedLearners._to_stacked)

    def dropout(self, layer, x):
        """LAYER's (a keras Dropout's) draw for every learner from its own seed, as FusedLearners'."""
        if layer.rate <= 0:
            return x
        state = self.stacks[id(layer.seed_generator.state)]
        stacked = self.to_stacked(x)
        keep = tf.stack([tf.random.stateless_uniform(tf.shape(stacked[i]), seed=_cast_seed(state[i]), dtype=x.dtype)
                         >= layer.rate for i in range(self.m)])
        self.stacks[id(layer.seed_generator.state)] = state + tf.constant([0, 1], state.dtype)
        return tf.where(self.to_fused(keep), x * tf.constant(1 / (1 - layer.rate), x.dtype), tf.constant(0, x.dtype))
