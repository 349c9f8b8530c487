"""Fused forms of preprocessing, augmentation, 1-D, depthwise and separable convolution layers and of
nested models compute what replicated learners compute."""
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers as L

from crossbow_tf.algorithms import SMA
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.fused import FusedLearners, UnsupportedModel
from crossbow_tf.engine.replicated import ReplicatedLearners
from test_fused import LOSS, assert_same_training

RESCALE, OFFSET = 1 / 2.0, -0.25


def augmented_images(input_shape=(12, 12, 3), num_classes=4):
    """How keras-io's vision examples open: rescale, normalise, an augmentation block, then convolutions."""
    inputs = keras.Input(input_shape)
    x = L.Rescaling(RESCALE, offset=OFFSET)(inputs)
    normalization = L.Normalization()
    normalization.adapt(np.random.default_rng(5).random((64,) + input_shape, dtype=np.float32) * RESCALE + OFFSET)
    x = normalization(x)
    augmentation = keras.Sequential([
        L.RandomFlip(), L.RandomRotation(0.2), L.RandomTranslation(0.1, 0.1), L.RandomZoom(0.2),
        L.RandomContrast(0.3), L.RandomBrightness(0.2), L.RandomCrop(10, 10)], name="augmentation")
    x = augmentation(x)
    x = L.Conv2D(4, 3, activation="relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, L.Dense(num_classes)(x))


def depthwise_and_separable(input_shape=(12, 12, 3), num_classes=4):
    inputs = keras.Input(input_shape)
    x = L.DepthwiseConv2D(3, depth_multiplier=2, padding="same", activation="relu")(inputs)
    x = L.DepthwiseConv2D(3, strides=2)(x)
    x = L.SeparableConv2D(5, 3, padding="same", depth_multiplier=2, activation="relu")(x)
    x = L.SeparableConv2D(4, 3, dilation_rate=2, activation="tanh")(x)
    x = L.Dense(3, activation="relu")(x)            # a Dense on every pixel
    x = L.Flatten()(x)
    return keras.Model(inputs, L.Dense(num_classes)(x))


def sequences(input_shape=(20, 3), num_classes=4):
    inputs = keras.Input(input_shape)
    x = L.Conv1D(6, 3, padding="causal", dilation_rate=2, activation="relu")(inputs)
    x = L.BatchNormalization()(x)
    x = L.Dropout(0.3)(x)
    x = L.ZeroPadding1D((1, 2))(x)
    x = L.Conv1D(6, 3, strides=2, padding="same")(x)
    x = L.MaxPooling1D(2)(x)
    y = L.Dense(5, activation="relu")(x)            # a Dense on every step of a sequence
    x = L.Conv1D(4, 2, use_bias=False)(y)
    x = L.AveragePooling1D(2, padding="same")(x)
    x = L.Concatenate()([L.GlobalAveragePooling1D()(x), L.GlobalMaxPooling1D()(y), L.Flatten()(x)])
    return keras.Model(inputs, L.Dense(num_classes)(x))


def nested_blocks(input_shape=(10, 10, 3), num_classes=4):
    """A Sequential stem without an Input, a Functional residual block used twice, a Sequential head
    holding another Sequential."""
    block_input = keras.Input((input_shape[0] - 2, input_shape[1] - 2, 4))
    h = L.BatchNormalization()(L.Conv2D(4, 3, padding="same")(block_input))
    block = keras.Model(block_input, L.ReLU()(L.Add()([block_input, h])), name="residual")
    stem = keras.Sequential([L.Conv2D(4, 3), L.ReLU()], name="stem")
    head = keras.Sequential([L.GlobalAveragePooling2D(),
                             keras.Sequential([L.Dense(6, activation="relu"), L.Dropout(0.2)], name="inner")],
                            name="head")
    inputs = keras.Input(input_shape)
    x = block(block(stem(inputs)))
    return keras.Model(inputs, L.Dense(num_classes)(head(x)))


def test_rescaling_normalization_and_augmentation_layers_train_as_replicated(cpu_devices):
    # A moderate rate: at 0.05 this model's weights grow past 20 within three steps, and rounding
    # differences with them.
    assert_same_training(augmented_images, (12, 12, 3), 4, cpu_devices[:2], m=2, b=4, lr=0.01)


# One device: these layers' fused forms are per device, and a second device's copy of the step
# (traced again, about 3 CPU s a model) checks nothing new. Learners on a second device drawing
# their own dropout masks and augmentations are checked above and in tests/test_fused.py.
def test_depthwise_and_separable_convolutions_and_dense_on_images_train_as_replicated(cpu_devices):
    assert_same_training(depthwise_and_separable, (12, 12, 3), 4, cpu_devices[:1], m=2, b=4)


def test_conv1d_and_sequence_layers_train_as_replicated(cpu_devices):
    assert_same_training(sequences, (20, 3), 4, cpu_devices[:1], m=2, b=4)


def test_nested_sequential_and_functional_models_train_as_replicated(cpu_devices):
    assert_same_training(nested_blocks, (10, 10, 3), 4, cpu_devices[:1], m=2, b=4)


def every_other_image_layer(input_shape=(12, 12, 3), num_classes=4):
    """Keras's remaining image preprocessing layers in one chain (Equalization first: later in a chain
    Keras's own graph building reports it as part of a cycle)."""
    value_range = dict(value_range=(0, 1))
    chain = [
        L.Equalization(**value_range), L.RandomHue(0.3, **value_range), L.RandomSaturation(0.3, **value_range),
        L.RandomGrayscale(0.5), L.RandomSharpness(0.3, **value_range), L.RandomShear(0.2, 0.2),
        L.RandomPerspective(0.5), L.RandomErasing(**value_range), L.RandomGaussianBlur(0.5, **value_range),
        L.RandomColorJitter(brightness_factor=0.2, contrast_factor=0.2, **value_range),
        L.RandomInvert(**value_range), L.RandomPosterization(4, value_range=(0, 255)),
        L.RandomColorDegeneration(0.3, **value_range), L.RandomElasticTransform(**value_range),
        L.Solarization(0.5, 0.5, **value_range), L.AutoContrast(**value_range), L.AugMix(**value_range),
        L.RandAugment(**value_range), L.CutMix(), L.MixUp(), L.Resizing(11, 11), L.CenterCrop(10, 10),
        L.ContrastLimitedAdaptiveHistogramEqualization(**value_range)]
    x = inputs = keras.Input(input_shape)
    for layer in chain:
        x = layer(x)
    x = L.GlobalAveragePooling2D()(L.Conv2D(4, 3, activation="relu")(x))
    return keras.Model(inputs, L.Dense(num_classes)(x))


def test_every_other_keras_image_preprocessing_layer_trains_as_replicated(cpu_devices):
    assert_same_training(every_other_image_layer, (12, 12, 3), 4, cpu_devices[:1], m=2, b=4, steps=2)


def test_each_learner_draws_its_own_augmentation(cpu_devices):
    """Same data and weights for every learner: only their own random transformations can separate them."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8, 8, 1))
    x = keras.Sequential([L.RandomFlip(), L.RandomTranslation(0.2, 0.2)])(inputs)
    model = keras.Model(inputs, L.Dense(3)(L.Flatten()(x)))
    engine = Engine(model, LOSS, SMA(alpha=0.0, momentum=0.0),
                    CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2), learners="fused")
    rng = np.random.default_rng(0)
    x = rng.random((4, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 3, 4).astype(np.int32)
    engine.train_step(np.concatenate([x, x]), np.concatenate([y, y]), np.ones(8), 0.1)
    first, second = engine.learner_weights()
    assert not np.array_equal(first[0], second[0])
    # At inference the user's model (z) leaves images alone, as Keras defines these layers.
    engine.write_center_to_model()
    kernel, bias = model.layers[-1].get_weights()
    np.testing.assert_allclose(model.predict(x, verbose=0), x.reshape(4, -1) @ kernel + bias, rtol=1e-5, atol=1e-6)


def test_fused_learners_leave_normalization_statistics_as_adapted():
    keras.utils.set_random_seed(0)
    model = augmented_images()
    normalization = next(layer for layer in model.layers if isinstance(layer, L.Normalization))
    adapted = [normalization.adapt_mean.numpy(), normalization.adapt_variance.numpy()]
    learners = FusedLearners(model, LOSS)
    m, b = 3, 4
    states = [tf.constant(np.stack([v.numpy()] * m)) for v in model.non_trainable_variables]
    weights = [tf.constant(np.stack([v.numpy()] * m)) for v in model.trainable_variables]
    x = tf.constant(np.random.default_rng(1).random((m, b, 12, 12, 3), dtype=np.float32))
    _, _, new_states, _ = learners(weights, states, x, np.zeros((m, b), np.int32), np.ones((m, b), np.float32))
    by_variable = dict(zip((id(v) for v in model.non_trainable_variables), new_states))
    for variable, expected in zip([normalization.adapt_mean, normalization.adapt_variance], adapted):
        np.testing.assert_array_equal(by_variable[id(variable)].numpy(), np.stack([expected] * m))


def test_the_replicated_notice_comes_once_per_model(cpu_devices, caplog):
    keras.utils.set_random_seed(0)

    def model_with(name):
        # A regularized kernel has no fused form (its penalty is the model's, not a learner's).
        return keras.Sequential([keras.Input((6,)), L.Dense(4), L.Dense(4, kernel_regularizer="l2", name=name),
                                 L.Dense(2)])
    first, second = model_with("first_norm"), model_with("second_norm")
    strategy = CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2)
    with caplog.at_level(logging.WARNING, logger="crossbow_tf"):
        for model in (first, first, second, first):
            assert isinstance(Engine(model, LOSS, SMA(), strategy).learner_computation, ReplicatedLearners)
    notices = [r.getMessage() for r in caplog.records if r.name == "crossbow_tf"]
    assert len(notices) == 2
    assert "'first_norm'" in notices[0] and "'second_norm'" in notices[1]


def _refusal(*hidden):
    inputs = keras.Input((12, 12, 3) if not isinstance(hidden[0], L.Conv1D) else (12, 3))
    x = inputs
    for layer in hidden:
        x = layer(x)
    model = keras.Model(inputs, L.Dense(2)(L.Flatten()(x)))
    with pytest.raises(UnsupportedModel) as refused:
        FusedLearners(model, LOSS)
    return str(refused.value)


def test_layers_without_an_exact_fused_form_are_refused_with_the_reason():
    assert "grouped Conv1D is not fused" in _refusal(L.Conv1D(6, 3, groups=3, name="grouped"))
    assert "'grouped'" in _refusal(L.Conv1D(6, 3, groups=3, name="grouped"))
    assert "only the last" in _refusal(L.BatchNormalization(axis=1))
    assert "Normalization keeping axes" in _refusal(L.Normalization(axis=(1, 2, 3), mean=0.5, variance=2.0))
    assert "more than one axis" in _refusal(L.Rescaling(np.ones((12, 1, 1), np.float32)))
    refused = _refusal(keras.Sequential([L.Conv2D(3, 3), L.Dense(3, kernel_regularizer="l2", name="inner_dense")],
                                        name="block"))
    assert "'block/inner_dense' (Dense)" in refused
