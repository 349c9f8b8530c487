"""Crossbow's LeNet for MNIST."""
import keras
from keras import layers


def lenet(input_shape=(28, 28, 1), num_classes=10, dropout=0.4, name="lenet"):
    """Conv 5x5x32 valid, ReLU, max-pool 2, Conv 5x5x64 valid, ReLU, max-pool 2,
    Dense 1024, ReLU, dropout, Dense NUM_CLASSES (logits)."""
    return keras.Sequential([
        keras.Input(input_shape),
        layers.Conv2D(32, 5, padding="valid", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Conv2D(64, 5, padding="valid", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(1024, activation="relu"),
        layers.Dropout(dropout),
        layers.Dense(num_classes),
    ], name=name)


def lenet_bn(input_shape=(28, 28, 1), num_classes=10, dropout=0.4, name="lenet_bn"):
    """LeNet with BatchNormalization after each convolution and the hidden dense layer (before
    its ReLU): the study's model for z's averaged-versus-recomputed BatchNorm statistics."""
    return keras.Sequential([
        keras.Input(input_shape),
        layers.Conv2D(32, 5, padding="valid", use_bias=False),
        layers.BatchNormalization(),
        layers.ReLU(),
        layers.MaxPooling2D(2),
        layers.Conv2D(64, 5, padding="valid", use_bias=False),
        layers.BatchNormalization(),
        layers.ReLU(),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(1024, use_bias=False),
        layers.BatchNormalization(),
        layers.ReLU(),
        layers.Dropout(dropout),
        layers.Dense(num_classes),
    ], name=name)
