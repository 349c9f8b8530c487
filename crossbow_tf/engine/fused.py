"""Fused learners: the m learners of a device run as one computation.

Learners are an axis, not a loop. Per-learner activations are kept in one of three layouts, chosen
by the rank of the single-learner tensor, so that the expensive layers need no transposes:
- images (b, H, W, C) -> (b, H, W, m, C): a Conv2D over all learners is one grouped convolution
  (input (b, H, W, m*C), filter (kh, kw, C, m*O)), pooling works on (b, H, W, m*C) unchanged, and
  so does a DepthwiseConv2D (filter (kh, kw, m*C, d)); a SeparableConv2D is that depthwise
  convolution followed by a grouped 1x1 convolution;
- sequences (b, L, C) -> (b, L, m, C): a Conv1D is a grouped convolution of (b, 1, L, m*C), 1-D
  pooling works on (b, L, m*C);
- features (b, F) -> (m, b, F): a Dense over all learners is one batched matmul;
- volumes (b, D, H, W, C) and ConvLSTM2D/3D's inputs (rank 6) keep the image layout, learners second
  to last; only the generic form (below) and the rank-free forms (Dense, Dropout, BatchNorm, Flatten,
  merges) meet them.
Flatten and global pooling move from the first two layouts to the third. BatchNorm keeps statistics
per learner; Dropout draws each learner's mask from that learner's own seed, exactly as Keras does,
so fused and replicated learners compute the same numbers. Rescaling and Normalization act on
every element alike and run once on the fused layout (Normalization's adapted statistics are
constants of its call and are never written). Keras's image preprocessing and augmentation layers
(RandomFlip, RandomRotation, RandomCrop, ...; every subclass of its BaseImagePreprocessingLayer)
run once per learner on that learner's slice with that learner's seed state: their random
transformations are drawn per batch or per image with shapes that vary by layer, so Keras's own
call on each slice is the one form that draws exactly what a replicated learner draws. They are
cheap beside the convolutions that follow them. Nested Sequential and Functional models are walked
into, layer by layer.

Dtype policies are honoured as Keras's own ``Layer.__call__`` honours them: each layer's float
inputs are cast to its compute dtype, its autocast weights are cast to that dtype where it reads
them (the learners' stacks stay in the variable dtype, float32, so gradients come back float32),
BatchNorm computes in float32 and returns its compute dtype, and a layer that asks for float32
(dtype="float32", as Keras's mixed-precision guide recommends for the last one) computes and
returns float32. The loss is computed in float32 (``per_example_loss_fn``).

The model's Keras graph is walked with each layer replaced by its fused form; a model with a layer
that has no fused form raises UnsupportedModel, and `make_learners` falls back to replicated
learners with a one-line notice, once per model. A layer of the generic form whose ops TensorFlow
cannot vectorize runs once per learner inside the fused computation; if that fails too (its outputs
cannot be stacked, say), the learners switch to the replicated computation for good, with the same
notice naming the layer, the op and the failure.
"""
import logging
import re
import weakref

import keras
import numpy as np
import tensorflow as tf
# Not exported by Keras: the scope in which its layers read autocast variables in the compute dtype.
from keras.src.backend import AutocastScope
# Not exported by Keras: how its layers attach masks to tensors, and the call context through which
# an outer layer's training flag reaches the layers it calls.
from keras.src.backend.common import global_state
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.layers.layer import CallContext, CallSpec

from crossbow_tf.engine import conv_forms
from crossbow_tf.engine.conv_forms import quiet_tensorflow_log as _quiet_tensorflow_log
from crossbow_tf.engine.fused_forms import apply_generic as _GENERIC_APPLY
from crossbow_tf.engine.fused_forms import form_of, learner_device_type, onednn_enabled, why_unsupported  # noqa: F401,E501 (re-exported)

from crossbow_tf.engine.replicated import (ReplicatedLearners, in_variable_dtypes, masked_mean, per_example_loss_fn,
                                           unscaled)

log = logging.getLogger("crossbow_tf")

# Single-learner ranks with a fused layout: feature vectors, sequences, images, and volumes (and
# volumes over time: ConvLSTM2D/3D's inputs), which keep the image layout's learners second to last.
_FUSED_RANKS = (2, 3, 4, 5, 6)


class UnsupportedModel(ValueError):
    """The model has a layer (or use of one) without a fused form."""


class PerLearnerCallFailed(RuntimeError):
    """A layer TensorFlow cannot vectorize also failed when called once per learner inside the fused
    computation: the whole model has to run replicated."""


def _graph_of(model):
    if isinstance(model, keras.Sequential):
        graph = getattr(model, "_functional", None)
        if graph is None:
            raise UnsupportedModel(f"the Sequential model {model.name!r} has no Input and was never built, "
                                   "so it cannot be walked")
        return graph
    if isinstance(model, keras.Model) and hasattr(model, "_run_through_graph") and hasattr(model, "_nodes_by_depth"):
        return model
    raise UnsupportedModel(f"subclassed model {type(model).__name__} has no layer graph to fuse")


def _is_submodel(layer):
    return isinstance(layer, keras.Model)


def _unsupported_in(graph, prefix=""):
    """Every layer of GRAPH (or of a model nested in it) without a fused form, or used in a layout
    that has none, as "layer 'name' (Class): reason" lines."""
    found = []
    # Keras numbers depths from the outputs: the deepest nodes come first in the model.
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            layer = node.operation
            if layer is None or node.is_input:
                continue
            if _is_submodel(layer):
                found += _unsupported_in(_graph_of(layer), f"{prefix}{layer.name}/")
                continue
            ranks = [len(t.shape) for t in node.input_tensors]
            bad = [r for r in ranks + [len(t.shape) for t in node.output_tensors] if r not in _FUSED_RANKS]
            reason = (f"a tensor of rank {bad[0]}; only tensors of rank 2 to 6 (feature vectors, sequences, "
                      "images, volumes) are fused") if bad else why_unsupported(layer, ranks)
            line = f"layer {prefix + layer.name!r} ({type(layer).__name__}): {reason}"
            if reason is not None and line not in found:
                found.append(line)
    return found


def _check_graph(graph):
    """Raises UnsupportedModel naming every layer of GRAPH that has no fused form."""
    found = _unsupported_in(graph)
    if found:
        raise UnsupportedModel("; ".join(found))


# Activations that act on each element alone, so they may run on the merged (b, H, W, m*C) layout,
# where TensorFlow's optimiser fuses Conv2D, BiasAdd and the activation into one oneDNN call.
_ELEMENTWISE_ACTIVATIONS = frozenset(
    getattr(keras.activations, name) for name in (
        "linear", "relu", "relu6", "elu", "selu", "gelu", "sigmoid", "hard_sigmoid", "tanh", "swish",
        "silu", "softplus", "softsign", "leaky_relu", "exponential", "mish")
    if hasattr(keras.activations, name))


@tf.custom_gradient
def _learners_matmul(x, kernel):
    """x (m, b, F) @ kernel (m, F, O) per learner. For LeNet's small per-learner batches the forward
    pass runs faster as m plain matmuls than as one batched matmul (measured here: 1.7 ms against
    2.5 ms for 8 learners of 16 on a 1024x1024 kernel); the gradients are fastest batched."""
    y = tf.stack([tf.matmul(x_i, k_i) for x_i, k_i in zip(tf.unstack(x), tf.unstack(kernel))])

    def grad(dy):
        return tf.matmul(dy, kernel, transpose_b=True), tf.matmul(x, dy, transpose_a=True)
    return y, grad


def _weight_dtype(layer):
    """The dtype LAYER's autocast weights are read in during its call (None: as stored), as Keras's
    Layer.__call__ sets its autocast scope."""
    if layer.autocast and keras.backend.is_float_dtype(layer.compute_dtype):
        return keras.backend.standardize_dtype(layer.compute_dtype)
    return None


def _layer_input(layer, x):
    """X as LAYER receives it from Keras's Layer.__call__: float inputs cast to its input dtype."""
    if not getattr(layer, "_convert_input_args", True):
        return x
    return layer.dtype_policy.convert_input(x, layer.autocast, layer.input_dtype)


def _graph_input(graph, inputs):
    """INPUTS as a Functional model's call standardizes them: cast to its Input tensors' dtypes."""
    return [tf.cast(x, spec.dtype) if x.dtype.is_floating and keras.backend.is_float_dtype(spec.dtype) else x
            for x, spec in zip(inputs, graph._inputs)]


def _is_tensor(x):
    return isinstance(x, (tf.Tensor, tf.Variable))


def _tensors(args):
    return [a for a in tf.nest.flatten(args) if _is_tensor(a)]


def _first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _unvectorized_op(error):
    """The op of ERROR (tf.vectorized_map's failure) that TensorFlow could not vectorize, and why."""
    text = str(error)
    found = re.search(r"No pfor vectorization defined for (\w+)", text)
    if found:
        return f"op {found.group(1)} (TensorFlow has no vectorization for it)"
    found = re.search(r'Input "(\w+)" of op \'(\w+)\' expected to be loop invariant', text)
    if found:
        return f"op {found.group(2)} (its {found.group(1)} would differ per learner; TensorFlow vectorizes it only when shared)"
    # pfor's errors open with "in user code:" and the traceback; the message is the first "...Error:" line.
    lines = [line.strip() for line in text.splitlines() if re.match(r"\s*\w+(Error|Exception): ", line)]
    return lines[0][:300] if lines else _first_line(error)


def _register_stateless_random_converters():
    """Lets tf.vectorized_map convert the stateless random ops Keras's TensorFlow backend draws with
    (Dropout, GaussianNoise, ...): TensorFlow converts their V1 ops with a loop over the learners
    for that op alone (each learner's numbers from its own seed); the V2 ops get the same converter."""
    from tensorflow.python.ops.parallel_for import pfor
    for op_type in ("StatelessRandomGetKeyCounter", "StatelessRandomUniformV2", "StatelessRandomNormalV2",
                    "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2"):
        if op_type not in pfor._pfor_converter_registry:
            pfor.RegisterPFor(op_type)(pfor._convert_stateless_multinomial)


_register_stateless_random_converters()


def _with_masks(layer, args, kwargs):
    """KWARGS with the mask arguments Keras's Layer.__call__ fills in from the inputs' masks, and the
    mask it passes on to compute_mask (the call's mask, else the first input's)."""
    spec = CallSpec(layer._call_signature, layer._call_context_args, args, dict(kwargs))
    tensor_args = spec.tensor_arguments_dict
    if len(tensor_args) == 1 and "mask" in spec.argument_names and spec.arguments_dict["mask"] is None:
        mask = tf.nest.map_structure(get_keras_mask, next(iter(tensor_args.values())))
        if any(m is not None for m in tf.nest.flatten(mask)):
            kwargs["mask"] = mask
    elif len(tensor_args) > 1:
        for name, value in tensor_args.items():
            if f"{name}_mask" in spec.argument_names and spec.arguments_dict[f"{name}_mask"] is None:
                mask = tf.nest.map_structure(get_keras_mask, value)
                if any(m is not None for m in tf.nest.flatten(mask)):
                    kwargs[f"{name}_mask"] = mask
    if kwargs.get("mask") is not None:
        return kwargs, kwargs["mask"]
    first = spec.first_arg
    return kwargs, None if first is None or not _is_tensor(first) else get_keras_mask(first)


class _training_context:
    """The call context of a training step around LAYER's own call, so that layers it calls without
    a training argument train, as they do under Keras's Layer.__call__(training=True)."""

    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        self.outer = global_state.get_global_attribute("current_call_ctx")
        context = CallContext(entry_layer=self.layer)
        context.set_value("training", True)
        global_state.set_global_attribute("current_call_ctx", context)

    def __exit__(self, *exc):
        global_state.set_global_attribute("current_call_ctx", self.outer)
        return False


def _cast_seed(seed):
    # The same seed conversion as Keras's TensorFlow backend, so masks match the replicated path.
    from keras.src.backend.tensorflow.random import _cast_seed as keras_cast_seed
    return keras_cast_seed(seed)


class FusedLearners:
    """Gradients of M learners of MODEL computed as one grouped computation (see module doc)."""

    fused = True

    def __init__(self, model, loss):
        graph = _graph_of(model)
        _check_graph(graph)
        self.model, self.graph, self.loss = model, graph, loss
        self.per_example_loss = per_example_loss_fn(loss)
        # Set when a layer failed in the fused computation (see PerLearnerCallFailed): the learners
        # then run replicated, through this.
        self._replicated = None
        self._trainable_position = {id(v): i for i, v in enumerate(model.trainable_variables)}
        self._state_position = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        # Layers the generic form ran once per learner (TensorFlow could not vectorize an op): name -> why.
        self._not_vectorized = {}
        # The convolution form chosen when the engine is built (a test's or benchmark's forcing)
        # holds for every trace of its steps.
        self._forced_conv_form = conv_forms.forced()
        self.conv_forms = {}   # compute dtype name (+ " dilated") -> (form, why), for the convolutions traced so far

    # ---- layouts ---------------------------------------------------------------------------
    # A fused tensor of rank 3 is (m, b, F); of rank 4 to 7, (b, ..., m, C) with the learners second
    # to last.
    @staticmethod
    def _learner_axis(rank):
        return 0 if rank == 3 else rank - 2

    @staticmethod
    def _to_fused(x):
        """(m, b, ...) stacked per-learner tensor -> fused layout."""
        rank = len(x.shape)
        if rank >= 4:
            return tf.transpose(x, list(range(1, rank - 1)) + [0, rank - 1])
        return x

    @staticmethod
    def _to_stacked(x):
        rank = len(x.shape)
        if rank >= 4:
            return tf.transpose(x, [rank - 2] + list(range(rank - 2)) + [rank - 1])
        return x

    @staticmethod
    def _leading_shape(x, axes):
        return [x.shape[a] if x.shape[a] is not None else tf.shape(x)[a] for a in range(axes)]

    def _merge(self, x):   # (b, ..., m, C) -> (b, ..., m*C)
        return tf.reshape(x, self._leading_shape(x, len(x.shape) - 2) + [x.shape[-2] * x.shape[-1]])

    def _split(self, x, m):   # (b, ..., m*C) -> (b, ..., m, C)
        return tf.reshape(x, self._leading_shape(x, len(x.shape) - 1) + [m, x.shape[-1] // m])

    def _learner_slice(self, x, i):
        return x[i] if len(x.shape) == 3 else x[..., i, :]

    def _stack_learners(self, slices):
        """The fused tensor of the single-learner tensors SLICES."""
        return tf.stack(slices, axis=self._learner_axis(len(slices[0].shape) + 1))

    # ---- layers ----------------------------------------------------------------------------
    def _w(self, variable):
        """The learners' stack of VARIABLE: trainable, or frozen (kept with the non-trainable state)
        as this step has left it so far (a layer used twice sees its first use's update)."""
        index = self._trainable_position.get(id(variable))
        value = self._weights[index] if index is not None else self._new_states[self._state_position[id(variable)]]
        # Keras casts only variables created with autocast=True (not BatchNorm's, for example).
        if (self._read_dtype is not None and getattr(variable, "_autocast", True) and value.dtype.is_floating
                and value.dtype != self._read_dtype):
            return tf.cast(value, self._read_dtype)
        return value

    def _grouped_conv(self, layer, x, kernel, strides, dilations, padding):
        """The learners' convolution of merged X with their stacked KERNEL (m, kh, kw, C, O), bias and
        activation: one grouped convolution (see module doc)."""
        m = self._m
        kh, kw, c, o = kernel.shape[1:]
        kernel = tf.reshape(tf.transpose(kernel, [1, 2, 3, 0, 4]), [kh, kw, c, m * o])
        dilated = any(rate > 1 for rate in ([dilations] if isinstance(dilations, int) else dilations))
        y = conv_forms.convolve(self._conv_form(x.dtype, dilated), x, kernel, m, strides, padding, dilations)
        if layer.use_bias:
            y = tf.nn.bias_add(y, tf.reshape(self._w(layer.bias), [m * o]))
        if layer.activation in _ELEMENTWISE_ACTIVATIONS:
            return self._split(layer.activation(y), m)
        return layer.activation(self._split(y, m))

    def _conv_form(self, dtype, dilated):
        key = dtype.name + (" dilated" if dilated else "")
        if key not in self.conv_forms:
            self.conv_forms[key] = conv_forms.choose(dtype, learner_device_type(), self._forced_conv_form, dilated)
            if self.conv_forms[key][0] != conv_forms.GROUPED:
                log.info("crossbow_tf: the learners' %s convolutions: %s", key, self.conv_forms[key][1])
        return self.conv_forms[key][0]

    def _apply(self, layer, args, kwargs):
        if _is_submodel(layer):
            return self._run(_graph_of(layer), _tensors(args))
        if not isinstance(layer, keras.layers.Layer):
            # A keras.ops operation of the graph (the masks an Embedding computes, for example).
            return self._generic(layer, args, kwargs)
        kwargs, previous_mask = _with_masks(layer, args, dict(kwargs))
        args, kwargs = tf.nest.map_structure(lambda x: _layer_input(layer, x) if _is_tensor(x) else x,
                                             (args, kwargs))
        dtype = _weight_dtype(layer)
        self._read_dtype = None if dtype is None else tf.as_dtype(dtype)
        name, _, apply = form_of(layer, [len(t.shape) - 1 for t in _tensors(args)])
        try:
            with AutocastScope(dtype):
                outputs = apply(self, layer, args, kwargs)
        finally:
            self._read_dtype = None
        if layer.supports_masking:
            self._set_output_masks(layer, args, outputs, previous_mask, generic=apply is _GENERIC_APPLY)
        return outputs

    def _set_output_masks(self, layer, args, outputs, previous_mask, generic):
        """Masks on OUTPUTS as Keras's Layer.__call__ attaches them: LAYER's compute_mask of its first
        input and that input's mask; per learner (vectorized) for the generic form."""
        first = args[0] if args else None
        if generic and first is not None:
            def one_learner(elems):
                return layer.compute_mask(elems[0], elems[1])
            # A list input (Attention's [query, value], say) has a list of masks, all None when none is set.
            if all(mask is None for mask in tf.nest.flatten(previous_mask)):
                previous_mask = None
            stacked = tf.nest.map_structure(self.to_stacked, first)
            if previous_mask is None:
                if layer.compute_mask(tf.nest.map_structure(lambda t: t[0], stacked), None) is None:
                    return
                masks = tf.vectorized_map(lambda x: layer.compute_mask(x, None), stacked,
                                          fallback_to_while_loop=False)
            else:
                masks = tf.vectorized_map(one_learner, (stacked, previous_mask), fallback_to_while_loop=False)
        else:
            masks = layer.compute_mask(first, previous_mask)
        if masks is None:
            return
        for tensor, mask in zip(tf.nest.flatten(outputs), tf.nest.flatten(masks)):
            if _is_tensor(tensor) and get_keras_mask(tensor) is None and mask is not None:
                set_keras_mask(tensor, mask)

    def _dense(self, layer, x):
        """Dense on any rank: one batched matmul of (m, b, F), else an einsum over the learner axis."""
        kernel = self._w(layer.kernel)
        if len(x.shape) == 3:
            y = _learners_matmul(x, kernel)
            bias_shape = [self._m, 1, kernel.shape[-1]]
        else:
            # Explicit subscripts: TensorFlow's gradient of an ellipsis einsum builds the whole broadcast
            # product and then sums it (9x slower steps for a transformer's sequence Dense layers).
            lead = "abcdefghij"[:len(x.shape) - 2]
            y = tf.einsum(f"{lead}mf,mfo->{lead}mo", x, kernel)
            bias_shape = [self._m, kernel.shape[-1]]
        if layer.use_bias:
            y = y + tf.reshape(self._w(layer.bias), bias_shape)
        return layer.activation(y)

    def _stored(self, variable):
        # The stack in the variable's dtype: Keras's own call casts it where it reads it.
        index = self._trainable_position.get(id(variable))
        return self._weights[index] if index is not None else self._new_states[self._state_position[id(variable)]]

    def _generic(self, layer, args, kwargs):
        """LAYER's own stateless_call vectorized over the learners, each with its own weights and
        states (seed generator states included, so each learner draws what it draws replicated).
        Where TensorFlow cannot vectorize an op, the layer runs once per learner instead."""
        is_layer = isinstance(layer, keras.layers.Layer)
        trainable, state = (layer.trainable_variables, layer.non_trainable_variables) if is_layer else ([], [])
        leaves = tf.nest.flatten((args, kwargs))
        positions = [k for k, a in enumerate(leaves) if _is_tensor(a)]
        if getattr(layer, "_call_has_training_arg", False):
            kwargs = dict(kwargs, training=True)

        def one_learner(elems):
            t_values, s_values, tensors = elems
            filled = list(tf.nest.flatten((args, kwargs)))
            for k, t in zip(positions, tensors, strict=True):
                filled[k] = t
            call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), filled)
            if not is_layer:
                return layer.call(*call_args, **call_kwargs), []
            with _training_context(layer):
                return layer.stateless_call(list(t_values), list(s_values), *call_args, **call_kwargs)
        elems = ([self._stored(v) for v in trainable], [self._stored(v) for v in state],
                 [self.to_stacked(leaves[k]) for k in positions])
        try:
            with _quiet_tensorflow_log():   # pfor logs each failed conversion at length; the notice says it once
                outputs, new_states = tf.vectorized_map(one_learner, elems, fallback_to_while_loop=False)
        except (ValueError, NotImplementedError, TypeError) as e:
            op = _unvectorized_op(e)
            self._not_vectorized[layer.name] = f"{type(layer).__name__}: {op}"
            outputs, new_states = self._once_per_learner(layer, one_learner, elems, bool(state), op)
        for variable, value in zip(state, new_states, strict=True):
            self.set_state(variable, value)
        return tf.nest.map_structure(self.to_fused, outputs)

    def _once_per_learner(self, layer, one_learner, elems, has_state, op):
        """ONE_LEARNER on each learner's slice of ELEMS, stacked: LAYER's fallback where TensorFlow
        cannot vectorize OP. Raises PerLearnerCallFailed when that fails too (the model then runs
        replicated)."""
        try:
            per_learner = [one_learner(tf.nest.map_structure(lambda t: t[i], elems)) for i in range(self._m)]
            outputs = tf.nest.map_structure(lambda *ys: tf.stack(ys), *[p[0] for p in per_learner])
            new_states = [tf.stack(values) for values in zip(*[p[1] for p in per_learner])] if has_state else []
        except Exception as failure:   # noqa: BLE001  (any failure here means: not in the fused computation)
            raise PerLearnerCallFailed(
                f"layer {layer.name!r} ({type(layer).__name__}): TensorFlow cannot vectorize its {op}, and its "
                f"call once per learner inside the fused computation failed too ({type(failure).__name__}: "
                f"{_first_line(failure)[:200]})") from failure
        return outputs, new_states

    # ---- the context of the form modules (see FORMS_API) ----------------------------------
    @property
    def m(self):
        return self._m

    def weight(self, variable):
        return self._w(variable)

    def set_state(self, variable, value):
        self._new_states[self._state_position[id(variable)]] = value

    def dropout(self, dropout_layer, x):
        return self._dropout(dropout_layer, x)

    def to_stacked(self, x):
        return self._to_stacked(x)

    def to_fused(self, x):
        return self._to_fused(x)

    def _depthwise(self, layer, x, kernel_variable, bias):
        """A depthwise convolution of every learner's channels at once: the filter of learner i's
        channel c is that learner's, so output channel (i*C + c)*d + j is learner i's c*d + j."""
        m = self._m
        kernel = self._w(kernel_variable)                               # (m, kh, kw, C, d)
        kh, kw, c, d = kernel.shape[1:]
        kernel = tf.reshape(tf.transpose(kernel, [1, 2, 0, 3, 4]), [kh, kw, m * c, d])
        y = keras.ops.depthwise_conv(self._merge(x), kernel, strides=layer.strides, padding=layer.padding,
                                     dilation_rate=layer.dilation_rate)
        if bias and layer.use_bias:
            y = tf.nn.bias_add(y, tf.reshape(self._w(layer.bias), [m * c * d]))
        if not bias:
            return self._split(y, m)
        if layer.activation in _ELEMENTWISE_ACTIVATIONS:
            return self._split(layer.activation(y), m)
        return layer.activation(self._split(y, m))

    def _per_learner(self, layer, x):
        """LAYER's own call on each learner's slice, with that learner's weights and state."""
        trainable, state = layer.trainable_variables, layer.non_trainable_variables
        outputs, new_states = [], [[] for _ in state]
        for i in range(self._m):
            y, s_new = layer.stateless_call([self._w(v)[i] for v in trainable], [self._w(v)[i] for v in state],
                                            self._learner_slice(x, i), training=True)
            outputs.append(y)
            for values, value in zip(new_states, s_new):
                values.append(value)
        for variable, values in zip(state, new_states):
            self._new_states[self._state_position[id(variable)]] = tf.stack(values)
        return self._stack_learners(outputs)

    def _batch_norm(self, layer, x):
        # As Keras's BatchNormalization: computed in float32 (at least), returned in the compute dtype.
        x = tf.cast(x, keras.backend.result_type(x.dtype, "float32"))
        return tf.cast(self._batch_norm_of(layer, x), layer.compute_dtype)

    def _batch_norm_of(self, layer, x):
        rank = len(x.shape)
        axes = [1] if rank == 3 else list(range(rank - 2))

        def per_learner(t):   # (m, C) -> broadcastable against x
            return t[:, None, :] if rank == 3 else t
        mean_idx = self._state_position[id(layer.moving_mean)]
        var_idx = self._state_position[id(layer.moving_variance)]
        moving_mean, moving_variance = self._new_states[mean_idx], self._new_states[var_idx]
        if layer.trainable:
            mean, variance = keras.ops.moments(x, axes=axes)   # (m, C): statistics per learner
            momentum = layer.momentum
            self._new_states[mean_idx] = moving_mean * momentum + mean * (1.0 - momentum)
            self._new_states[var_idx] = moving_variance * momentum + variance * (1.0 - momentum)
        else:
            mean, variance = moving_mean, moving_variance
        # The same kernel as Keras's BatchNormalization, so that rounding matches the replicated path.
        return tf.nn.batch_normalization(
            x, per_learner(mean), per_learner(variance),
            offset=per_learner(self._w(layer.beta)) if layer.center else None,
            scale=per_learner(self._w(layer.gamma)) if layer.scale else None,
            variance_epsilon=layer.epsilon)

    def _dropout(self, layer, x):
        if layer.rate <= 0:
            return x
        idx = self._state_position[id(layer.seed_generator.state)]
        state = self._new_states[idx]                             # (m, 2)
        # Each learner's keep-mask is drawn exactly as tf.nn.experimental.stateless_dropout draws it
        # from that learner's seed; then one select applies all of them.
        masks = []
        for i in range(self._m):
            x_i = self._learner_slice(x, i)
            shape = tf.shape(x_i) if layer.noise_shape is None else \
                [s if s is not None else tf.shape(x_i)[a] for a, s in enumerate(layer.noise_shape)]
            uniform = tf.random.stateless_uniform(shape, seed=_cast_seed(state[i]), dtype=x.dtype)
            masks.append(uniform >= layer.rate)
        # Keras advances a seed generator by (0, 1) per draw.
        self._new_states[idx] = state + tf.constant([0, 1], dtype=state.dtype)
        keep = self._stack_learners(masks)
        return tf.where(keep, x * tf.constant(1 / (1 - layer.rate), x.dtype), tf.constant(0, x.dtype))

    # ---- the learners ----------------------------------------------------------------------
    def _run(self, graph, inputs):
        return graph._run_through_graph(
            _graph_input(graph, inputs),
            operation_fn=lambda layer: (lambda *args, **kwargs: self._apply(layer, args, kwargs)))

    def forward(self, weights, states, x):
        """Outputs of every learner, stacked (m, b, ...), and the new states."""
        self._m = x.shape[0]
        self._weights, self._states, self._new_states = weights, states, list(states)
        self._read_dtype = None
        outputs = self._run(self.graph, [self._to_fused(t) for t in tf.nest.flatten(x)])
        outputs = tf.nest.map_structure(self._to_stacked, outputs)
        self._announce_not_vectorized()
        new_states = self._new_states
        self._weights = self._states = self._new_states = None
        return outputs, new_states

    def _announce_not_vectorized(self):
        if self._not_vectorized and self.model not in _ANNOUNCED_PER_LEARNER:
            _ANNOUNCED_PER_LEARNER.add(self.model)
            log.warning("crossbow_tf: these layers run once per learner (TensorFlow cannot vectorize an op "
                        "of theirs over the learners): %s", "; ".join(
                            f"layer {name!r} ({why})" for name, why in self._not_vectorized.items()))

    def __call__(self, weights, states, x, y, mask, scale=None):
        if self._replicated is None:
            try:
                return self._fused_call(weights, states, x, y, mask, scale)
            except PerLearnerCallFailed as failure:
                self._weights = self._states = self._new_states = None
                self._replicated = ReplicatedLearners(self.model, self.loss)
                self.fused = False
                _announce_replicated(self.model, failure)
        return self._replicated(weights, states, x, y, mask, scale)

    def _fused_call(self, weights, states, x, y, mask, scale):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            preds, new_states = self.forward(weights, states, x)
            if hasattr(self.loss, "learner_loss"):   # the model's own compute_loss, once per learner
                losses = tf.stack([self.loss.learner_loss(tf.nest.map_structure(lambda t: t[i], x), y[i], preds[i],
                                                          mask[i], [w[i] for w in weights], [s[i] for s in new_states])
                                   for i in range(x.shape[0])])
            else:
                losses = tf.stack([masked_mean(self.per_example_loss(y[i], preds[i]), mask[i])
                                   for i in range(x.shape[0])])
            total = tf.reduce_sum(losses)
            if scale is not None:   # loss scaling (float16): the gradients come back divided by SCALE
                total = total * scale
        # Each learner's loss depends only on its own slice of the stacks, so the gradient of
        # the sum is every learner's own gradient.
        grads = tape.gradient(total, weights, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return losses, unscaled(in_variable_dtypes(grads, weights), scale), new_states, preds


# Models already announced as running replicated: the notice comes once per model, not at every
# Engine (use_sma, the auto-tuner's trials and resumes each build one).
_ANNOUNCED = weakref.WeakSet()
# Models already announced as having layers that run once per learner inside the fused computation.
_ANNOUNCED_PER_LEARNER = weakref.WeakSet()


def make_learners(model, loss, mode="auto"):
    """The learner computation for MODEL: "fused", "replicated" or "auto" (fused when possible)."""
    if mode == "replicated":
        return ReplicatedLearners(model, loss)
    try:
        return FusedLearners(model, loss)
    except UnsupportedModel as e:
        if mode == "fused":
            raise
        _announce_replicated(model, e)
        return ReplicatedLearners(model, loss)


def _announce_replicated(model, why):
    if model not in _ANNOUNCED:
        _ANNOUNCED.add(model)
        log.warning("crossbow_tf: learners run replicated (one call per learner): %s", why)
