"""A user's own model for crossbow_tf: `model: my_models:build` in the config."""
import keras


def build(input_shape, num_classes):
    """A small CNN returning logits, uncompiled (each method compiles or wraps it its own way)."""
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(num_classes),
    ])
