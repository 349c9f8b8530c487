"""The paper's models: architecture, parameter counts against the published figures, and one
forward and backward pass each."""
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.errors import ConfigError
from crossbow_tf.models import MODELS, build_model

# What a later fused-learner path knows how to stack.
STANDARD_LAYERS = (keras.layers.InputLayer, keras.layers.Conv2D, keras.layers.Dense,
                   keras.layers.BatchNormalization, keras.layers.MaxPooling2D, keras.layers.ReLU,
                   keras.layers.Activation, keras.layers.Dropout, keras.layers.Add, keras.layers.Flatten,
                   keras.layers.GlobalAveragePooling2D, keras.layers.AveragePooling2D)

SHAPES = {"lenet": ((28, 28, 1), 10), "resnet32": ((32, 32, 3), 10), "vgg16": ((32, 32, 3), 100),
          "resnet50": ((224, 224, 3), 1000)}


@functools.lru_cache(maxsize=None)
def architecture(name):
    """The model NAME at its SHAPES, built once for the tests that only read its layers and counts."""
    return build_model(name, *SHAPES[name])


def trainable_count(model):
    return sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def conv_bn(cin, cout, k):
    """A bias-free k x k convolution followed by BatchNorm (gamma, beta)."""
    return k * k * cin * cout + 2 * cout


def test_registry_and_unknown_name():
    assert set(MODELS) >= {"lenet", "resnet32", "vgg16", "resnet50"}
    with pytest.raises(ConfigError, match="unknown model 'resnet18'"):
        build_model("resnet18", (32, 32, 3), 10)


def test_lenet_parameter_count():
    model = architecture("lenet")
    expected = (5 * 5 * 32 + 32) + (5 * 5 * 32 * 64 + 64) + (4 * 4 * 64 * 1024 + 1024) + (1024 * 10 + 10)
    assert trainable_count(model) == expected == 1_111_946


def test_resnet32_architecture_and_parameter_count():
    model = architecture("resnet32")
    expected = conv_bn(3, 16, 3)
    for cin, cout in ((16, 16), (16, 32), (32, 64)):
        expected += conv_bn(cin, cout, 3) + conv_bn(cout, cout, 3)     # first block of the stage
        if cin != cout:
            expected += conv_bn(cin, cout, 1)                          # projection shortcut
        expected += 4 * (conv_bn(cout, cout, 3) + conv_bn(cout, cout, 3))
    expected += 64 * 10 + 10
    assert trainable_count(model) == expected
    # He et al. (2016), Table 6: ResNet-32 has 0.46M parameters (with parameter-free shortcuts;
    # our two 1x1 projections add 2.8K).
    assert abs(trainable_count(model) - 0.46e6) / 0.46e6 < 0.02
    convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D) and l.kernel_size == (3, 3)]
    dense = [l for l in model.layers if isinstance(l, keras.layers.Dense)]
    assert len(convs) + len(dense) == 32
    assert [l.strides for l in convs if l.strides != (1, 1)] == [(2, 2), (2, 2)]
    bns = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    assert {(l.epsilon, l.momentum) for l in bns} == {(1e-5, 0.9)}
    assert model.get_layer("pool").output.shape == (None, 64)


def test_vgg16_architecture_and_parameter_count():
    model = architecture("vgg16")
    widths = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    expected, cin = 0, 3
    for w in widths:
        expected += 9 * cin * w + w + 2 * w       # conv with bias, then BatchNorm
        cin = w
    expected += 512 * 512 + 512 + 2 * 512 + 512 * 100 + 100
    assert trainable_count(model) == expected == 15_038_116
    convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
    assert [l.filters for l in convs] == widths
    assert [l.rate for l in model.layers if isinstance(l, keras.layers.Dropout)] == [0.3] + [0.4] * 7 + [0.5, 0.5]
    # Each conv is followed by ReLU, then BatchNorm.
    names = [l.name for l in model.layers]
    for conv in convs:
        i = names.index(conv.name)
        assert isinstance(model.layers[i + 1], keras.layers.ReLU)
        assert isinstance(model.layers[i + 2], keras.layers.BatchNormalization)
    assert model.get_layer("flatten").output.shape == (None, 512)


def test_resnet50_parameter_count_matches_reference():
    model = architecture("resnet50")
    # The published ResNet-50 figure (25.6M; torchvision's bias-free model: 25,557,032).
    assert trainable_count(model) == 25_557_032
    # Keras's own ResNet50 differs only by its convolution biases (from the Caffe model).
    reference = keras.applications.ResNet50(weights=None)
    conv_biases = sum(l.filters for l in reference.layers if isinstance(l, keras.layers.Conv2D))
    assert model.count_params() == reference.count_params() - conv_biases
    assert model.get_layer("pool").input.shape == (None, 7, 7, 2048)
    blocks = [sum(1 for l in model.layers if l.name.startswith(f"stage{s}_") and l.name.endswith("_add"))
              for s in (1, 2, 3, 4)]
    assert blocks == [3, 4, 6, 3]


@pytest.mark.parametrize("name", ["resnet32", "resnet50"])
def test_resnets_use_he_normal(name):
    keras.utils.set_random_seed(0)
    shape, classes = SHAPES[name]
    model = build_model(name, shape, classes)
    kernel = max((l for l in model.layers if isinstance(l, keras.layers.Conv2D)),
                 key=lambda l: int(np.prod(l.kernel.shape))).kernel.numpy()
    fan_in = np.prod(kernel.shape[:-1])
    assert abs(kernel.std() / np.sqrt(2.0 / fan_in) - 1) < 0.05


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_models_use_only_standard_layers_and_return_logits(name):
    classes = SHAPES[name][1]
    model = architecture(name)
    odd = [type(l).__name__ for l in model.layers if not isinstance(l, STANDARD_LAYERS)]
    assert not odd
    last = model.layers[-1]
    assert isinstance(last, keras.layers.Dense) and last.units == classes
    assert last.activation is keras.activations.linear


@pytest.mark.parametrize("name,batch", [("lenet", 2), ("resnet32", 2), ("vgg16", 2), ("resnet50", 2)])
def test_forward_and_backward(name, batch):
    keras.utils.set_random_seed(1)
    shape, classes = SHAPES[name]
    model = build_model(name, shape, classes)
    x = tf.random.normal((batch,) + shape)
    y = tf.constant(np.arange(batch) % classes)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = loss_fn(y, logits)
    grads = tape.gradient(loss, model.trainable_variables)
    assert logits.shape == (batch, classes)
    assert np.isfinite(float(loss))
    assert all(g is not None and np.all(np.isfinite(g.numpy())) for g in grads)
    # Every weight gets a gradient (a disconnected layer would give zeros or None).
    kernels = [g for g, v in zip(grads, model.trainable_variables) if "kernel" in v.path]
    assert all(float(tf.reduce_max(tf.abs(g))) > 0 for g in kernels)
    inference = model(x, training=False)
    assert inference.shape == (batch, classes)
