"""Writes digits.npz as a user would from keras.datasets.mnist.load_data(): uint8 images (N, 28, 28)
and integer labels. Offline, it takes the embedded 4,000 / 1,000 digits shipped with crossbow_tf."""
import numpy as np

from crossbow_tf.data import load_embedded_mnist

(x_train, y_train), (x_test, y_test) = load_embedded_mnist()   # float32 (N, 28, 28, 1) in [0, 1]


def to_uint8(images):
    return np.rint(images[..., 0] * 255).astype(np.uint8)


np.savez("digits.npz", x_train=to_uint8(x_train), y_train=y_train, x_test=to_uint8(x_test), y_test=y_test)
print("wrote digits.npz")
