"""The registry of fused forms: each form says once which layers it takes and how it applies them.

A form is (name, reason, apply): ``reason(layer, input_ranks)`` is None when the form takes LAYER used
on inputs of those single-learner ranks, else a short reason; ``apply(ctx, layer, args, kwargs)`` is
LAYER's output for all learners in fused layout (ctx: FusedLearners, see docs of FORMS_API). The first
form whose reason is None applies the layer; hand-written forms come before the generic one, which
takes any remaining layer (its own ``stateless_call`` vectorized over the learners).
"""
import importlib
import inspect

import keras
import numpy as np
import tensorflow as tf
from keras import layers as L
# Not exported by Keras: the base of every image preprocessing and augmentation layer it ships.
from keras.src.layers.preprocessing.image_preprocessing.base_image_preprocessing_layer import (
    BaseImagePreprocessingLayer)

from crossbow_tf.engine import conv_forms
from crossbow_tf.engine.conv_forms import onednn_enabled  # noqa: F401 (re-exported)

ELEMENTWISE = (L.Activation, L.ReLU, L.LeakyReLU, L.ELU, L.Softmax, L.Add, L.Subtract, L.Multiply,
               L.Average, L.Maximum, L.Minimum)
MERGES = (L.Add, L.Subtract, L.Multiply, L.Average, L.Maximum, L.Minimum, L.Concatenate)
POOLING = (L.MaxPooling2D, L.AveragePooling2D, L.MaxPooling1D, L.AveragePooling1D)
GLOBAL_POOLING = (L.GlobalAveragePooling2D, L.GlobalMaxPooling2D, L.GlobalAveragePooling1D, L.GlobalMaxPooling1D)
NOT_HERE = "not this form's layer"


def learners_on_cpu():
    return not tf.config.list_logical_devices("GPU")


def learner_device_type():
    return "CPU" if learners_on_cpu() else "GPU"


def _tensors(args):
    return [a for a in tf.nest.flatten(args) if isinstance(a, (tf.Tensor, tf.Variable))]


def _conv_reason(layer, paddings):
    if layer.padding not in paddings:
        return f"padding {layer.padding!r} is not fused"
    # A form of the convolution that computes here, probed now, before training (raises where none does).
    conv_forms.choose(layer.compute_dtype, learner_device_type(), conv_forms.forced(),
                      dilated=any(rate > 1 for rate in layer.dilation_rate))
    return None


# ---- hand-written forms: reason(layer, input_ranks) -------------------------------------------
def _reason_preprocessing(layer, ranks):
    return None if isinstance(layer, BaseImagePreprocessingLayer) else NOT_HERE


def _reason_conv(layer, ranks):
    if type(layer) in (L.Conv2D, L.Conv1D):
        if layer.groups != 1:
            return f"grouped {type(layer).__name__} is not fused"
        return _conv_reason(layer, ("valid", "same", "causal") if type(layer) is L.Conv1D else ("valid", "same"))
    if type(layer) is L.SeparableConv2D:
        return _conv_reason(layer, ("valid", "same"))
    if type(layer) is L.DepthwiseConv2D:
        return None if layer.padding in ("valid", "same") else f"padding {layer.padding!r} is not fused"
    return NOT_HERE


def _reason_shape_layers(layer, ranks):
    if type(layer) in (L.Dense, L.Flatten, L.Dropout, L.ZeroPadding2D, L.ZeroPadding1D) + POOLING + GLOBAL_POOLING:
        return "keepdims=True is not fused" if getattr(layer, "keepdims", False) else None
    return NOT_HERE


def _reason_batch_norm(layer, ranks):
    if type(layer) is not L.BatchNormalization:
        return NOT_HERE
    if layer.renorm or layer.synchronized:
        return "renorm/synchronized BatchNormalization is not fused"
    rank = ranks[0] if ranks else None
    if rank is not None and layer.axis not in (-1, rank - 1):
        return f"BatchNormalization over axis {layer.axis} of a rank-{rank} tensor (only the last) is not fused"
    return None


def _reason_merge_and_elementwise(layer, ranks):
    if type(layer) is L.Concatenate:
        return None if layer.axis == -1 else "Concatenate along an axis other than the last is not fused"
    if type(layer) is L.Rescaling:
        # A scale or offset per channel broadcasts against the last axis in every layout; one with
        # more axes would meet the learner axis.
        if any(np.ndim(value) > 1 for value in (layer.scale, layer.offset)):
            return "a scale or offset with more than one axis is not fused"
        return None
    if type(layer) is L.Normalization:
        rank = ranks[0] if ranks else None
        if rank is not None and not {a % rank for a in layer.axis} <= {rank - 1}:
            return (f"Normalization keeping axes {tuple(layer.axis)} of a rank-{rank} tensor (only the last, "
                    "or none) is not fused")
        return None
    if type(layer) in ELEMENTWISE:
        return None if not isinstance(layer, L.Softmax) or layer.axis in (-1, [-1]) else \
            "Softmax along an axis other than the last is not fused"
    return NOT_HERE


# ---- hand-written forms: apply(ctx, layer, args, kwargs) ---------------------------------------
def _apply_preprocessing(ctx, layer, args, kwargs):
    return ctx._per_learner(layer, _tensors(args)[0])


def _apply_conv(ctx, layer, args, kwargs):
    x = _tensors(args)[0]
    if isinstance(layer, L.DepthwiseConv2D):
        return ctx._depthwise(layer, x, layer.kernel, bias=True)
    if isinstance(layer, L.SeparableConv2D):
        y = ctx._merge(ctx._depthwise(layer, x, layer.depthwise_kernel, bias=False))
        return ctx._grouped_conv(layer, y, ctx.weight(layer.pointwise_kernel), 1, 1, "VALID")
    if isinstance(layer, L.Conv1D):
        if layer.padding == "causal":
            x = tf.pad(x, [[0, 0], [layer.dilation_rate[0] * (layer.kernel_size[0] - 1), 0], [0, 0], [0, 0]])
        # As Keras's TensorFlow backend computes a 1-D convolution: a 2-D one of height 1.
        x = tf.expand_dims(ctx._merge(x), 1)
        kernel = tf.expand_dims(ctx.weight(layer.kernel), 1)                # (m, 1, k, C, O)
        padding = "VALID" if layer.padding == "causal" else layer.padding.upper()
        y = ctx._grouped_conv(layer, x, kernel, (1,) + tuple(layer.strides), (1,) + tuple(layer.dilation_rate),
                              padding)
        return tf.squeeze(y, 1)
    return ctx._grouped_conv(layer, ctx._merge(x), ctx.weight(layer.kernel), layer.strides,
                             layer.dilation_rate, layer.padding.upper())


def _apply_shape_layers(ctx, layer, args, kwargs):
    x, m = _tensors(args)[0], ctx.m
    if isinstance(layer, L.Dense):
        return ctx._dense(layer, x)
    if isinstance(layer, L.Dropout):
        return ctx.dropout(layer, x)
    if isinstance(layer, L.Flatten):
        if len(x.shape) == 3:
            return x
        y = ctx.to_stacked(x)
        return tf.reshape(y, [m, tf.shape(y)[1], int(np.prod(y.shape[2:]))])
    if isinstance(layer, POOLING):
        pool = tf.nn.max_pool if isinstance(layer, (L.MaxPooling2D, L.MaxPooling1D)) else tf.nn.avg_pool
        return ctx._split(pool(ctx._merge(x), layer.pool_size, layer.strides, layer.padding.upper()), m)
    if isinstance(layer, GLOBAL_POOLING):
        average = isinstance(layer, (L.GlobalAveragePooling2D, L.GlobalAveragePooling1D))
        # Keras's mean, which accumulates low-precision inputs in float32.
        reduce = keras.ops.mean if average else keras.ops.max
        return tf.transpose(reduce(x, axis=list(range(1, len(x.shape) - 2))), [1, 0, 2])
    if isinstance(layer, L.ZeroPadding2D):
        (top, bottom), (left, right) = layer.padding
        return tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0], [0, 0]])
    left, right = layer.padding
    return tf.pad(x, [[0, 0], [left, right], [0, 0], [0, 0]])


def _apply_batch_norm(ctx, layer, args, kwargs):
    return ctx._batch_norm(layer, _tensors(args)[0])


def _apply_merge_and_elementwise(ctx, layer, args, kwargs):
    inputs = _tensors(args)
    return layer.call(list(inputs)) if isinstance(layer, MERGES) else layer.call(inputs[0])


# ---- forms of other modules, imported when first asked ----------------------------------------
def _module_form(module_name):
    """(reason, apply) of the form module MODULE_NAME (reason, apply per FORMS_API); a module that is
    absent takes no layer."""
    def module():
        try:
            return importlib.import_module(module_name)
        except ImportError:
            return None

    def reason(layer, ranks):
        found = module()
        return f"{module_name} is not installed" if found is None else found.reason(layer)

    def apply(ctx, layer, args, kwargs):
        return module().apply(ctx, layer, args, kwargs)
    reason.from_module = True
    return reason, apply


# ---- the generic form ---------------------------------------------------------------------------
def _reason_generic(layer, ranks):
    if isinstance(layer, keras.Model):
        return "a nested model is walked, not applied"
    if not isinstance(layer, (keras.layers.Layer, keras.Operation)):
        return "it is neither a Keras layer nor a Keras operation"
    if _adds_losses(layer):
        return "it adds losses with add_loss, which the vectorized call does not collect per learner"
    return None


def _adds_losses(layer):
    """Whether LAYER's class (or a layer class it holds) calls add_loss in its own code: its losses
    are the model's, and a vectorized stateless_call would drop them."""
    classes = {type(layer)} | {type(sub) for sub in getattr(layer, "_flatten_layers", lambda: [])()}
    for cls in classes:
        if cls.__module__.startswith("keras."):
            continue
        try:
            if "add_loss" in inspect.getsource(cls):
                return True
        except (OSError, TypeError):   # no source to read (built in C, made in a notebook cell)
            continue
    return False


def apply_generic(ctx, layer, args, kwargs):
    return ctx._generic(layer, args, kwargs)


def _registry():
    sequence = _module_form("crossbow_tf.engine.fused_sequence")
    recurrent = _module_form("crossbow_tf.engine.fused_recurrent")
    return (
        ("image preprocessing, per learner", _reason_preprocessing, _apply_preprocessing),
        ("grouped convolution", _reason_conv, _apply_conv),
        ("dense, dropout, flatten, pooling, padding", _reason_shape_layers, _apply_shape_layers),
        ("batch normalization per learner", _reason_batch_norm, _apply_batch_norm),
        ("merges and elementwise layers", _reason_merge_and_elementwise, _apply_merge_and_elementwise),
        ("sequence layers", sequence[0], sequence[1]),
        ("recurrent layers", recurrent[0], recurrent[1]),
        ("generic: the layer's stateless_call vectorized over the learners", _reason_generic, apply_generic),
    )


FORMS = _registry()
_REGULARIZERS = ("kernel_regularizer", "bias_regularizer", "activity_regularizer",
                 "gamma_regularizer", "beta_regularizer", "depthwise_regularizer", "pointwise_regularizer")


def why_unsupported(layer, input_ranks=()):
    """None when some form takes LAYER on inputs of INPUT_RANKS, else the reason."""
    if isinstance(layer, L.InputLayer):
        return None
    for name in _REGULARIZERS:
        if getattr(layer, name, None) is not None:
            return f"it has a {name.replace('_', ' ')}"
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return "only channels_last is fused"
    return form_of(layer, input_ranks)[1]


def form_of(layer, input_ranks=()):
    """(name, None, apply) of the first form that takes LAYER, or (None, reason, None).

    A layer of a hand-written form here that rejects its configuration (a grouped Conv2D, say) is
    not fused: the generic form would vectorize the very ops that form avoids. A form module's
    rejection passes the layer on to the generic form."""
    for name, reason_fn, apply_fn in FORMS:
        reason = reason_fn(layer, input_ranks)
        if reason is None:
            return name, None, apply_fn
        if reason != NOT_HERE and not getattr(reason_fn, "from_module", False):
            return None, reason, None
    return None, "it has no fused form", None
