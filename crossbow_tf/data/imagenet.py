"""ImageNet (ILSVRC-2012) from TFRecord shards of serialised tf.train.Example records.

Two writers are understood, recognised by the feature keys of the first record:
- TensorFlow's preparation scripts (models/research/inception build_imagenet_data.py, the TPU
  imagenet_to_gcs.py): files train-00000-of-01024 and validation-00000-of-00128, JPEG bytes under
  `image/encoded`, label under `image/class/label` in 1..1000 (0 is reserved for "background").
- TensorFlow Datasets (imagenet2012): files imagenet2012-train.tfrecord-00000-of-01024 and
  imagenet2012-validation.tfrecord-00000-of-00064, JPEG bytes under `image`, label under `label`
  in 0..999.
Labels reach the model as 0..999: LABEL_BASE (1 for the TF-script layout, 0 for TFDS unless given
explicitly) is subtracted.

Split sizes are needed before training (iterations per epoch, learning-rate drops). They come,
first found first: from TFDS's dataset_info.json (shardLengths); from a counts file
`crossbow_counts.json` that this loader writes beside the shards (or, when that directory is
read-only, under ~/.cache/crossbow_tf/) keyed by file name, size and modification time; or from one
counting pass over the files, which also checks every label's range and that no record is
truncated, and is then stored in the counts file.
"""
import dataclasses
import glob
import hashlib
import json
import logging
import os
from typing import Callable, Optional, Tuple

import tensorflow as tf

from crossbow_tf.data import augment
from crossbow_tf.data.source import DataSource, Split
from crossbow_tf.errors import DataError

NUM_CLASSES = 1000
COUNTS_FILE = "crossbow_counts.json"
# Records read ahead from all shards of an epoch before drawing: a window shuffle after the shard
# order itself is shuffled (a whole-split buffer would hold 140 GB of JPEGs).
SHUFFLE_BUFFER = 10_000

PATTERNS = {
    "train": ("train-*-of-*", "*-train.tfrecord-*-of-*"),
    "validation": ("validation-*-of-*", "*-validation.tfrecord-*-of-*"),
}
LAYOUTS = {   # name: (image key, label key, default label base)
    "tf_scripts": ("image/encoded", "image/class/label", 1),
    "tfds": ("image", "label", 0),
}

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class ShardedSplit(Split):
    """A Split stored in shards: shuffles its shard order and then a window of records per epoch.

    The pipeline calls ``shuffled(seed, buffer)`` instead of shuffling the whole split.
    """
    files: Tuple[str, ...] = ()
    parse: Optional[Callable] = None
    shuffle_buffer: int = SHUFFLE_BUFFER

    def shuffled(self, seed, buffer=None):
        files = tf.data.Dataset.from_tensor_slices(list(self.files))
        files = files.shuffle(len(self.files), seed=seed, reshuffle_each_iteration=False)
        ds = files.interleave(tf.data.TFRecordDataset, cycle_length=min(16, len(self.files)),
                              num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        ds = ds.map(self.parse, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.shuffle(buffer or self.shuffle_buffer, seed=seed, reshuffle_each_iteration=False)


def find_shards(data_dir, split):
    """The shard files of SPLIT ("train" or "validation") in DATA_DIR, sorted."""
    for pattern in PATTERNS[split]:
        files = sorted(glob.glob(os.path.join(data_dir, pattern)))
        if files:
            return files
    raise DataError(f"{data_dir}: no {split} shards (looked for {' and '.join(PATTERNS[split])})")


def detect_layout(path):
    """Which writer produced PATH, from the feature keys of its first record."""
    try:
        first = next(iter(tf.data.TFRecordDataset(path).take(1)), None)
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError) as e:
        raise DataError(f"{path}: not a readable TFRecord file ({_first_line(e)})") from None
    if first is None:
        raise DataError(f"{path}: empty shard (no records)")
    example = tf.train.Example()
    try:
        example.ParseFromString(first.numpy())
    except Exception:   # protobuf's DecodeError type varies between implementations
        raise DataError(f"{path}: the first record is not a tf.train.Example") from None
    keys = set(example.features.feature)
    for name, (image_key, label_key, _) in LAYOUTS.items():
        if image_key in keys and label_key in keys:
            return name
    raise DataError(f"{path}: unknown feature keys {sorted(keys)}; expected image/encoded + "
                    "image/class/label (TF scripts) or image + label (TFDS)")


def _first_line(error):
    return str(getattr(error, "message", error)).strip().splitlines()[0]


def _parser(layout, label_base):
    image_key, label_key, _ = LAYOUTS[layout]
    spec = {image_key: tf.io.FixedLenFeature([], tf.string),
            label_key: tf.io.FixedLenFeature([], tf.int64)}

    def parse(serialised):
        features = tf.io.parse_single_example(serialised, spec)
        return features[image_key], tf.cast(features[label_key] - label_base, tf.int32)
    return parse


def _label_parser(layout):
    label_key = LAYOUTS[layout][1]
    spec = {label_key: tf.io.FixedLenFeature([], tf.int64)}
    return lambda records: tf.io.parse_example(records, spec)[label_key]


def _file_key(path):
    st = os.stat(path)
    return [st.st_size, int(st.st_mtime_ns)]


def _count_file(path, layout):
    """(records, min label, max label) of one shard, reading it once."""
    parse = _label_parser(layout)
    ds = tf.data.TFRecordDataset(path, buffer_size=8 << 20).batch(4096).map(
        parse, num_parallel_calls=tf.data.AUTOTUNE)
    count, low, high = 0, None, None
    try:
        for labels in ds:
            labels = labels.numpy()
            count += len(labels)
            low = int(labels.min()) if low is None else min(low, int(labels.min()))
            high = int(labels.max()) if high is None else max(high, int(labels.max()))
    except tf.errors.DataLossError as e:
        raise DataError(f"{path}: truncated or corrupt TFRecord ({_first_line(e)})") from None
    except tf.errors.InvalidArgumentError as e:
        raise DataError(f"{path}: a record lacks the label feature or is malformed "
                        f"({_first_line(e)})") from None
    return count, low, high


def _cache_paths(data_dir):
    digest = hashlib.sha1(os.path.abspath(data_dir).encode()).hexdigest()[:16]
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(data_dir, COUNTS_FILE),
            os.path.join(home, "crossbow_tf", f"imagenet-counts-{digest}.json")]


def _read_cache(data_dir):
    for path in _cache_paths(data_dir):
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            continue
    return {}


def _write_cache(data_dir, cache):
    for path in _cache_paths(data_dir):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(cache, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
            return
        except OSError:
            continue
    _log.warning("could not store ImageNet record counts in %s", " or ".join(_cache_paths(data_dir)))


def _tfds_counts(data_dir, split):
    """Records per split from TFDS's dataset_info.json, or None."""
    path = os.path.join(data_dir, "dataset_info.json")
    try:
        with open(path) as f:
            info = json.load(f)
        for entry in info.get("splits", []):
            if entry.get("name") == split:
                return sum(int(n) for n in entry["shardLengths"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def split_size(data_dir, files, split, layout, label_base, num_classes=NUM_CLASSES):
    """Records in FILES (one split); counts once and checks labels, then remembers the counts."""
    if layout == "tfds":
        n = _tfds_counts(data_dir, split)
        if n is not None:
            return n
    cache = _read_cache(data_dir)
    total, changed = 0, False
    for path in files:
        name, key = os.path.basename(path), _file_key(path)
        entry = cache.get(name)
        if not entry or entry.get("key") != key:
            if not changed:
                _log.warning("counting the records of %s once (stored in %s)", data_dir, COUNTS_FILE)
            count, low, high = _count_file(path, layout)
            entry = cache[name] = {"key": key, "count": count, "min_label": low, "max_label": high}
            changed = True
        if entry["count"] == 0:
            raise DataError(f"{path}: empty shard (no records)")
        low, high = entry["min_label"] - label_base, entry["max_label"] - label_base
        if low < 0 or high >= num_classes:
            bad = entry["min_label"] if low < 0 else entry["max_label"]
            raise DataError(f"{path}: label {bad} out of range {label_base}..{num_classes - 1 + label_base} "
                            f"for the {layout} layout (label base {label_base})")
        total += entry["count"]
    if changed:
        _write_cache(data_dir, cache)
    return total


def _split(data_dir, split, label_base):
    files = find_shards(data_dir, split)
    layout = detect_layout(files[0])
    base = LAYOUTS[layout][2] if label_base is None else label_base
    size = split_size(data_dir, files, split, layout, base)
    parse = _parser(layout, base)
    ds = tf.data.TFRecordDataset(files, num_parallel_reads=min(8, len(files)))
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ShardedSplit(dataset=ds, size=size, files=tuple(files), parse=parse)


def load_imagenet(data_dir, label_base=None, image_size=augment.IMAGENET_SIZE):
    """A DataSource over the train and validation shards in DATA_DIR.

    LABEL_BASE: the stored label of class 0; None takes it from the layout (1 for TF's scripts,
    0 for TFDS). Examples are (JPEG bytes, label); the maps decode and augment them.
    """
    if not data_dir:
        raise DataError("the imagenet data set needs --data-dir (the directory of the TFRecord shards)")
    if not os.path.isdir(data_dir):
        raise DataError(f"{data_dir}: data directory not found")
    if label_base not in (None, 0, 1):
        raise DataError(f"imagenet: label_base must be 0, 1 or None, got {label_base!r}")
    train, test = _split(data_dir, "train", label_base), _split(data_dir, "validation", label_base)
    train_map, eval_map = augment.imagenet_maps(size=image_size)
    return DataSource(name="imagenet", train=train, test=test, input_shape=(image_size, image_size, 3),
                      num_classes=NUM_CLASSES, train_map=train_map, eval_map=eval_map)
