"""What every data set loader returns: examples as tf.data plus how to prepare them."""
import dataclasses
from typing import Callable, Optional

import tensorflow as tf


@dataclasses.dataclass
class Split:
    """One split: a tf.data.Dataset of single (features, label) examples and its size."""
    dataset: tf.data.Dataset
    size: int


@dataclasses.dataclass
class DataSource:
    """A data set ready for the pipeline.

    TRAIN_MAP and EVAL_MAP turn one stored example into a model input (decode, augment, normalise);
    None means the stored example is already the model input.
    """
    name: str
    train: Split
    test: Split
    input_shape: tuple
    num_classes: int
    train_map: Optional[Callable] = None
    eval_map: Optional[Callable] = None


def from_arrays(name, train, test, num_classes, train_map=None, eval_map=None):
    """A DataSource over in-memory NumPy arrays ((x_train, y_train), (x_test, y_test))."""
    (x, y), (xt, yt) = train, test
    return DataSource(
        name=name,
        train=Split(tf.data.Dataset.from_tensor_slices((x, y)), len(y)),
        test=Split(tf.data.Dataset.from_tensor_slices((xt, yt)), len(yt)),
        input_shape=tuple(x.shape[1:]), num_classes=num_classes,
        train_map=train_map, eval_map=eval_map)
