"""Makes Keras's fit deliver one iteration of k*b examples per step while the user's batch is b.

- NumPy arrays (and anything else Keras slices itself): fit's batch_size is multiplied by k.
- tf.data.Dataset: each element is one learner's batch; the next k*b examples of the dataset's
  order form an iteration (k consecutive batches of b), so an epoch has ceil(N / (k*b)) steps.
- Python generators and keras.utils.PyDataset: likewise, k consecutive batches form an iteration.

The last iteration of an epoch may hold fewer than k*b examples: the training step pads it (see
``CrossbowTraining.train_step``) and masks the padding out of every loss, gradient and metric.
"""
import itertools
import math
import types

import keras
import numpy as np
import tensorflow as tf
from keras import tree

DEFAULT_BATCH_SIZE = 32   # Keras's own default for array inputs


def _concatenate(batches):
    return tree.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts], axis=0),
                              *batches)


def _leading_dim(batch):
    leaves = [leaf for leaf in tree.flatten(batch) if leaf is not None]
    if not leaves or len(np.shape(leaves[0])) == 0:
        raise ValueError("each batch must hold arrays with a leading batch dimension; got scalars "
                         "(is the dataset batched? use dataset.batch(b))")
    return int(np.shape(leaves[0])[0])


def check_batch_size(batch_size):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size is the per-learner batch b and must be a positive integer, "
                         f"got {batch_size!r}")
    return int(batch_size)


def dataset_batch_size(dataset):
    """The per-learner batch b of a batched dataset: its static batch dimension, else its first batch's."""
    leaves = tree.flatten(dataset.element_spec)
    if not leaves or any(leaf.shape.rank in (None, 0) for leaf in leaves):
        raise ValueError("the dataset must be batched (dataset.batch(b)): each element is one learner's "
                         f"batch; its element_spec is {dataset.element_spec}")
    size = leaves[0].shape[0]
    if size is None:
        first = next(iter(dataset.take(1)), None)
        if first is None:
            raise ValueError("the training dataset is empty")
        size = _leading_dim(tree.map_structure(lambda t: t.numpy(), first))
    return int(size)


class GroupedPyDataset(keras.utils.PyDataset):
    """K consecutive batches of a PyDataset per item."""

    def __init__(self, inner, k):
        super().__init__(workers=inner.workers, use_multiprocessing=inner.use_multiprocessing,
                         max_queue_size=inner.max_queue_size)
        self.inner, self.k = inner, k

    @property
    def num_batches(self):
        n = self.inner.num_batches
        return None if n is None else math.ceil(n / self.k)

    def __getitem__(self, index):
        n = self.inner.num_batches
        indices = range(index * self.k, (index + 1) * self.k)
        return _concatenate([self.inner[j] for j in indices if n is None or j < n])

    def on_epoch_begin(self):
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        self.inner.on_epoch_end()


def _grouped_generator(first, rest, k):
    source = itertools.chain([first], rest)
    while True:
        group = list(itertools.islice(source, k))
        if not group:
            return
        yield _concatenate(group)


def group_for_learners(x, batch_size, k):
    """Returns (x, batch_size to give Keras's fit, per-learner batch b)."""
    if isinstance(x, tf.data.Dataset):
        if batch_size is not None:
            raise ValueError("do not pass batch_size with a tf.data.Dataset: each dataset element is "
                             "one learner's batch (set it with dataset.batch(b))")
        b = dataset_batch_size(x)
        # Dataset.rebatch would keep the batch boundaries, but Keras's fit miscounts its steps.
        grouped = x.unbatch().batch(k * b)
        batches = int(x.cardinality())
        if batches >= 0:
            # Every batch but the last holds b examples, so the iterations are exactly ceil(batches / k);
            # telling Keras lets its progress bar show the epoch's length.
            grouped = grouped.apply(tf.data.experimental.assert_cardinality(math.ceil(batches / k)))
        return grouped, None, b
    if isinstance(x, keras.utils.PyDataset):
        if batch_size is not None:
            raise ValueError("do not pass batch_size with a PyDataset: each item is one learner's batch")
        if x.num_batches == 0:
            raise ValueError("the training PyDataset is empty")
        return GroupedPyDataset(x, k), None, _leading_dim(x[0])
    if isinstance(x, types.GeneratorType):
        if batch_size is not None:
            raise ValueError("do not pass batch_size with a generator: each yielded batch is one "
                             "learner's batch")
        first = next(x, None)
        if first is None:
            raise ValueError("the training generator yielded nothing")
        return _grouped_generator(first, x, k), None, _leading_dim(first)
    b = DEFAULT_BATCH_SIZE if batch_size is None else check_batch_size(batch_size)
    return x, k * b, b
