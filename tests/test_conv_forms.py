"""The fused learners' convolution forms (crossbow_tf/engine/conv_forms.py, issue 43): each form's output
and gradients against one float64 convolution per learner; the probe's choice on the kinds of CPU
kernels there are (oneDNN with AVX-512 here, oneDNN without bfloat16 under ONEDNN_MAX_CPU_ISA=AVX2,
TensorFlow's Eigen kernels under TF_ENABLE_ONEDNN_OPTS=0, each set before TensorFlow loads, so in a
fresh interpreter); forcing a form; the one-line refusal where no form computes."""
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.engine import conv_forms
from crossbow_tf.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNERS = 3
# Strides, padding and dilations as the fused Conv2D and Conv1D (a height-1 Conv2D) pass them.
GEOMETRIES = [((9, 8), (3, 3), 1, "SAME", 1), ((9, 8), (5, 3), (2, 1), "SAME", 1), ((10, 11), (3, 2), 2, "VALID", 1),
              ((10, 11), (3, 3), 1, "SAME", (2, 2)), ((1, 11), (1, 3), (1, 2), "VALID", (1, 2)),
              ((8, 8), (4, 4), 3, "SAME", 1)]
# Relative to the largest value: bfloat16 keeps 8 significand bits.
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def results(form, dtype, x, kernel, strides, padding, dilations):
    """FORM's output and its gradients of sum(y^2) with respect to X and KERNEL, in DTYPE, as float64."""
    xt, kt = tf.constant(x, dtype), tf.constant(kernel, dtype)
    with tf.GradientTape() as tape:
        tape.watch([xt, kt])
        y = conv_forms.convolve(form, xt, kt, LEARNERS, strides, padding, dilations)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
    return [tf.cast(t, tf.float64).numpy() for t in [y] + tape.gradient(loss, [xt, kt])]


def per_learner_float64(x, kernel, strides, padding, dilations):
    """The reference: each learner's own channels convolved with its own filter by TensorFlow's float64
    kernel, the gradients by the tape, with no grouping anywhere."""
    xs, ks = np.split(x, LEARNERS, axis=-1), np.split(kernel, LEARNERS, axis=-1)
    outputs, x_grads, k_grads = [], [], []
    dh, dw = conv_forms._pair(dilations)
    for x_i, k_i in zip(xs, ks):
        # TensorFlow's float64 CPU kernels take no dilation: the filter dilated with zeros instead.
        kh, kw, c, o = k_i.shape
        dilated = np.zeros(((kh - 1) * dh + 1, (kw - 1) * dw + 1, c, o))
        dilated[::dh, ::dw] = k_i
        xt, kt = tf.constant(x_i), tf.constant(dilated)
        with tf.GradientTape() as tape:
            tape.watch([xt, kt])
            y = tf.nn.conv2d(xt, kt, strides=strides, padding=padding)
            loss = tf.reduce_sum(y ** 2)
        gx, gk = tape.gradient(loss, [xt, kt])
        outputs.append(y.numpy()), x_grads.append(gx.numpy()), k_grads.append(gk.numpy()[::dh, ::dw])
    return [np.concatenate(parts, -1) for parts in (outputs, x_grads, k_grads)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", conv_forms.FORMS)
def test_every_form_that_computes_here_equals_float64_per_learner(form, dtype):
    # That a form does not compute here is the probe's business (the tests below say which forms each
    # kind of CPU kernel computes); a form the probe accepts must compute every geometry right.
    rng = np.random.default_rng(0)
    compared = 0
    for (h, w), (kh, kw), strides, padding, dilations in GEOMETRIES:
        if conv_forms.why_not("CPU", dtype, form, dilated=conv_forms._pair(dilations) != (1, 1)):
            assert form != conv_forms.PATCHES    # computes wherever matrices multiply
            continue
        compared += 1
        x = rng.normal(size=(2, h, w, LEARNERS * 2))
        kernel = rng.normal(size=(kh, kw, 2, LEARNERS * 4))
        want = per_learner_float64(x, kernel, strides, padding, dilations)
        got = results(form, dtype, x, kernel, strides, padding, dilations)
        for name, g, r in zip(("output", "input gradient", "filter gradient"), got, want, strict=True):
            assert g.shape == r.shape, name
            assert np.abs(g - r).max() <= TOLERANCE[dtype] * np.abs(r).max(), (name, form, dtype, strides, padding)
    assert compared or form != conv_forms.PER_LEARNER   # every kernel library has undilated convolutions


def test_learners_do_not_mix_in_the_patches_form():
    # A learner whose filter is zero gets zero output and zero filter gradient, whatever the others hold.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 7, 7, LEARNERS * 2))
    kernel = rng.normal(size=(3, 3, 2, LEARNERS * 4))
    kernel[..., 4:8] = 0.0
    y, _, grad_k = results(conv_forms.PATCHES, "float32", x, kernel, 1, "SAME", 1)
    assert np.all(y[..., 4:8] == 0) and np.all(np.abs(y[..., :4]) > 0).any()
    assert np.all(grad_k[..., 4:8] == 0)


@functools.cache
def variant_run(first, emulated):
    """stdout of tests/import_order_run.py in a fresh interpreter that imports FIRST ("keras" or
    "crossbow") first, under EMULATED (the environment variables of EMULATE, or none)."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, os.path.join(REPO, "tests", "import_order_run.py"), first],
                         env=dict(inherited, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **EMULATE[emulated]),
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "learners run replicated" not in out.stderr
    return out.stdout


# A CPU without AVX-512, on any CPU: there TensorFlow leaves oneDNN off when keras comes first (its Eigen
# kernels), and crossbow_tf's import turns it on without bfloat16.
EMULATE = {None: {}, "eigen": {"TF_ENABLE_ONEDNN_OPTS": "0"}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}


def choices(first, emulated):
    return {line.split()[1]: line.split(" ", 1)[1] for line in variant_run(first, emulated).splitlines()
            if line.startswith("choice ")}


def test_eigen_kernels_compute_no_grouped_gradient_and_the_portable_forms_serve():
    # Issue 43's reproduction: wherever oneDNN is off (TensorFlow's default on CPUs without AVX-512,
    # a script that imports keras first there, TF_ENABLE_ONEDNN_OPTS=0), TensorFlow's own kernels
    # refuse the grouped convolution's gradients in every dtype; the model stays fused all the same:
    # one convolution per learner, and for a dilated one, whose gradient those kernels lack, the patches.
    chosen = choices("keras", "eigen")
    for dtype in ("float32", "bfloat16"):
        assert chosen[dtype].startswith(f"{dtype} per-learner grouped: "), chosen[dtype]
        assert "grouped convolutions" in chosen[dtype] or "filter_size" in chosen[dtype]
        assert chosen[dtype + "-dilated"] == f"{dtype}-dilated patches"


def test_onednn_without_bfloat16_computes_bfloat16_through_float32():
    # oneDNN capped at AVX2, as on an AMD EPYC without AVX-512: float32 grouped; bfloat16 fails in the
    # forward pass already, so the grouped convolution runs in float32 with casts.
    chosen = choices("crossbow", "avx2")
    assert chosen["float32"] == "float32 grouped grouped: None" and chosen["float32-dilated"] == "float32-dilated grouped"
    assert chosen["bfloat16"].startswith("bfloat16 grouped-float32 grouped: ")
    # On an AVX-512 CPU the capped oneDNN fails to make the primitive; on a CPU without AVX-512 TensorFlow
    # hands bfloat16 to its Eigen kernels, which have no grouped gradient.
    assert "primitive descriptor" in chosen["bfloat16"] or "grouped convolutions" in chosen["bfloat16"]


def test_a_forced_form_is_used_and_one_that_does_not_compute_is_refused(monkeypatch):
    with conv_forms.forcing(conv_forms.PER_LEARNER):
        assert conv_forms.forced() == conv_forms.PER_LEARNER
        assert conv_forms.choose("float32", "CPU", conv_forms.forced()) == (conv_forms.PER_LEARNER,
                                                                            "per-learner: chosen, not probed")
    assert conv_forms.forced() is None
    monkeypatch.setenv(conv_forms.FORM_VARIABLE, "patches")
    assert conv_forms.forced() == conv_forms.PATCHES
    monkeypatch.setenv(conv_forms.FORM_VARIABLE, "im2col")
    with pytest.raises(ConfigError, match="CROSSBOW_TF_CONV_FORM='im2col': not a convolution form; choose one of "
                                          "grouped, grouped-float32, per-learner, patches"):
        conv_forms.forced()
    monkeypatch.setitem(conv_forms._probed, ("CPU", "float32", "patches", False), "no BatchMatMul kernel")
    with pytest.raises(conv_forms.NoConvolutionForm, match="the learners' convolution in the patches form .* computes "
                                                           "no float32 gradients on this CPU: no BatchMatMul kernel"):
        conv_forms.choose("float32", "CPU", conv_forms.PATCHES)


def test_where_no_form_computes_the_refusal_is_one_line_naming_cpu_dtype_and_way_out(monkeypatch):
    for form in conv_forms.FORMS:
        monkeypatch.setitem(conv_forms._probed, ("CPU", "bfloat16", form, False), f"no {form} kernel")
    with pytest.raises(conv_forms.NoConvolutionForm) as refused:
        conv_forms.choose("bfloat16", "CPU")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("no form of the learners' convolution computes bfloat16 gradients on this CPU (")
    assert conv_forms.cpu_summary() in message and "no per-learner kernel" in message
    assert message.endswith("train with precision float32, or on a CPU with AVX-512")


def test_the_cpu_summary_reads_the_flags():
    flags = conv_forms.cpu_flags()
    summary = conv_forms.cpu_summary()
    assert summary.startswith("AVX-512") == ("avx512f" in flags)
    assert ("avx512_bf16" in summary) == ("avx512_bf16" in flags)


# The first form that TensorFlow's own (Eigen) CPU kernels compute: neither grouped form does.
EIGEN_FORM = next(f for f in conv_forms.FORMS if f not in (conv_forms.GROUPED, conv_forms.GROUPED_FLOAT32))


@pytest.mark.parametrize("first, emulated, expected", [
    ("keras", None, None), ("crossbow", None, None),       # this CPU's own kernels, whichever it is
    ("keras", "eigen", {"float32": EIGEN_FORM, "mixed_bfloat16": EIGEN_FORM}),
    ("crossbow", "avx2", {"float32": "grouped", "mixed_bfloat16": "grouped-float32"})])
def test_the_import_order_does_not_decide_whether_a_convolutional_model_is_fused(first, emulated, expected):
    # Issue 43's eight variants (Keras or crossbow_tf first x Conv2D / Conv1D x float32 / mixed_bfloat16).
    rows = [line.split() for line in variant_run(first, emulated).splitlines() if not line.startswith("choice ")]
    assert [(layer, policy) for layer, policy, *_ in rows] == [
        (layer, policy) for layer in ("Conv2D", "Conv1D") for policy in ("float32", "mixed_bfloat16")], rows
    for layer, policy, computation, forms, finite in rows:
        assert computation == "FusedLearners" and finite == "True", (layer, policy, computation, finite)
        assert forms in conv_forms.FORMS and (expected is None or forms == expected[policy]), (layer, policy, forms)
