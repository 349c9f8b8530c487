"""Every layer class in keras.layers with trainable weights is fused (a hand-written form or the
generic one, as the engine's own registry decides) or listed in docs/performance.md with the reason
it is not (issue 26, must-show 3).

Each weighted class in WEIGHTED is built in a tiny model, and that model's fused forward (2 learners
with different weights) must equal each learner's own Keras `stateless_call`. A class the docs list
as running once per learner must do so, with the op the docs name. A class of keras.layers that is
in none of the tables below fails the first test: a new Keras release's weighted layer is noticed.
"""
import logging
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers as L

from crossbow_tf.engine import fused
from crossbow_tf.engine.fused_forms import form_of

DOCS = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
DOCS_HEADING = "### Weighted layers of keras.layers that are not vectorized, or not fused"
GENERIC = "generic: the layer's stateless_call vectorized over the learners"


def _self_attention(layer):
    return lambda x: layer([x, x])


def _attention(layer):
    return lambda x: layer(x, x)


def _cell(layer, states):
    return lambda x: layer(x, [L.Dense(3)(x) for _ in range(states)])[0]


# class name -> (the layer, the single-learner input shape, how the model calls it (None: layer(x)),
#                the input's dtype). Small sizes: tracing, not arithmetic, is what these cost.
WEIGHTED = {
    "AdditiveAttention": (lambda: L.AdditiveAttention(), (5, 4), _self_attention, "float32"),
    "Attention": (lambda: L.Attention(use_scale=True), (5, 4), _self_attention, "float32"),
    "BatchNormalization": (lambda: L.BatchNormalization(), (5, 5, 3), None, "float32"),
    "Bidirectional": (lambda: L.Bidirectional(L.GRU(3, return_sequences=True)), (6, 4), None, "float32"),
    "Conv1D": (lambda: L.Conv1D(3, 2), (6, 4), None, "float32"),
    "Conv1DTranspose": (lambda: L.Conv1DTranspose(3, 2), (6, 4), None, "float32"),
    "Conv2D": (lambda: L.Conv2D(3, 2), (5, 5, 2), None, "float32"),
    "Conv2DTranspose": (lambda: L.Conv2DTranspose(3, 2), (5, 5, 2), None, "float32"),
    "Conv3D": (lambda: L.Conv3D(2, 2), (3, 3, 3, 2), None, "float32"),
    "Conv3DTranspose": (lambda: L.Conv3DTranspose(2, 2), (3, 3, 3, 2), None, "float32"),
    "ConvLSTM1D": (lambda: L.ConvLSTM1D(2, 2), (2, 4, 2), None, "float32"),
    "ConvLSTM2D": (lambda: L.ConvLSTM2D(2, 2), (2, 3, 3, 1), None, "float32"),
    "ConvLSTM3D": (lambda: L.ConvLSTM3D(2, 2), (2, 3, 3, 3, 1), None, "float32"),
    "Dense": (lambda: L.Dense(3), (4,), None, "float32"),
    "DepthwiseConv1D": (lambda: L.DepthwiseConv1D(2), (6, 3), None, "float32"),
    "DepthwiseConv2D": (lambda: L.DepthwiseConv2D(2), (5, 5, 2), None, "float32"),
    "EinsumDense": (lambda: L.EinsumDense("abc,cd->abd", output_shape=(6, 3), bias_axes="d"), (6, 4), None,
                    "float32"),
    "Embedding": (lambda: L.Embedding(10, 3), (5,), None, "int32"),
    "GRU": (lambda: L.GRU(3), (6, 4), None, "float32"),
    "GRUCell": (lambda: L.GRUCell(3), (4,), lambda layer: _cell(layer, 1), "float32"),
    "GroupNormalization": (lambda: L.GroupNormalization(groups=2), (5, 4), None, "float32"),
    "GroupQueryAttention": (lambda: L.GroupQueryAttention(head_dim=2, num_query_heads=2, num_key_value_heads=1),
                            (5, 4), _attention, "float32"),
    "LSTM": (lambda: L.LSTM(3), (6, 4), None, "float32"),
    "LSTMCell": (lambda: L.LSTMCell(3), (4,), lambda layer: _cell(layer, 2), "float32"),
    "LayerNormalization": (lambda: L.LayerNormalization(), (6, 4), None, "float32"),
    "MultiHeadAttention": (lambda: L.MultiHeadAttention(2, 2), (5, 4), _attention, "float32"),
    "PReLU": (lambda: L.PReLU(), (6, 4), None, "float32"),
    "RMSNormalization": (lambda: L.RMSNormalization(), (6, 4), None, "float32"),
    "RNN": (lambda: L.RNN(L.SimpleRNNCell(3)), (6, 4), None, "float32"),
    "ReversibleEmbedding": (lambda: L.ReversibleEmbedding(10, 3), (5,), None, "int32"),
    "SeparableConv1D": (lambda: L.SeparableConv1D(3, 2), (6, 2), None, "float32"),
    "SeparableConv2D": (lambda: L.SeparableConv2D(3, 2), (5, 5, 2), None, "float32"),
    "SimpleRNN": (lambda: L.SimpleRNN(3), (6, 4), None, "float32"),
    "SimpleRNNCell": (lambda: L.SimpleRNNCell(3), (4,), lambda layer: _cell(layer, 1), "float32"),
    "SpectralNormalization": (lambda: L.SpectralNormalization(L.Dense(3)), (4,), None, "float32"),
    "StackedRNNCells": (lambda: L.StackedRNNCells([L.SimpleRNNCell(3), L.SimpleRNNCell(3)]), (4,),
                        lambda layer: _cell(layer, 2), "float32"),
    "TimeDistributed": (lambda: L.TimeDistributed(L.Dense(3)), (6, 4), None, "float32"),
}

# The hand-written form the engine takes each of these with (the rest of WEIGHTED: the generic form).
HAND_WRITTEN = {
    "BatchNormalization": "batch normalization per learner", "Bidirectional": "recurrent layers",
    "Conv1D": "grouped convolution", "Conv2D": "grouped convolution", "DepthwiseConv2D": "grouped convolution",
    "SeparableConv2D": "grouped convolution", "Dense": "dense, dropout, flatten, pooling, padding",
    "Embedding": "sequence layers", "LayerNormalization": "sequence layers", "MultiHeadAttention": "sequence layers",
    "GRU": "recurrent layers", "LSTM": "recurrent layers", "SimpleRNN": "recurrent layers",
}

# Classes without trainable weights, with the arguments they need and an input shape (batch first) to
# build them on; each is built here and must have none.
IMAGE, SEQUENCE, FEATURES, VOLUME = (2, 8, 8, 3), (2, 8, 3), (2, 8), (2, 4, 4, 4, 3)
WEIGHTLESS = {
    "Activation": ({"activation": "relu"}, IMAGE), "ActivityRegularization": ({}, IMAGE),
    "AdaptiveAveragePooling1D": ({"output_size": 2}, SEQUENCE),
    "AdaptiveAveragePooling2D": ({"output_size": 2}, IMAGE),
    "AdaptiveAveragePooling3D": ({"output_size": 2}, VOLUME),
    "AdaptiveMaxPooling1D": ({"output_size": 2}, SEQUENCE), "AdaptiveMaxPooling2D": ({"output_size": 2}, IMAGE),
    "AdaptiveMaxPooling3D": ({"output_size": 2}, VOLUME),
    "Add": ({}, [FEATURES, FEATURES]), "AlphaDropout": ({"rate": 0.1}, FEATURES), "AugMix": ({}, IMAGE),
    "AutoContrast": ({}, IMAGE), "Average": ({}, [FEATURES, FEATURES]),
    "AveragePooling1D": ({"pool_size": 2}, SEQUENCE), "AveragePooling2D": ({"pool_size": 2}, IMAGE),
    "AveragePooling3D": ({"pool_size": 2}, VOLUME), "CategoryEncoding": ({"num_tokens": 4}, FEATURES),
    "CenterCrop": ({"height": 4, "width": 4}, IMAGE), "Concatenate": ({}, [FEATURES, FEATURES]),
    "ContrastLimitedAdaptiveHistogramEqualization": ({}, IMAGE), "Cropping1D": ({}, SEQUENCE),
    "Cropping2D": ({}, IMAGE), "Cropping3D": ({}, VOLUME), "CutMix": ({}, IMAGE),
    "Discretization": ({"num_bins": 3}, FEATURES), "Dot": ({"axes": 1}, [FEATURES, FEATURES]),
    "Dropout": ({"rate": 0.1}, FEATURES), "ELU": ({}, FEATURES), "Equalization": ({}, IMAGE),
    "Flatten": ({}, IMAGE), "GaussianDropout": ({"rate": 0.1}, FEATURES),
    "GaussianNoise": ({"stddev": 0.1}, FEATURES), "GlobalAveragePooling1D": ({}, SEQUENCE),
    "GlobalAveragePooling2D": ({}, IMAGE), "GlobalAveragePooling3D": ({}, VOLUME),
    "GlobalMaxPooling1D": ({}, SEQUENCE), "GlobalMaxPooling2D": ({}, IMAGE), "GlobalMaxPooling3D": ({}, VOLUME),
    "HashedCrossing": ({"num_bins": 4}, [FEATURES, FEATURES]), "Hashing": ({"num_bins": 4}, FEATURES),
    "Identity": ({}, FEATURES), "InputLayer": ({"shape": (4,)}, FEATURES), "IntegerLookup": ({}, FEATURES),
    "Lambda": ({"function": lambda x: x}, FEATURES), "LeakyReLU": ({}, FEATURES), "Masking": ({}, SEQUENCE),
    "MaxNumBoundingBoxes": ({"max_number": 2}, IMAGE), "MaxPooling1D": ({}, SEQUENCE),
    "MaxPooling2D": ({}, IMAGE), "MaxPooling3D": ({}, VOLUME), "Maximum": ({}, [FEATURES, FEATURES]),
    "MelSpectrogram": ({}, FEATURES), "Minimum": ({}, [FEATURES, FEATURES]), "MixUp": ({}, IMAGE),
    "Multiply": ({}, [FEATURES, FEATURES]), "Normalization": ({}, FEATURES),
    "Permute": ({"dims": (2, 1)}, SEQUENCE), "Pipeline": ({"layers": [L.Identity()]}, FEATURES),
    "RandAugment": ({}, IMAGE), "RandomBrightness": ({"factor": 0.1}, IMAGE),
    "RandomColorDegeneration": ({"factor": 0.1}, IMAGE), "RandomColorJitter": ({}, IMAGE),
    "RandomContrast": ({"factor": 0.1}, IMAGE), "RandomCrop": ({"height": 4, "width": 4}, IMAGE),
    "RandomElasticTransform": ({}, IMAGE), "RandomErasing": ({}, IMAGE), "RandomFlip": ({}, IMAGE),
    "RandomGaussianBlur": ({}, IMAGE), "RandomGrayscale": ({}, IMAGE), "RandomHue": ({"factor": 0.1}, IMAGE),
    "RandomInvert": ({}, IMAGE), "RandomPerspective": ({}, IMAGE),
    "RandomPosterization": ({"factor": 4}, IMAGE), "RandomRotation": ({"factor": 0.1}, IMAGE),
    "RandomSaturation": ({"factor": 0.1}, IMAGE), "RandomSharpness": ({"factor": 0.1}, IMAGE),
    "RandomShear": ({}, IMAGE), "RandomTranslation": ({"height_factor": 0.1, "width_factor": 0.1}, IMAGE),
    "RandomZoom": ({"height_factor": 0.1}, IMAGE), "ReLU": ({}, FEATURES), "RepeatVector": ({"n": 2}, FEATURES),
    "Rescaling": ({"scale": 0.5}, FEATURES), "Reshape": ({"target_shape": (8, 1)}, FEATURES),
    "Resizing": ({"height": 4, "width": 4}, IMAGE), "Softmax": ({}, FEATURES), "Solarization": ({}, IMAGE),
    "SpatialDropout1D": ({"rate": 0.1}, SEQUENCE), "SpatialDropout2D": ({"rate": 0.1}, IMAGE),
    "SpatialDropout3D": ({"rate": 0.1}, VOLUME), "StringLookup": ({}, FEATURES),
    "Subtract": ({}, [FEATURES, FEATURES]), "TextVectorization": ({}, FEATURES),
    "UnitNormalization": ({}, FEATURES), "UpSampling1D": ({}, SEQUENCE), "UpSampling2D": ({}, IMAGE),
    "UpSampling3D": ({}, VOLUME), "ZeroPadding1D": ({}, SEQUENCE), "ZeroPadding2D": ({}, IMAGE),
    "ZeroPadding3D": ({}, VOLUME),
}
# Base classes: a user's subclass of them is a custom layer, which the generic form takes
# (tests/test_fused_generic.py trains three).
BASES = {"Layer", "Wrapper"}


def keras_layer_classes():
    """{name: class} of every distinct Layer class keras.layers exports, named as the class names
    itself where keras.layers exports that name (Convolution2D is Conv2D), else by its export."""
    exported = {}
    for name in dir(L):
        value = getattr(L, name)
        if isinstance(value, type) and issubclass(value, keras.layers.Layer):
            exported.setdefault(value, []).append(name)
    return {(cls.__name__ if cls.__name__ in names else min(names)): cls for cls, names in exported.items()}


def docs_list():
    """{class name: reason} of docs/performance.md's list of weighted layers not vectorized or not fused."""
    text = DOCS.read_text()
    assert DOCS_HEADING in text, f"docs/performance.md has no section {DOCS_HEADING!r}"
    section = text.split(DOCS_HEADING, 1)[1].split("\n#", 1)[0]
    return {name: reason.strip() for name, reason in re.findall(r"^- `(\w+)`: (.+(?:\n  .+)*)", section, re.M)}


def test_every_keras_layer_class_is_fused_listed_or_weightless():
    classes, listed = keras_layer_classes(), docs_list()
    assert len(classes) > 100 and len(listed) >= 5
    unknown = sorted(set(classes) - set(WEIGHTED) - set(WEIGHTLESS) - set(listed) - BASES)
    assert not unknown, (f"keras.layers classes in no table of this test nor in docs/performance.md: {unknown} "
                         "(a weighted one: add it to WEIGHTED, or to the docs' list with its reason)")
    stale = sorted((set(WEIGHTED) | set(WEIGHTLESS) | set(listed)) - set(classes))
    assert not stale, f"not classes of keras.layers (any more): {stale}"
    assert not set(WEIGHTLESS) & (set(WEIGHTED) | set(listed))
    for name, reason in listed.items():
        assert len(reason) > 20, f"docs/performance.md lists {name} without a reason"


@pytest.mark.parametrize("name", sorted(WEIGHTLESS))
def test_layers_the_table_calls_weightless_have_no_trainable_weights(name):
    kwargs, shape = WEIGHTLESS[name]
    layer = keras_layer_classes()[name](**kwargs)
    layer.build(shape)
    assert layer.built and not layer.trainable_weights


def tiny_model(name):
    """(model, the layer of class NAME in it): the layer between an input and a Dense head."""
    make, shape, how, dtype = WEIGHTED[name]
    keras.utils.set_random_seed(0)
    layer = make()
    inputs = keras.Input(shape, dtype=dtype)
    x = (how(layer) if how else layer)(inputs)
    x = x[0] if isinstance(x, (list, tuple)) else x
    x = L.Flatten()(x) if len(x.shape) > 2 else x
    return keras.Model(inputs, L.Dense(2)(x)), layer


def fused_forward_against_each_learner(model, m=2, b=3):
    """The fused forward of M learners whose weights differ, and each learner's own stateless_call."""
    rng = np.random.default_rng(0)
    spec = model.inputs[0]
    shape = (m, b) + tuple(spec.shape[1:])
    x = rng.integers(0, 10, shape) if spec.dtype.startswith("int") else rng.standard_normal(shape)
    x = tf.constant(x.astype(spec.dtype))
    weights = [tf.constant(np.stack([v.numpy() * (1 + 0.25 * i) + 0.05 * i for i in range(m)]))
               for v in model.trainable_variables]
    states = [tf.constant(np.stack([v.numpy()] * m)) for v in model.non_trainable_variables]
    learners = fused.make_learners(model, keras.losses.MeanSquaredError())
    assert isinstance(learners, fused.FusedLearners)
    outputs, _ = learners.forward(weights, states, x)
    each = [model.stateless_call([w[i] for w in weights], [s[i] for s in states], x[i], training=True)[0]
            for i in range(m)]
    return learners, outputs, each


@pytest.mark.parametrize("name", sorted(WEIGHTED))
def test_each_weighted_layer_runs_in_the_fused_computation_as_each_learner_runs_it(name, caplog):
    model, layer = tiny_model(name)
    assert layer.trainable_weights, f"{name} as built here has no trainable weights"
    ranks = [len(t.shape) - 1 for t in tf.nest.flatten(layer._inbound_nodes[0].input_tensors)]
    assert fused._unsupported_in(model) == []
    assert form_of(layer, ranks)[0] == HAND_WRITTEN.get(name, GENERIC)
    with caplog.at_level(logging.WARNING, logger="crossbow_tf"):
        learners, outputs, each = fused_forward_against_each_learner(model)
    assert len(outputs) == len(each) == 2
    for ours, theirs in zip(outputs, each, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-5)
    assert float(np.abs(np.asarray(each[0]) - np.asarray(each[1])).max()) > 1e-3   # the learners differ
    listed = docs_list()
    if name in listed:   # listed as running once per learner: the op the engine names is the docs' op
        why = learners._not_vectorized.get(layer.name, "")
        op = re.search(r"op (\w+)", why)
        assert op, f"{name} is listed in docs/performance.md but was vectorized"
        assert f"`{op.group(1)}`" in listed[name], f"docs/performance.md gives {name} another op than {op.group(1)}"
        assert any(layer.name in r.getMessage() for r in caplog.records if r.name == "crossbow_tf")
    else:
        assert learners._not_vectorized == {}
