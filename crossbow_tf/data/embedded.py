"""The embedded offline default data set: 5,000 real MNIST digits (see embedded/README.md)."""
import os

import numpy as np

from crossbow_tf.data.mnist import load_idx_pair, to_model_input

_DIR = os.path.join(os.path.dirname(__file__), "embedded")
SPLIT_SEED = 1234
TRAIN_SIZE = 4000


def load_embedded_mnist(split_seed=SPLIT_SEED, train_size=TRAIN_SIZE):
    """Returns ((x_train, y_train), (x_test, y_test)) as float32 (N, 28, 28, 1) in [0, 1] and int32.

    The file is sorted by label, so it is shuffled with a fixed seed before the split.
    """
    images, labels = load_idx_pair(os.path.join(_DIR, "mnist5k-images-idx3-ubyte.gz"),
                                   os.path.join(_DIR, "mnist5k-labels-idx1-ubyte.gz"))
    order = np.random.default_rng(split_seed).permutation(len(labels))
    x, y = to_model_input(images[order]), labels[order]
    return (x[:train_size], y[:train_size]), (x[train_size:], y[train_size:])
