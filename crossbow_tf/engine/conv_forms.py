"""How the fused learners' convolutions run here: decided by what this machine computes, once.

The m learners' Conv2D (and Conv1D, SeparableConv2D's pointwise step) is best one grouped
convolution: input (b, H, W, m*C), filter (kh, kw, C, m*O). Whether that computes its gradients
depends on the kernels TensorFlow runs, not on a flag's name: cuDNN's do; oneDNN's do in the dtypes
oneDNN computes on this CPU (bfloat16 only with AVX-512); TensorFlow's own Eigen CPU kernels, which
run wherever oneDNN is off (TensorFlow's default on AMD CPUs, or after ``TF_ENABLE_ONEDNN_OPTS=0``),
compute none in any dtype. So a tiny probe (conv, bias, ReLU and their gradients, compiled as the
step is) is run once per process for each device type, dtype and form, and the first form that
computes serves:

- ``grouped``: one grouped convolution in the compute dtype;
- ``grouped-float32``: the grouped convolution computed in float32, cast from and back to the
  compute dtype (a mixed-precision policy on a CPU whose oneDNN covers only float32);
- ``per-learner``: one convolution per learner inside the one fused computation (every kernel
  library has these, but TensorFlow's own CPU kernels compute no gradient of a dilated one); the
  rest of the model stays fused;
- ``patches``: no convolution op at all: the input's kh*kw shifted views stacked and contracted with
  every learner's filter in one einsum (a batched matmul over the learners), so every kernel
  library that multiplies matrices in the dtype computes it and its gradients, dilated or not.

Where none computes (no kernel for the dtype at all), the engine refuses before training in one line.
``CROSSBOW_TF_CONV_FORM=<form>`` (or ``forcing(form)`` in tests and benchmarks) chooses a form
instead of the probe, as long as it computes here.
"""
import contextlib
import logging
import os
import re

import tensorflow as tf

from crossbow_tf.errors import ConfigError

GROUPED = "grouped"
GROUPED_FLOAT32 = "grouped-float32"
PATCHES = "patches"
PER_LEARNER = "per-learner"
# In the order the probe tries them: the faster first where both compute (docs/performance.md: on
# TensorFlow's Eigen kernels per-learner ran LeNet's learners about 3x faster than patches, which
# serves where per-learner does not compute, a dilated convolution's gradients there).
FORMS = (GROUPED, GROUPED_FLOAT32, PER_LEARNER, PATCHES)
FORM_VARIABLE = "CROSSBOW_TF_CONV_FORM"

_PROBE_LEARNERS = 2
_probed = {}      # (device type, dtype name, form, dilated) -> None when it computes, else TensorFlow's reason
_forced = []      # the innermost forcing(form) last


class NoConvolutionForm(ConfigError):
    """No form of the learners' convolution computes the policy's dtype on this machine."""


@contextlib.contextmanager
def quiet_tensorflow_log():
    """TensorFlow's Python warnings held back (its retracing warning for the probes' tiny functions)."""
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def onednn_enabled():
    """True when TensorFlow runs oneDNN kernels in this process."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return False
    return bool(_pywrap_util_port.IsMklEnabled())


def cpu_flags():
    """The CPU's feature flags (Linux's /proc/cpuinfo), empty where the system does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_summary():
    """This CPU in a few words: whether it has AVX-512 (and its bfloat16 and float16 parts)."""
    flags = cpu_flags()
    if not flags:
        return "CPU flags unknown"
    wanted = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
    present = [f for f in wanted if f in flags]
    return "AVX-512 (" + ", ".join(present) + ")" if "avx512f" in flags else "no AVX-512 (AVX2 at best)"


def _error_line(error):
    """TensorFlow's own reason in ERROR's message: not its 'Graph execution error' frame lines."""
    lines = [line.strip() for line in getattr(error, "message", str(error)).splitlines()]
    reasons = [line for line in lines if line and not line.startswith(("Graph execution error", "Detected at node",
                                                                        "File ", "[[", "[Op:"))]
    return re.sub(r"\s*\[\[.*", "", reasons[-1] if reasons else str(error)).strip()


def _pair(value):
    """(height, width) of a conv2d stride or dilation given as tf.nn.conv2d takes it: n, [n], [h, w] or [1, h, w, 1]."""
    values = [value] if isinstance(value, int) else list(value)
    if len(values) == 4:
        values = values[1:3]
    return (values[0], values[0]) if len(values) == 1 else tuple(values)


def _same_padding(size, kernel, stride, dilation):
    # As TensorFlow pads for "SAME": the output has ceil(size / stride) positions, the extra row at the end.
    total = max((-(-size // stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return [total // 2, total - total // 2]


def patches_convolution(x, kernel, m, strides, padding, dilations):
    """The grouped convolution as kh*kw shifted (strided, dilated) views of X contracted with each learner's
    filter: (b, H', W', kh*kw, m, C) x (kh*kw, C, m, O) -> (b, H', W', m*O)."""
    kh, kw, c, mo = kernel.shape
    (sh, sw), (dh, dw) = _pair(strides), _pair(dilations)
    if padding == "SAME":
        x = tf.pad(x, [[0, 0], _same_padding(x.shape[1], kh, sh, dh), _same_padding(x.shape[2], kw, sw, dw), [0, 0]])
    height, width = x.shape[1], x.shape[2]
    out_h, out_w = (height - (kh - 1) * dh - 1) // sh + 1, (width - (kw - 1) * dw - 1) // sw + 1
    views = [x[:, i * dh:i * dh + (out_h - 1) * sh + 1:sh, j * dw:j * dw + (out_w - 1) * sw + 1:sw, :]
             for i in range(kh) for j in range(kw)]
    patches = tf.reshape(tf.stack(views, axis=3), [-1, out_h, out_w, kh * kw, m, c])
    y = tf.einsum("bhwtmc,tcmo->bhwmo", patches, tf.reshape(kernel, [kh * kw, c, m, mo // m]))
    return tf.reshape(y, [-1, out_h, out_w, mo])


def convolve(form, x, kernel, m, strides, padding, dilations):
    """The learners' convolution of merged X (b, H, W, m*C) with grouped KERNEL (kh, kw, C, m*O) in FORM."""
    if form == PATCHES:
        return patches_convolution(x, kernel, m, strides, padding, dilations)
    if form == PER_LEARNER:
        return tf.concat([tf.nn.conv2d(x_i, k_i, strides=strides, padding=padding, dilations=dilations)
                          for x_i, k_i in zip(tf.split(x, m, axis=-1), tf.split(kernel, m, axis=-1))], -1)
    if form == GROUPED_FLOAT32 and x.dtype != tf.float32:
        y = tf.nn.conv2d(tf.cast(x, tf.float32), tf.cast(kernel, tf.float32), strides=strides, padding=padding,
                         dilations=dilations)
        return tf.cast(y, x.dtype)
    return tf.nn.conv2d(x, kernel, strides=strides, padding=padding, dilations=dilations)


def _probe(device_type, dtype, form, dilated):
    """None when FORM's convolution (DILATED: with dilation 2), bias and ReLU and their gradients compute in
    DTYPE on DEVICE_TYPE (in a tf.function, where TensorFlow's graph optimiser fuses them as in the step),
    else why not."""
    m = _PROBE_LEARNERS
    with tf.init_scope(), tf.device(f"/{device_type}:0"):
        x = tf.reshape(tf.range(2 * 5 * 5 * m * 3, dtype=tf.float32) / 100.0, (2, 5, 5, m * 3))
        kernel = tf.reshape(tf.range(3 * 3 * 3 * m * 4, dtype=tf.float32) / 100.0, (3, 3, 3, m * 4))
        bias = tf.ones((m * 4,))

        @tf.function(autograph=False)
        def gradients(x, kernel, bias):
            y = convolve(form, tf.cast(x, dtype), tf.cast(kernel, dtype), m, 1, "SAME", 2 if dilated else 1)
            y = tf.nn.relu(tf.nn.bias_add(y, tf.cast(bias, dtype)))
            loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
            # Graph gradients, not a tape: init_scope pauses every tape, and the probe may run while
            # the engine's step is being traced.
            return tf.gradients(loss, [x, kernel, bias])
        try:
            grads = gradients(x, kernel, bias)
            if not all(bool(tf.reduce_all(tf.math.is_finite(g))) and bool(tf.reduce_any(g != 0)) for g in grads):
                return "its gradients came out zero or not finite"
        except (tf.errors.OpError, ValueError, TypeError) as e:
            return _error_line(e)
    return None


def why_not(device_type, dtype, form, dilated=False):
    """None when FORM computes the learners' convolution (DILATED: with a dilation rate above 1, which
    TensorFlow's own CPU kernels compute no gradients of) and its gradients in DTYPE here, else why not
    (probed once per process)."""
    key = (device_type, tf.as_dtype(dtype).name, form, bool(dilated))
    if key not in _probed:
        with quiet_tensorflow_log():
            _probed[key] = _probe(device_type, tf.as_dtype(dtype), form, bool(dilated))
    return _probed[key]


def forced():
    """The form a test or benchmark (forcing) or CROSSBOW_TF_CONV_FORM chooses, else None (probe)."""
    if _forced:
        return _forced[-1]
    value = os.environ.get(FORM_VARIABLE, "").strip()
    if value and value not in FORMS:
        raise ConfigError(f"{FORM_VARIABLE}={value!r}: not a convolution form; choose one of {', '.join(FORMS)} "
                          "or leave it unset")
    return value or None


@contextlib.contextmanager
def forcing(form):
    """Engines built inside use FORM for their convolutions (when it computes here) instead of the probe's."""
    if form is not None and form not in FORMS:
        raise ValueError(f"convolution form {form!r}: choose one of {', '.join(FORMS)}")
    _forced.append(form)
    try:
        yield
    finally:
        _forced.pop()


def choose(dtype, device_type, form=None, dilated=False):
    """(form, why): the form the learners' convolutions (DILATED: with a dilation rate above 1) take in
    DTYPE on DEVICE_TYPE ('CPU' or 'GPU'): FORM when given (forced), else the first of FORMS that computes
    here. Raises NoConvolutionForm, naming the CPU, the dtype and the way out, where none does."""
    dtype = tf.as_dtype(dtype)
    where = "this CPU" if device_type == "CPU" else f"this {device_type}"
    if form is not None:
        problem = why_not(device_type, dtype, form, dilated)
        if problem:
            raise NoConvolutionForm(f"the learners' convolution in the {form} form (chosen by {FORM_VARIABLE} or "
                                    f"forcing) computes no {dtype.name} gradients on {where}: {problem}; "
                                    f"unset it to let the engine choose")
        return form, f"{form}: chosen, not probed"
    candidates = [f for f in FORMS if f != GROUPED_FLOAT32 or dtype != tf.float32]
    problems = {}
    for candidate in candidates:
        problems[candidate] = why_not(device_type, dtype, candidate, dilated)
        if problems[candidate] is None:
            return candidate, _why(candidate, dtype, device_type, problems)
    raise NoConvolutionForm(
        f"no form of the learners' convolution computes {dtype.name} gradients on {where} ({cpu_summary()}; "
        f"{kernels(device_type)}): {problems[PER_LEARNER]}; train with precision float32, or on a CPU with AVX-512")


def kernels(device_type):
    """The kernel library that computes the learners' convolutions on DEVICE_TYPE in this process."""
    if device_type != "CPU":
        return "cuDNN" if device_type == "GPU" else device_type
    return "oneDNN" if onednn_enabled() else "TensorFlow's Eigen kernels (oneDNN is off in this process)"


def _why(form, dtype, device_type, problems):
    tried = "; ".join(f"{f} does not ({problem})" for f, problem in problems.items() if problem)
    text = {GROUPED: f"one grouped convolution of all learners in {dtype.name}",
            GROUPED_FLOAT32: f"one grouped convolution of all learners in float32, cast from and to {dtype.name}",
            PATCHES: f"the input's shifted views times every learner's filter, one {dtype.name} einsum",
            PER_LEARNER: f"one {dtype.name} convolution per learner inside the fused computation"}[form]
    summary = f", {cpu_summary()}" if device_type == "CPU" else ""
    return f"{form}: {text}, computed by {kernels(device_type)}{summary}" + (f"; {tried}" if tried else "")
