"""Fused learners compute what replicated learners compute; unsupported layers fall back."""
import functools
import logging

import keras
import numpy as np
import pytest

from crossbow_tf.algorithms import SMA
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.fused import FusedLearners, UnsupportedModel
from crossbow_tf.engine.replicated import ReplicatedLearners
from crossbow_tf.models import MODELS, build_model
from crossbow_tf.models.resnet32 import resnet32

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def custom_functional(input_shape=(12, 12, 3), num_classes=5):
    """A user model with BatchNorm, Dropout, a residual Add, strides, padding and pooling."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    y = keras.layers.Conv2D(6, 3, padding="same")(x)
    y = keras.layers.Dropout(0.3)(y)
    x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.ZeroPadding2D(1)(x)
    x = keras.layers.Conv2D(8, 3, strides=2)(x)
    x = keras.layers.MaxPooling2D(2)(x)
    pooled = keras.layers.GlobalAveragePooling2D()(x)
    flat = keras.layers.Flatten()(x)
    x = keras.layers.Concatenate()([pooled, keras.layers.Dense(4, activation="tanh")(flat)])
    x = keras.layers.Dense(16, activation="relu")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.5)(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def run(factory, input_shape, num_classes, learners, devices, m=3, b=4, steps=3, seed=0, lr=0.05):
    keras.utils.set_random_seed(seed)
    model = factory(input_shape=input_shape, num_classes=num_classes)
    initial = [w.numpy() for w in model.trainable_variables]
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=devices, learners_per_device=m),
                    learners=learners)
    rng = np.random.default_rng(seed)
    kb = engine.num_learners * b
    for _ in range(steps):
        x = rng.random((kb,) + input_shape, dtype=np.float32)
        y = rng.integers(0, num_classes, kb).astype(np.int32)
        loss, _ = engine.train_step(x, y, np.ones(kb), lr)
    states = [s.numpy() for d in engine.states for s in d]
    engine.initial_weights = initial
    return engine, float(loss), states


def assert_same_training(factory, input_shape, num_classes, devices, **kw):
    fused, loss_f, states_f = run(factory, input_shape, num_classes, "fused", devices, **kw)
    replicated, loss_r, states_r = run(factory, input_shape, num_classes, "replicated", devices, **kw)
    assert isinstance(fused.learner_computation, FusedLearners)
    assert isinstance(replicated.learner_computation, ReplicatedLearners)
    assert abs(loss_f - loss_r) < 1e-5
    initial = fused.initial_weights
    steps = kw.get("steps", 3)
    z_moved = False
    for a, b, w0 in zip(fused.center_weights(), replicated.center_weights(), initial, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        z_moved = z_moved or np.abs(a - w0).max() > 1e-3
    # z cannot move in SMA's first iteration (it follows the corrections one iteration later): at one
    # step the learners carry the comparison, and most of their tensors must move well past it.
    assert z_moved == (steps > 1)
    moved, compared = 0, 0
    for la, lb in zip(fused.learner_weights(), replicated.learner_weights(), strict=True):
        for a, b, w0 in zip(la, lb, initial, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
            moved += np.abs(a - w0).max() > 1e-4   # 10x the tolerance
            compared += 1
    assert compared == len(initial) * fused.num_learners
    assert moved > compared / 2, f"only {moved} of {compared} learner tensors moved past 10x the tolerance"
    for a, b in zip(states_f, states_r, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_fused_equals_replicated_on_a_custom_model_with_batchnorm_and_dropout(cpu_devices):
    assert_same_training(custom_functional, (12, 12, 3), 5, cpu_devices[:2], b=8)


def test_fused_equals_replicated_on_lenet(cpu_devices):
    assert_same_training(MODELS["lenet"], (28, 28, 1), 10, cpu_devices[:1], m=4)


def test_fused_equals_replicated_on_resnet32(cpu_devices):
    # One basic block per stage (ResNet-8, the model's own depth knob) keeps every layer kind and
    # block kind of ResNet-32: stem, identity block, strided 1x1-projection blocks, pooling, logits;
    # the 4 further blocks per stage repeat them and cost only tracing. 16x16 images still give
    # every stage a spatial map (16, 8, 4). A moderate rate: BatchNorm over 8 examples amplifies
    # the rounding differences of two correct float32 computations step by step (at lr 0.01 by
    # about 10x per step).
    shallow = functools.partial(resnet32, blocks_per_stage=1)
    assert_same_training(shallow, (16, 16, 3), 10, cpu_devices[:1], m=2, b=8, steps=3, lr=0.001)


# The paper models' layer kinds with fewer repeats (the first step's tracing and compiling, most of
# this test's CPU, grows with the layer count, not the input). ResNet-50: one bottleneck per stage,
# plus an identity one in stage 1: the 7x7/2 stem, max-pool, projection bottlenecks (stride 1 and 2)
# and an identity one; the other 11 repeat these (all four stages stay: the last ones' 2x2 and 1x1
# maps, BatchNorm's variance over few values there, are where a wrong epsilon shows). VGG-16: two
# stages of 2 convolutions and the head: a convolution followed by dropout 0.3 (the net's first), by
# dropout 0.4 (the others) and by the stage's max-pool; the other 9 convolutions and 3 stages repeat
# these.
SHALLOW_STAGES = {"resnet50": ((64, 2), (128, 1), (256, 1), (512, 1)),
                  "vgg16": ((64, 2), (128, 2))}


@pytest.mark.parametrize("name, shape, classes", [("vgg16", (32, 32, 3), 10), ("resnet50", (32, 32, 3), 10)])
def test_fused_step_equals_replicated_step_on_paper_models(name, shape, classes, cpu_devices):
    # One iteration from the same state: VGG-16 with ReLU-then-BatchNorm on random data is chaotic
    # enough that float32 rounding differences grow past 1e-3 within two further iterations.
    # 32x32 is the smallest input ResNet-50 takes (its 32x downsampling ends at 1x1), and CIFAR's
    # size for VGG-16; 10 classes and 2 examples per learner (BatchNorm's smallest batch with a
    # variance) keep every layer in the step, and the learners' check needs most tensors to move.
    shallow = functools.partial(MODELS[name], stages=SHALLOW_STAGES[name])
    assert_same_training(shallow, shape, classes, cpu_devices[:1], m=2, b=2, steps=1, lr=0.001)


def test_dropout_masks_differ_between_fused_learners(cpu_devices):
    """Same data and weights for every learner: only their own dropout masks can separate them."""
    keras.utils.set_random_seed(1)
    model = custom_functional()
    engine = Engine(model, LOSS, SMA(alpha=0.0, momentum=0.0),
                    CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2), learners="fused")
    rng = np.random.default_rng(0)
    x = rng.random((4, 12, 12, 3), dtype=np.float32)
    y = rng.integers(0, 5, 4).astype(np.int32)
    engine.train_step(np.concatenate([x, x]), np.concatenate([y, y]), np.ones(8), 0.1)
    first, second = engine.learner_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(first, second))


def test_unsupported_layer_falls_back_with_a_notice(cpu_devices, caplog):
    keras.utils.set_random_seed(0)
    # Two layers without a fused form: the one notice names both (and a fused LayerNormalization between).
    model = keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(2, 3, groups=2, name="grouped"),
                              keras.layers.LayerNormalization(name="my_norm"),
                              keras.layers.Conv2D(2, 3, kernel_regularizer="l2", name="regularized"),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    with caplog.at_level(logging.WARNING, logger="crossbow_tf"):
        engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2))
    assert isinstance(engine.learner_computation, ReplicatedLearners)
    notices = [r.getMessage() for r in caplog.records if r.name == "crossbow_tf"]
    assert len(notices) == 1
    assert "'grouped' (Conv2D): grouped Conv2D is not fused" in notices[0]
    assert "'regularized' (Conv2D): it has a kernel regularizer" in notices[0]
    assert "my_norm" not in notices[0]
    with pytest.raises(UnsupportedModel, match="grouped.*regularized"):
        Engine(model, LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:1]), learners="fused")


def test_fused_is_the_default_for_supported_models(cpu_devices):
    keras.utils.set_random_seed(0)
    engine = Engine(build_model("lenet", (28, 28, 1), 10), LOSS, SMA(),
                    CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2))
    assert isinstance(engine.learner_computation, FusedLearners)


ONEDNN_OFF_SCRIPT = """
import keras, numpy as np
from crossbow_tf.algorithms import SMA
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.fused import FusedLearners, onednn_enabled
from crossbow_tf.models import build_model
assert not onednn_enabled()
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
x = np.random.default_rng(0).random((6, 28, 28, 1), dtype=np.float32)
weights = {}
for learners in ("auto", "replicated"):
    keras.utils.set_random_seed(0)
    engine = Engine(build_model("lenet", (28, 28, 1), 10), loss, SMA(), CrossbowStrategy(learners_per_device=3),
                    learners=learners)
    value, _ = engine.train_step(x, np.arange(6, dtype=np.int32), np.ones(6), 0.05)
    weights[learners] = [w for learner in engine.learner_weights() for w in learner]
    print(learners, type(engine.learner_computation).__name__, np.isfinite(float(value)),
          sorted(getattr(engine.learner_computation, "conv_forms", {}).items()))
apart = max(np.abs(a - b).max() for a, b in zip(weights["auto"], weights["replicated"]))
print("apart", apart)
inputs = keras.Input((12, 12, 1))
hidden = keras.layers.Conv2D(3, 3, dilation_rate=2, activation="relu")(inputs)
dilated = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(hidden)))
engine = Engine(dilated, loss, SMA(), CrossbowStrategy(learners_per_device=3))
value, _ = engine.train_step(x[:, 8:20, 8:20], np.arange(6, dtype=np.int32), np.ones(6), 0.05)
print("dilated", type(engine.learner_computation).__name__, np.isfinite(float(value)),
      sorted(form for form, _ in engine.learner_computation.conv_forms.values()))
"""


def test_without_onednn_convolutions_stay_fused_in_the_portable_form():
    # TensorFlow's own CPU kernels have no gradient of a grouped convolution: without oneDNN
    # (TensorFlow's default on CPUs without AVX-512, and after `import keras` first there) the
    # learners' convolutions take a form those kernels compute, and the model stays fused (issue 43).
    import os
    import subprocess
    import sys
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", ONEDNN_OFF_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["auto"].startswith("FusedLearners True [('float32', ('per-learner', "), lines
    assert "grouped does not (" in lines["auto"]
    assert lines["replicated"] == "ReplicatedLearners True []"
    assert float(lines["apart"]) < 1e-5
    # Those kernels compute no gradient of a dilated convolution, even one per learner.
    assert lines["dilated"] == "FusedLearners True ['patches']"
    assert "learners run replicated" not in out.stderr


def test_crossbow_tf_turns_onednn_on_unless_told_otherwise():
    import os
    import subprocess
    import sys
    code = "import crossbow_tf, os; from crossbow_tf.engine.fused import onednn_enabled; " \
           "print(os.environ['TF_ENABLE_ONEDNN_OPTS'], onednn_enabled())"
    env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["1", "True"], out.stderr[-2000:]
