"""Data sets by name: each loader returns a DataSource (see source.py)."""
from crossbow_tf.config import DEFAULT_DATA_DIRS, FILE_DATA_SETS, data_directory_problem
from crossbow_tf.data.cifar import load_cifar10, load_cifar100
from crossbow_tf.data.embedded import load_embedded_mnist
from crossbow_tf.data.imagenet import load_imagenet
from crossbow_tf.data.mnist import load_mnist, to_model_input
from crossbow_tf.data.npz import load_npz
from crossbow_tf.data.source import DataSource, Split, from_arrays
from crossbow_tf.errors import ConfigError, DataError


def _mnist_embedded(data_dir=None):
    return from_arrays("mnist_embedded", *load_embedded_mnist(), num_classes=10)


def _mnist(data_dir=None):
    if not data_dir:
        raise DataError("the mnist data set needs --data-dir (a directory with the four IDX files)")
    (x, y), (xt, yt) = load_mnist(data_dir)
    return from_arrays("mnist", (to_model_input(x), y), (to_model_input(xt), yt), num_classes=10)


def _fashion_mnist(data_dir=None):
    problem = data_directory_problem("fashion_mnist", data_dir)
    if problem:
        raise DataError(problem)
    (x, y), (xt, yt) = load_mnist(data_dir or DEFAULT_DATA_DIRS["fashion_mnist"][0])
    return from_arrays("fashion_mnist", (to_model_input(x), y), (to_model_input(xt), yt), num_classes=10)


DATASETS = {"mnist_embedded": _mnist_embedded, "mnist": _mnist, "fashion_mnist": _fashion_mnist,
            "cifar10": load_cifar10, "cifar100": load_cifar100, "imagenet": load_imagenet, "npz": load_npz}


def load_dataset(name, data_dir=None, path=None):
    """Loads data set NAME (a key of DATASETS) from DATA_DIR, or from the file PATH (config.FILE_DATA_SETS)."""
    try:
        loader = DATASETS[name]
    except KeyError:
        raise ConfigError(f"unknown data set {name!r}; choose one of {', '.join(sorted(DATASETS))}") from None
    return loader(path) if name in FILE_DATA_SETS else loader(data_dir)


__all__ = ["DATASETS", "DataSource", "Split", "from_arrays", "load_dataset", "load_mnist",
           "load_embedded_mnist", "load_cifar10", "load_cifar100", "load_imagenet", "load_npz"]
