"""A user's own arrays: ``data: {name: npz, path: FILE.npz}``.

The file holds x_train, y_train, x_test and y_test as Keras's ``keras.datasets.*.load_data()``
returns them (``np.savez(FILE, x_train=..., ...)``): features of shape (N, H, W) (greyscale
images, which get a channel axis), (N, H, W, C) or any (N, ...), as uint8 (scaled to [0, 1]) or
floats (taken as they are, as float32); integer labels of shape (N,) or (N, 1). The classes are
0 .. the largest training label; the input shape is the features' own.

NumPy's ``np.load(FILE, mmap_mode="r")`` reads every member of an .npz into memory (the option
applies to .npy files only; NumPy 2.4 here). Members stored uncompressed (``np.savez``) are
therefore memory-mapped here directly: the .npy data of a stored zip member is a contiguous run
of the file, found from the member's local zip header and its .npy header. Compressed members
(``np.savez_compressed``) cannot be mapped and are read into memory.
"""
import os
import struct
import zipfile

import numpy as np

from crossbow_tf.errors import DataError

KEYS = ("x_train", "y_train", "x_test", "y_test")
# Features up to this size are copied into TensorFlow, the fastest input. Larger ones stay
# memory-mapped and are read example by example in the input pipeline (about 50 us per example
# on this 2-core machine, against 20 us in memory), so a file larger than RAM still trains.
IN_MEMORY_BYTES = 256 * 2**20
# Rows checked for NaN at a time: a large memory-mapped file is read once, never copied whole.
_CHECK_ROWS = 4096
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")   # a zip member's local file header (30 bytes)
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def read_npz(path):
    """{key: array} of the four KEYS in PATH: np.memmap for members stored uncompressed, arrays
    read into memory for compressed ones. DataError names a missing file or key."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise DataError(f"{path}: not an .npz file ({e})") from None
    with archive:
        members = {info.filename[:-4]: info for info in archive.infolist() if info.filename.endswith(".npy")}
        missing = [k for k in KEYS if k not in members]
        if missing:
            held = ", ".join(sorted(members)) or "no arrays"
            raise DataError(f"{path}: no {', '.join(missing)} (the file holds {held}); expected x_train, y_train, "
                            "x_test, y_test as keras.datasets.*.load_data() returns them")
        return {k: _read_member(path, archive, members[k], k) for k in KEYS}


def _read_member(path, archive, info, key):
    try:
        if info.compress_type == zipfile.ZIP_STORED:
            mapped = _map_stored(path, info)
            if mapped is not None:
                return mapped
        with archive.open(info) as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except ValueError as e:   # object arrays (pickles), a damaged header, a truncated member
        raise DataError(f"{path}: {key} cannot be read ({e})") from None


def _map_stored(path, info):
    """The stored member INFO of PATH as a read-only np.memmap (None for a .npy version without
    a public header reader)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size:
            raise ValueError("truncated zip member")
        *_, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        f.seek(info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)
        version = np.lib.format.read_magic(f)
        if version not in _HEADER_READERS:
            return None
        shape, fortran_order, dtype = _HEADER_READERS[version](f)
        offset = f.tell()
    if dtype.hasobject:
        raise ValueError("an object array, which would need unpickling; store numbers")
    if 0 in shape:
        return np.empty(shape, dtype)   # mmap cannot map zero bytes
    if offset + int(np.prod(shape)) * dtype.itemsize > os.path.getsize(path):
        raise ValueError("truncated: the file ends before the array does")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran_order else "C")


def check_arrays(path, arrays):
    """(labels of train and test as int32 (N,), number of classes) after checking the four ARRAYS;
    DataError, one line naming the key, for anything a training run could not use."""
    labels = {}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if y.ndim == 2 and y.shape[1] == 1:   # CIFAR's load_data gives (N, 1)
            y = y.reshape(-1)
        if y.ndim != 1:
            raise DataError(f"{path}: y_{split} must be labels of shape (N,) or (N, 1), got shape {y.shape}")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: y_{split} must hold integer class labels, got {y.dtype}")
        if x.ndim < 2:
            raise DataError(f"{path}: x_{split} must be examples of shape (N, ...), got shape {x.shape}")
        if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
            raise DataError(f"{path}: x_{split} must be uint8 images or floats, got {x.dtype}")
        if len(x) != len(y):
            raise DataError(f"{path}: x_{split} holds {len(x)} examples but y_{split} {len(y)} labels")
        if len(y) == 0:
            raise DataError(f"{path}: the {split} split is empty (x_{split} and y_{split} hold no examples)")
        labels[split] = y
    if arrays["x_train"].dtype != arrays["x_test"].dtype:
        raise DataError(f"{path}: x_train is {arrays['x_train'].dtype} but x_test {arrays['x_test'].dtype}; "
                        "store both alike (uint8 is scaled to [0, 1], floats are not)")
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise DataError(f"{path}: x_train's examples are of shape {arrays['x_train'].shape[1:]}, "
                        f"x_test's of shape {arrays['x_test'].shape[1:]}")
    num_classes = int(labels["train"].max()) + 1
    for split, y in labels.items():
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= num_classes:
            bad = low if low < 0 else high
            raise DataError(f"{path}: y_{split} holds label {bad}, out of range 0..{num_classes - 1} "
                            "(the classes are 0 .. the largest label of y_train)")
    if num_classes < 2:
        raise DataError(f"{path}: y_train holds only class 0; classification needs at least 2 classes")
    for key in ("x_train", "x_test"):
        x = arrays[key]
        if x.dtype != np.uint8:
            for start in range(0, len(x), _CHECK_ROWS):
                rows = x[start:start + _CHECK_ROWS]
                if not np.isfinite(rows).all():
                    bad = start + int(np.argwhere(~np.isfinite(rows))[0][0])
                    raise DataError(f"{path}: {key} is not finite (NaN or infinity) in example {bad}")
    return {split: y.astype(np.int32) for split, y in labels.items()}, num_classes


def load_npz(path):
    """The DataSource of the .npz file at PATH (see the module's notes)."""
    import tensorflow as tf

    from crossbow_tf.data.source import DataSource, Split

    if not path:
        raise DataError("the npz data set needs data.path: the .npz file holding x_train, y_train, x_test, y_test")
    arrays = read_npz(path)
    labels, num_classes = check_arrays(path, arrays)
    x_train, x_test = arrays["x_train"], arrays["x_test"]
    stored_shape = x_train.shape[1:]
    greyscale = len(stored_shape) == 2   # (N, H, W) as Keras's MNIST: Conv2D needs a channel axis
    input_shape = stored_shape + (1,) if greyscale else stored_shape

    def to_model_input(x):
        x = tf.cast(x, tf.float32)
        if x_train.dtype == np.uint8:
            x = x / 255.0
        return x[..., None] if greyscale else x

    if x_train.nbytes + x_test.nbytes <= IN_MEMORY_BYTES:
        def split(x, y):
            return Split(tf.data.Dataset.from_tensor_slices((np.asarray(x), y)), len(y))

        def prepare(x, y):
            return to_model_input(x), y
        train, test = split(x_train, labels["train"]), split(x_test, labels["test"])
    else:
        # Stored examples are (row, label): the shuffle buffer holds rows, and the map reads each
        # example from the mapped file. Rows of the test split follow those of the training split,
        # so one map serves both (the trainer maps training examples with eval_map too).
        n_train = len(x_train)

        def read(row):
            return x_train[row] if row < n_train else x_test[row - n_train]

        def split(first_row, y):
            rows = tf.data.Dataset.range(first_row, first_row + len(y))
            return Split(tf.data.Dataset.zip((rows, tf.data.Dataset.from_tensor_slices(y))), len(y))

        def prepare(row, y):
            x = tf.numpy_function(read, [row], tf.as_dtype(x_train.dtype), stateful=False)
            x.set_shape(stored_shape)
            return to_model_input(x), y
        train, test = split(0, labels["train"]), split(n_train, labels["test"])
    return DataSource(name=os.path.basename(path), train=train, test=test, input_shape=tuple(input_shape), num_classes=num_classes,
                      train_map=prepare, eval_map=prepare)
