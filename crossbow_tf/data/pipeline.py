"""tf.data pipelines that yield each iteration's k slices of b examples.

An iteration takes the next k*b examples of the epoch's order; learner j trains on the j-th
consecutive slice of b. The last iteration of an epoch may hold fewer real examples: it is padded to
k*b by repeating its own examples, and a mask (1.0 real, 0.0 padding) keeps padding out of every
loss, gradient and metric. (BatchNorm batch statistics of that one iteration do see the repeated
examples.) An epoch is therefore ceil(N / (k*b)) iterations and sees every example once.
"""
import math
import os

import tensorflow as tf

AUTOTUNE = tf.data.AUTOTUNE


def iterations_per_epoch(num_examples, global_batch):
    return math.ceil(num_examples / global_batch)


def _pad_to(global_batch):
    def pad(x, y):
        n = tf.shape(y)[0]
        index = tf.range(global_batch) % n
        mask = tf.cast(tf.range(global_batch) < n, tf.float32)
        return tf.gather(x, index), tf.gather(y, index), mask
    return pad


def default_input_threads():
    """Threads for decoding and augmentation: half the cores, so the training step keeps the rest."""
    return max(1, (os.cpu_count() or 2) // 2)


def input_options(threads=None):
    """tf.data options for input that runs beside training on the same CPU cores."""
    threads = threads or default_input_threads()
    # Measured on 2 cores (LeNet, 8 fused learners): with tf.data's autotuner and the shared thread
    # pools, about one epoch in three ran every iteration at 40 ms instead of 30 ms; a private pool
    # of fixed size without the autotuner ran every epoch at 30 ms.
    options = tf.data.Options()
    options.autotune.enabled = False
    options.threading.private_threadpool_size = threads
    options.threading.max_intra_op_parallelism = 1
    return options


def train_batches(split, global_batch, epoch, seed=0, shuffle=True, map_fn=None,
                  shuffle_buffer=None, deterministic=True, threads=None, skip_iterations=0, rows=None):
    """The iterations of one training epoch as (x, y, mask) with a leading dimension of k*b.

    The epoch's order is a shuffle seeded by (SEED, EPOCH): the same seed gives the same order.
    SKIP_ITERATIONS leaves out the epoch's first iterations (a resumed run continues the same order
    with the same augmentation; the skipped examples are not augmented).
    THREADS (default: half the cores) decode and augment in parallel on a private thread pool.
    ROWS = (start, stop) keeps only those rows of every iteration (one worker's learners' slices,
    see ``Engine.local_rows``), decoded and augmented alone, and yields (x, y, mask, count) with
    COUNT the iteration's real examples over all rows: the rows hold the same values as the same
    rows of the whole iteration.
    """
    threads = threads or default_input_threads()
    ds = split.dataset
    epoch_seed = seed * 100_003 + epoch
    sharded_shuffle = getattr(split, "shuffled", None)
    if shuffle and sharded_shuffle is not None:
        # Sharded splits too large to shuffle whole (ImageNet) shuffle shard order, then a window.
        ds = sharded_shuffle(epoch_seed, shuffle_buffer)
    elif shuffle:
        buffer = shuffle_buffer or split.size
        ds = ds.shuffle(buffer, seed=epoch_seed, reshuffle_each_iteration=False)
    skipped = skip_iterations * global_batch
    if skipped:
        ds = ds.skip(skipped)
    if rows is not None:
        return _rows_of_batches(ds, global_batch, rows, map_fn, threads, deterministic, epoch_seed, skipped)
    if map_fn is not None:
        if getattr(map_fn, "needs_seed", False):
            # Random augmentation draws from stateless ops seeded by (epoch seed, position in the
            # epoch), so parallel map calls cannot change which example gets which crop or flip.
            positions = tf.data.Dataset.counter(start=skipped)
            ds = tf.data.Dataset.zip((ds, positions)).map(
                lambda example, i: map_fn(*example, tf.stack([tf.constant(epoch_seed, tf.int64), i])),
                num_parallel_calls=threads, deterministic=deterministic)
        else:
            ds = ds.map(map_fn, num_parallel_calls=threads, deterministic=deterministic)
    ds = ds.batch(global_batch).map(_pad_to(global_batch), num_parallel_calls=threads)
    return ds.prefetch(2).with_options(input_options(threads))


def _rows_of_batches(ds, global_batch, rows, map_fn, threads, deterministic, epoch_seed, first_position=0):
    """ROWS of every iteration of DS (stored examples in the epoch's order): cut and padded before
    MAP_FN runs, so that a worker decodes and augments only its own rows."""
    start, stop = rows
    seeded = map_fn is not None and getattr(map_fn, "needs_seed", False)
    if seeded:   # positions in the epoch seed the augmentation, as in the whole-iteration pipeline
        ds = tf.data.Dataset.zip((ds, tf.data.Dataset.counter(start=first_position)))

    def pick(*batch):
        n = tf.shape(tf.nest.flatten(batch)[0])[0]
        positions = tf.range(start, stop)
        index = positions % n   # padding repeats the iteration's own examples, as _pad_to does
        picked = tf.nest.map_structure(lambda t: tf.gather(t, index), batch)
        mask = tf.cast(positions < n, tf.float32)
        return picked, mask, tf.fill([stop - start], tf.cast(n, tf.float32))

    def apply(picked, mask, count):
        if seeded:
            (x, y), i = picked
            x, y = map_fn(x, y, tf.stack([tf.constant(epoch_seed, tf.int64), i]))
        elif map_fn is not None:
            x, y = map_fn(*picked)
        else:
            x, y = picked
        return x, y, mask, count

    ds = ds.batch(global_batch).map(pick).unbatch()
    ds = ds.map(apply, num_parallel_calls=threads, deterministic=deterministic).batch(stop - start, drop_remainder=True)
    ds = ds.map(lambda x, y, mask, count: (x, y, mask, count[0]))
    return ds.prefetch(2).with_options(input_options(threads))


def eval_batches(split, batch_size, map_fn=None):
    """The evaluation split in order, as (x, y) batches (the last may be smaller)."""
    ds = split.dataset
    if map_fn is not None:
        ds = ds.map(map_fn, num_parallel_calls=AUTOTUNE)
    return ds.batch(batch_size).prefetch(AUTOTUNE)
