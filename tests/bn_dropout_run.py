"""`python tests/bn_dropout_run.py ARGS...`: `python -m crossbow_tf.run ARGS...`, and the model
``bn_dropout`` (convolution, BatchNorm, Dropout) that the checkpoint tests' configs name as a user's
model (``model: tests/bn_dropout_run.py:bn_dropout``), so that they can kill and resume a real
training process whose learners have BatchNorm statistics and Dropout seed state."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crossbow_tf import run  # noqa: E402


def bn_dropout(input_shape, num_classes):
    import keras
    layers = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        layers.Conv2D(8, 5, strides=2, use_bias=False),
        layers.BatchNormalization(),
        layers.Activation("relu"),
        layers.Flatten(),
        layers.Dense(32, use_bias=False),
        layers.BatchNormalization(),
        layers.ReLU(),
        layers.Dropout(0.3),
        layers.Dense(num_classes),
    ], name="bn_dropout")


if __name__ == "__main__":
    sys.exit(run.main())
