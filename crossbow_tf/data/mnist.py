"""MNIST from the four IDX files (plain or gzip-compressed)."""
import gzip
import os
import struct

import numpy as np

from crossbow_tf.errors import DataError

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path, expected_ndim=None):
    """Reads one IDX file (optionally gzip-compressed) into a NumPy array."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if len(data) < 4:
        raise DataError(f"{path}: truncated header ({len(data)} bytes)")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code not in _IDX_DTYPES or ndim == 0:
        raise DataError(f"{path}: wrong magic number 0x{data[:4].hex()} (not an IDX file)")
    if expected_ndim is not None and ndim != expected_ndim:
        raise DataError(f"{path}: expected {expected_ndim} dimensions, the header says {ndim}")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataError(f"{path}: truncated header")
    shape = struct.unpack(">" + "I" * ndim, data[4:header_len])
    dtype = np.dtype(_IDX_DTYPES[dtype_code])
    expected = int(np.prod(shape)) * dtype.itemsize
    body = len(data) - header_len
    if body != expected:
        raise DataError(f"{path}: truncated or oversized file: header shape {shape} needs "
                        f"{expected} bytes of data, found {body}")
    return np.frombuffer(data, dtype=dtype, offset=header_len).reshape(shape).astype(dtype.newbyteorder("="))


def _find(data_dir, stem):
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    raise DataError(f"{os.path.join(data_dir, stem)}[.gz]: file not found")


def load_idx_pair(images_path, labels_path, num_classes=10):
    """Reads an images/labels IDX pair and checks that they agree."""
    images = read_idx(images_path, expected_ndim=3)
    labels = read_idx(labels_path, expected_ndim=1)
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{labels_path}: {labels.shape[0]} labels for {images.shape[0]} images in {images_path}")
    if images.shape[0] == 0:
        raise DataError(f"{images_path}: the split is empty")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{labels_path}: label {int(labels.max())} out of range 0..{num_classes - 1}")
    return images, labels.astype(np.int32)


def load_mnist(data_dir):
    """Loads MNIST from DATA_DIR holding the four standard IDX files (plain or .gz).

    Returns ((x_train, y_train), (x_test, y_test)); images are uint8 of shape (N, 28, 28).
    """
    if not os.path.isdir(data_dir):
        raise DataError(f"{data_dir}: data directory not found")
    out = []
    for split in ("train", "test"):
        img_stem, lbl_stem = MNIST_FILES[split]
        out.append(load_idx_pair(_find(data_dir, img_stem), _find(data_dir, lbl_stem)))
    return tuple(out)


def to_model_input(images):
    """uint8 (N, 28, 28) -> float32 (N, 28, 28, 1) scaled to [0, 1]."""
    return (images.astype(np.float32) / 255.0)[..., None]
