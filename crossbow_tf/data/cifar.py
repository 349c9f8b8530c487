"""CIFAR-10 and CIFAR-100 from the official binary-version files (never the pickled Python version).

CIFAR-10 (cifar-10-binary.tar.gz -> cifar-10-batches-bin/): data_batch_1.bin .. data_batch_5.bin and
test_batch.bin, records of 1 label byte + 3072 image bytes. CIFAR-100 (cifar-100-binary.tar.gz ->
cifar-100-binary/): train.bin and test.bin, records of 1 coarse-label byte, 1 fine-label byte and
3072 image bytes; we use the fine (100-class) label. Image bytes are channel-major: 1024 red, then
1024 green, then 1024 blue values, each plane row-major.
"""
import os

import numpy as np

from crossbow_tf.data import augment
from crossbow_tf.data.source import from_arrays
from crossbow_tf.errors import DataError

IMAGE_SHAPE = (32, 32, 3)
IMAGE_BYTES = 32 * 32 * 3


class _Layout:
    def __init__(self, name, subdir, train_files, test_files, label_bytes, num_classes, mean, std,
                 python_subdir, python_marker):
        self.name, self.subdir = name, subdir
        # How the pickled Python version (which we refuse) is laid out, to say so when it is given.
        self.python_subdir, self.python_marker = python_subdir, python_marker
        self.train_files, self.test_files = train_files, test_files
        self.label_bytes, self.num_classes = label_bytes, num_classes
        self.mean, self.std = mean, std

    @property
    def record_bytes(self):
        return self.label_bytes + IMAGE_BYTES


CIFAR10 = _Layout("cifar10", "cifar-10-batches-bin", [f"data_batch_{i}.bin" for i in range(1, 6)],
                  ["test_batch.bin"], 1, 10, augment.CIFAR10_MEAN, augment.CIFAR10_STD,
                  "cifar-10-batches-py", "data_batch_1")
CIFAR100 = _Layout("cifar100", "cifar-100-binary", ["train.bin"], ["test.bin"], 2, 100,
                   augment.CIFAR100_MEAN, augment.CIFAR100_STD, "cifar-100-python", "train")


def read_records(path, layout):
    """Reads one binary file; returns (uint8 images (N, 32, 32, 3), int32 labels (N,))."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    size, rec = len(data), layout.record_bytes
    if size == 0:
        raise DataError(f"{path}: empty file (no records)")
    if size % rec:
        other = CIFAR100 if layout is CIFAR10 else CIFAR10
        hint = (f"; its size fits {other.name}'s {other.record_bytes}-byte records"
                if size % other.record_bytes == 0 else "")
        raise DataError(f"{path}: truncated or wrong record size: {size} bytes is not a multiple of "
                        f"the {rec}-byte {layout.name} record{hint}")
    records = np.frombuffer(data, np.uint8).reshape(-1, rec)
    labels = records[:, layout.label_bytes - 1].astype(np.int32)   # CIFAR-100: the fine label
    bad = labels >= layout.num_classes
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"{path}: record {i} has label {labels[i]}, out of range 0..{layout.num_classes - 1}")
    if layout is CIFAR100:
        coarse = records[:, 0]
        if (coarse >= 20).any():
            i = int(np.argmax(coarse >= 20))
            raise DataError(f"{path}: record {i} has coarse label {coarse[i]}, out of range 0..19 "
                            "(not a CIFAR-100 binary file?)")
    images = records[:, layout.label_bytes:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def _resolve_dir(data_dir, layout):
    if not data_dir:
        raise DataError(f"the {layout.name} data set needs --data-dir (the {layout.subdir} "
                        "directory of the official binary version, or its parent)")
    if not os.path.isdir(data_dir):
        raise DataError(f"{data_dir}: data directory not found")
    for candidate in (data_dir, os.path.join(data_dir, layout.subdir)):
        if os.path.isfile(os.path.join(candidate, layout.train_files[0])):
            return candidate
    for directory in (data_dir, os.path.join(data_dir, layout.python_subdir)):
        pickled = os.path.join(directory, layout.python_marker)
        if os.path.isfile(pickled):
            raise DataError(f"{pickled}: this is the pickled Python version, which we never unpickle; "
                            f"download the binary version ({layout.subdir})")
    raise DataError(f"{os.path.join(data_dir, layout.train_files[0])}: file not found "
                    f"(also looked in {os.path.join(data_dir, layout.subdir)})")


def _read_split(directory, names, layout):
    parts = [read_records(os.path.join(directory, n), layout) for n in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def load_cifar_arrays(data_dir, layout):
    """((x_train, y_train), (x_test, y_test)) as uint8 NHWC images and int32 labels."""
    directory = _resolve_dir(data_dir, layout)
    return (_read_split(directory, layout.train_files, layout),
            _read_split(directory, layout.test_files, layout))


def _load(data_dir, layout):
    train, test = load_cifar_arrays(data_dir, layout)
    train_map, eval_map = augment.cifar_maps(layout.mean, layout.std)
    # Images stay uint8 in memory (4x smaller); the maps convert and normalise per example.
    return from_arrays(layout.name, train, test, num_classes=layout.num_classes,
                       train_map=train_map, eval_map=eval_map)


def load_cifar10(data_dir):
    return _load(data_dir, CIFAR10)


def load_cifar100(data_dir):
    return _load(data_dir, CIFAR100)
