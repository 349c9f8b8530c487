"""What one ``fit`` step is under use_sma: a global batch of B = k*b examples, b per learner.

By default fit follows tf.distribute's convention: ``batch_size`` (and a tf.data dataset's,
generator's or PyDataset's batch) is the global batch B of one step, cut into k learner batches of
b = B / k, so Keras's own data handling is used unchanged. ``use_sma(..., per_learner_batch=True)``
keeps Crossbow's meaning, where the user's batch is one learner's b:

- NumPy arrays (and anything else Keras slices itself): fit's batch_size is multiplied by k.
- tf.data.Dataset: each element is one learner's batch; the next k*b examples of the dataset's
  order form an iteration (k consecutive batches of b), so an epoch has ceil(N / (k*b)) steps.
- Python generators and keras.utils.PyDataset: likewise, k consecutive batches form an iteration.

The last iteration of an epoch may hold fewer than B examples: the training step pads it (see
``CrossbowTraining.train_step``) and masks the padding out of every loss, gradient and metric.
"""
import dataclasses
import itertools
import math
import types

import keras
import numpy as np
import tensorflow as tf
from keras import tree

DEFAULT_BATCH_SIZE = 32   # Keras's own default for array inputs


@dataclasses.dataclass
class Plan:
    """How fit's data reaches Keras: the data, the batch_size Keras gets, the batch of one step."""
    x: object
    keras_batch_size: object
    per_learner: int            # b
    global_batch: int           # B = k*b
    first_batch: object         # () -> the first step's data, (x, y[, sample_weight]), to build the model on
    steps_per_epoch: object     # None when the data has no length (generators, repeated datasets)


def _concatenate(batches):
    return tree.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts], axis=0),
                              *batches)


def _leading_dim(batch):
    leaves = [leaf for leaf in tree.flatten(batch) if leaf is not None]
    if not leaves or len(np.shape(leaves[0])) == 0:
        raise ValueError("each batch must hold arrays with a leading batch dimension; got scalars "
                         "(is the dataset batched? use dataset.batch(b))")
    return int(np.shape(leaves[0])[0])


def check_batch_size(batch_size, per_learner_batch=False):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        meaning = "the per-learner batch b" if per_learner_batch else "the global batch per step"
        raise ValueError(f"batch_size is {meaning} and must be a positive integer, got {batch_size!r}")
    return int(batch_size)


def dataset_batch_size(dataset):
    """The batch of a batched dataset: its static batch dimension, else its first batch's."""
    leaves = tree.flatten(dataset.element_spec)
    if not leaves or any(leaf.shape.rank in (None, 0) for leaf in leaves):
        raise ValueError("the dataset must be batched (dataset.batch(batch_size)); its element_spec is "
                         f"{dataset.element_spec}")
    size = leaves[0].shape[0]
    if size is None:
        size = _leading_dim(_first_of_dataset(dataset))
    return int(size)


def _first_of_dataset(dataset):
    first = next(iter(dataset.take(1)), None)
    if first is None:
        raise ValueError("the training dataset is empty")
    return tree.map_structure(lambda t: t.numpy(), first)


def learner_batch(global_batch, k, what):
    """b = GLOBAL_BATCH / K, or one error naming both numbers (WHAT names the batch)."""
    if global_batch % k:
        lower, upper = (global_batch // k) * k, -(-global_batch // k) * k
        suggestion = f"{upper}" if lower == 0 else f"{lower} or {upper}"
        raise ValueError(
            f"{what} is the global batch per step and cannot be split among the {k} learners: use a "
            f"multiple of {k} (such as {suggestion}), or use_sma(..., per_learner_batch=True) to make it "
            "each learner's batch")
    return global_batch // k


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


def _chained(first, rest):
    # A generator again (Keras recognises generators by type), starting with the batch already taken.
    yield first
    yield from rest


def _array_rows(x, validation_split):
    n = _leading_dim(x)
    # Keras's own split point (keras.src.trainers.data_adapters.array_slicing.train_validation_split).
    return int(math.floor(n * (1.0 - validation_split))) if validation_split else n


def _first_rows(structure, rows):
    return tree.map_structure(lambda a: None if a is None else a[:rows], structure)


def plan(x, y, sample_weight, batch_size, k, per_learner_batch=False, steps_per_epoch=None,
         validation_split=0.0):
    """The Plan of one fit call with K learners (see the module docstring)."""
    if isinstance(x, tf.data.Dataset):
        size = dataset_batch_size(x)
        first = lambda: _first_of_dataset(x)  # noqa: E731  (only an unbuilt model needs it)
        cardinality = int(x.cardinality())
        batches = cardinality if cardinality >= 0 else None
        if not per_learner_batch:
            b = learner_batch(size, k, f"the dataset's batch of {size}")
            # batch_size goes to Keras, which ignores it for a dataset, as without use_sma.
            return Plan(x, batch_size, b, size, first, steps_per_epoch or batches)
        # Dataset.rebatch would keep the batch boundaries, but Keras's fit miscounts its steps.
        grouped = x.unbatch().batch(k * size)
        if batches is not None:
            # Every batch but the last holds b examples, so the iterations are exactly ceil(batches / k);
            # telling Keras lets its progress bar show the epoch's length.
            batches = math.ceil(batches / k)
            grouped = grouped.apply(tf.data.experimental.assert_cardinality(batches))
        return Plan(grouped, batch_size, size, k * size, first, steps_per_epoch or batches)
    if isinstance(x, keras.utils.PyDataset):
        if x.num_batches == 0:
            raise ValueError("the training PyDataset is empty")
        first = x[0]
        size = _leading_dim(first)
        if not per_learner_batch:
            return Plan(x, batch_size, learner_batch(size, k, f"the PyDataset's batch of {size}"), size, lambda: first,
                        steps_per_epoch or x.num_batches)
        grouped = GroupedPyDataset(x, k)
        return Plan(grouped, batch_size, size, k * size, lambda: first, steps_per_epoch or grouped.num_batches)
    if isinstance(x, types.GeneratorType):
        first = next(x, None)
        if first is None:
            raise ValueError("the training generator yielded nothing")
        size = _leading_dim(first)
        if not per_learner_batch:
            return Plan(_chained(first, x), batch_size, learner_batch(size, k, f"the generator's batch of {size}"),
                        size, lambda: first, steps_per_epoch)
        return Plan(_grouped_generator(first, x, k), batch_size, size, k * size, lambda: first, steps_per_epoch)
    if per_learner_batch:
        b = DEFAULT_BATCH_SIZE if batch_size is None else check_batch_size(batch_size, True)
        global_batch = k * b
    else:
        global_batch = DEFAULT_BATCH_SIZE if batch_size is None else check_batch_size(batch_size)
        what = f"batch_size={global_batch}" if batch_size is not None else f"the default batch_size={global_batch}"
        b = learner_batch(global_batch, k, what)
    rows = _array_rows(x, validation_split)
    steps = steps_per_epoch or math.ceil(rows / global_batch)
    return Plan(x, global_batch, b, global_batch, lambda: _first_rows((x, y, sample_weight), global_batch), steps)
