"""The data set readers against tiny files written here, byte by byte, in each real on-disk format.

The writers below follow the published format descriptions independently of the readers (which
use NumPy views), so a wrong channel order, label byte or offset in a reader shows up here. The
writers are also used by test_paper_configs.py.
"""
import gzip
import os
import struct

import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.data import augment, load_dataset
from crossbow_tf.data.cifar import load_cifar10, load_cifar100
from crossbow_tf.data.imagenet import COUNTS_FILE, load_imagenet
from crossbow_tf.data.mnist import load_mnist, read_idx
from crossbow_tf.data.pipeline import eval_batches, train_batches
from crossbow_tf.errors import DataError

# ---------------------------------------------------------------------------------------------
# Writers


def idx_bytes(array):
    """IDX: 0x0000, type code 0x08 (ubyte), number of dimensions, big-endian dimension sizes."""
    array = np.asarray(array, np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", n) for n in array.shape)
    return header + array.tobytes()


def write_idx(path, array, compress=False):
    data = idx_bytes(array)
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)


def write_mnist(directory, train, test, compress=False):
    os.makedirs(directory, exist_ok=True)
    ext = ".gz" if compress else ""
    for (x, y), (img_name, lbl_name) in ((train, ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")),
                                         (test, ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))):
        write_idx(os.path.join(directory, img_name + ext), x, compress)
        write_idx(os.path.join(directory, lbl_name + ext), y, compress)


def cifar_record(image, *labels):
    """Label byte(s), then the red plane, green plane and blue plane, each 32 rows of 32 bytes."""
    out = bytearray(labels)
    for channel in range(3):
        for row in range(32):
            for col in range(32):
                out.append(int(image[row, col, channel]))
    return bytes(out)


def write_cifar10(directory, train_batches_, test):
    """TRAIN_BATCHES_: five (images, labels); TEST: (images, labels)."""
    os.makedirs(directory, exist_ok=True)
    for i, (x, y) in enumerate(train_batches_, start=1):
        with open(os.path.join(directory, f"data_batch_{i}.bin"), "wb") as f:
            f.write(b"".join(cifar_record(img, int(l)) for img, l in zip(x, y)))
    x, y = test
    with open(os.path.join(directory, "test_batch.bin"), "wb") as f:
        f.write(b"".join(cifar_record(img, int(l)) for img, l in zip(x, y)))


def write_cifar100(directory, train, test):
    """TRAIN/TEST: (images, coarse labels, fine labels)."""
    os.makedirs(directory, exist_ok=True)
    for name, (x, coarse, fine) in (("train.bin", train), ("test.bin", test)):
        with open(os.path.join(directory, name), "wb") as f:
            f.write(b"".join(cifar_record(img, int(c), int(l)) for img, c, l in zip(x, coarse, fine)))


def random_images(rng, n, shape=(32, 32, 3)):
    return rng.integers(0, 256, (n,) + shape, dtype=np.uint8)


def jpeg(image, quality=100):
    return tf.io.encode_jpeg(tf.constant(image, tf.uint8), quality=quality).numpy()


def example(encoded, label, layout="tf_scripts"):
    if layout == "tf_scripts":
        image_key, label_key = "image/encoded", "image/class/label"
    else:
        image_key, label_key = "image", "label"
    feature = {
        image_key: tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
        label_key: tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
        "image/format": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"JPEG"])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_imagenet(directory, train, validation, layout="tf_scripts", shards=(2, 1)):
    """TRAIN/VALIDATION: lists of (jpeg bytes, stored label); written round-robin into shards."""
    os.makedirs(directory, exist_ok=True)
    for split, records, n in (("train", train, shards[0]), ("validation", validation, shards[1])):
        for s in range(n):
            name = (f"{split}-{s:05d}-of-{n:05d}" if layout == "tf_scripts"
                    else f"imagenet2012-{split}.tfrecord-{s:05d}-of-{n:05d}")
            with tf.io.TFRecordWriter(os.path.join(directory, name)) as w:
                for encoded, label in records[s::n]:
                    w.write(example(encoded, label, layout))


def solid(h, w, colour):
    return np.broadcast_to(np.asarray(colour, np.uint8), (h, w, 3)).copy()


def one_line(error):
    message = str(error.value)
    assert "\n" not in message and message
    return message


# ---------------------------------------------------------------------------------------------
# MNIST (IDX)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip(tmp_path, compress):
    rng = np.random.default_rng(1)
    x, y = random_images(rng, 7, (28, 28)), rng.integers(0, 10, 7).astype(np.uint8)
    xt, yt = random_images(rng, 3, (28, 28)), np.array([9, 0, 5], np.uint8)
    write_mnist(str(tmp_path), (x, y), (xt, yt), compress=compress)
    (x2, y2), (xt2, yt2) = load_mnist(str(tmp_path))
    np.testing.assert_array_equal(x2, x)
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(xt2, xt)
    np.testing.assert_array_equal(yt2, yt)
    source = load_dataset("mnist", str(tmp_path))
    assert source.input_shape == (28, 28, 1) and source.train.size == 7 and source.test.size == 3
    first_x, first_y = next(iter(source.test.dataset))
    np.testing.assert_allclose(first_x.numpy()[..., 0], xt[0] / 255.0, rtol=0, atol=1e-7)
    assert int(first_y) == 9


def _mnist_dir(tmp_path, n=4):
    rng = np.random.default_rng(2)
    write_mnist(str(tmp_path), (random_images(rng, n, (28, 28)), np.arange(n, dtype=np.uint8)),
                (random_images(rng, 2, (28, 28)), np.array([1, 2], np.uint8)))
    return str(tmp_path)


def test_mnist_missing_directory(tmp_path):
    with pytest.raises(DataError) as e:
        load_mnist(str(tmp_path / "nope"))
    assert "nope" in one_line(e) and "not found" in one_line(e)


def test_mnist_missing_file(tmp_path):
    d = _mnist_dir(tmp_path)
    os.remove(os.path.join(d, "t10k-labels-idx1-ubyte"))
    with pytest.raises(DataError) as e:
        load_mnist(d)
    assert "t10k-labels-idx1-ubyte" in one_line(e) and "not found" in one_line(e)


def test_idx_truncated(tmp_path):
    d = _mnist_dir(tmp_path)
    path = os.path.join(d, "train-images-idx3-ubyte")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(DataError) as e:
        load_mnist(d)
    assert path in one_line(e) and "truncated" in one_line(e)


def test_idx_wrong_magic(tmp_path):
    d = _mnist_dir(tmp_path)
    path = os.path.join(d, "train-labels-idx1-ubyte")
    with open(path, "r+b") as f:
        f.write(b"\x1f\x8b")
    with pytest.raises(DataError) as e:
        read_idx(path)
    assert path in one_line(e) and "magic" in one_line(e)


def test_idx_label_out_of_range(tmp_path):
    d = _mnist_dir(tmp_path)
    write_idx(os.path.join(d, "train-labels-idx1-ubyte"), np.array([0, 1, 10, 2], np.uint8))
    with pytest.raises(DataError) as e:
        load_mnist(d)
    assert "train-labels-idx1-ubyte" in one_line(e) and "label 10 out of range" in one_line(e)


def test_idx_empty_split(tmp_path):
    d = _mnist_dir(tmp_path)
    write_idx(os.path.join(d, "t10k-images-idx3-ubyte"), np.zeros((0, 28, 28), np.uint8))
    write_idx(os.path.join(d, "t10k-labels-idx1-ubyte"), np.zeros((0,), np.uint8))
    with pytest.raises(DataError) as e:
        load_mnist(d)
    assert "t10k-images-idx3-ubyte" in one_line(e) and "empty" in one_line(e)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (binary version)


def _cifar10_data(seed=3, per_batch=3, test=4):
    rng = np.random.default_rng(seed)
    train = [(random_images(rng, per_batch), rng.integers(0, 10, per_batch)) for _ in range(5)]
    return train, (random_images(rng, test), rng.integers(0, 10, test))


@pytest.mark.parametrize("parent", [False, True])
def test_cifar10_round_trip(tmp_path, parent):
    train, test = _cifar10_data()
    write_cifar10(str(tmp_path / "cifar-10-batches-bin"), train, test)
    source = load_cifar10(str(tmp_path if parent else tmp_path / "cifar-10-batches-bin"))
    assert source.num_classes == 10 and source.input_shape == (32, 32, 3)
    assert source.train.size == 15 and source.test.size == 4
    xs, ys = zip(*[(x.numpy(), int(y)) for x, y in source.train.dataset])
    np.testing.assert_array_equal(np.stack(xs), np.concatenate([x for x, _ in train]))
    assert list(ys) == [int(l) for _, y in train for l in y]
    xt, yt = zip(*[(x.numpy(), int(y)) for x, y in source.test.dataset])
    np.testing.assert_array_equal(np.stack(xt), test[0])
    assert list(yt) == list(test[1])


def test_cifar100_uses_fine_label(tmp_path):
    rng = np.random.default_rng(4)
    x, xt = random_images(rng, 5), random_images(rng, 2)
    coarse, fine = np.array([0, 19, 3, 7, 12]), np.array([99, 0, 42, 17, 58])
    write_cifar100(str(tmp_path / "cifar-100-binary"), (x, coarse, fine), (xt, [1, 2], [63, 64]))
    source = load_cifar100(str(tmp_path))
    assert source.num_classes == 100 and source.train.size == 5 and source.test.size == 2
    got = [(img.numpy(), int(label)) for img, label in source.train.dataset]
    np.testing.assert_array_equal(np.stack([g[0] for g in got]), x)
    assert [g[1] for g in got] == list(fine)
    assert [int(l) for _, l in source.test.dataset] == [63, 64]


def test_cifar_eval_map_normalises_per_channel(tmp_path):
    train, test = _cifar10_data()
    write_cifar10(str(tmp_path), train, test)
    source = load_cifar10(str(tmp_path))
    x, y = next(iter(eval_batches(source.test, 4, source.eval_map)))
    expected = (test[0] / 255.0 - np.array(augment.CIFAR10_MEAN)) / np.array(augment.CIFAR10_STD)
    np.testing.assert_allclose(x.numpy(), expected, rtol=0, atol=1e-5)
    assert y.numpy().tolist() == list(test[1])


def test_cifar_train_map_is_a_padded_crop_or_its_mirror():
    image = random_images(np.random.default_rng(5), 1)[0]
    train_map, _ = augment.cifar_maps((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    padded = np.pad(image, ((4, 4), (4, 4), (0, 0))) / 255.0
    windows = {}
    for dy in range(9):
        for dx in range(9):
            crop = padded[dy:dy + 32, dx:dx + 32]
            windows[(dy, dx, False)] = crop
            windows[(dy, dx, True)] = crop[:, ::-1]
    seen = set()
    for i in range(40):
        out, label = train_map(tf.constant(image), tf.constant(7), tf.constant([11, i], tf.int64))
        out = out.numpy()
        assert int(label) == 7 and out.shape == (32, 32, 3)
        match = [key for key, w in windows.items() if np.allclose(out, w, atol=1e-6)]
        assert match, "augmented image is not a window of the 4-padded image"
        seen.add(match[0])
        again, _ = train_map(tf.constant(image), tf.constant(7), tf.constant([11, i], tf.int64))
        np.testing.assert_array_equal(again.numpy(), out)
    assert {flip for _, _, flip in seen} == {False, True}
    assert len({(dy, dx) for dy, dx, _ in seen}) > 10


def _write_cifar10_default(tmp_path):
    train, test = _cifar10_data()
    write_cifar10(str(tmp_path), train, test)
    return str(tmp_path)


def test_cifar_missing_directory(tmp_path):
    with pytest.raises(DataError) as e:
        load_cifar10(str(tmp_path / "absent"))
    assert "absent" in one_line(e) and "not found" in one_line(e)


def test_cifar_missing_file(tmp_path):
    d = _write_cifar10_default(tmp_path)
    os.remove(os.path.join(d, "data_batch_3.bin"))
    with pytest.raises(DataError) as e:
        load_cifar10(d)
    assert "data_batch_3.bin" in one_line(e) and "not found" in one_line(e)


def test_cifar_truncated_file(tmp_path):
    d = _write_cifar10_default(tmp_path)
    path = os.path.join(d, "test_batch.bin")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(DataError) as e:
        load_cifar10(d)
    assert path in one_line(e) and "3073" in one_line(e)


def test_cifar100_file_given_as_cifar10_is_a_record_size_error(tmp_path):
    rng = np.random.default_rng(6)
    x = random_images(rng, 3)
    write_cifar100(str(tmp_path / "c100"), (x, [1, 2, 3], [4, 5, 6]), (x, [1, 2, 3], [4, 5, 6]))
    os.makedirs(tmp_path / "c10")
    for i in range(1, 6):
        os.link(tmp_path / "c100" / "train.bin", tmp_path / "c10" / f"data_batch_{i}.bin")
    os.link(tmp_path / "c100" / "test.bin", tmp_path / "c10" / "test_batch.bin")
    with pytest.raises(DataError) as e:
        load_cifar10(str(tmp_path / "c10"))
    assert "data_batch_1.bin" in one_line(e) and "cifar100" in one_line(e)


@pytest.mark.parametrize("which", ["cifar10", "cifar100"])
def test_cifar_label_out_of_range(tmp_path, which):
    rng = np.random.default_rng(7)
    if which == "cifar10":
        train, test = _cifar10_data()
        test = (test[0], np.array([1, 2, 10, 3]))
        write_cifar10(str(tmp_path), train, test)
        bad, loader, text = "test_batch.bin", load_cifar10, "label 10, out of range 0..9"
    else:
        x = random_images(rng, 3)
        write_cifar100(str(tmp_path), (x, [0, 1, 2], [5, 100, 6]), (x, [0, 1, 2], [1, 2, 3]))
        bad, loader, text = "train.bin", load_cifar100, "label 100, out of range 0..99"
    with pytest.raises(DataError) as e:
        loader(str(tmp_path))
    assert bad in one_line(e) and text in one_line(e)


def test_cifar_empty_split(tmp_path):
    d = _write_cifar10_default(tmp_path)
    open(os.path.join(d, "test_batch.bin"), "wb").close()
    with pytest.raises(DataError) as e:
        load_cifar10(d)
    assert "test_batch.bin" in one_line(e) and "empty" in one_line(e)


def test_cifar_pickled_version_is_refused(tmp_path):
    os.makedirs(tmp_path / "cifar-10-batches-py")
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(DataError) as e:
        load_cifar10(str(tmp_path))
    assert "data_batch_1" in one_line(e) and "binary version" in one_line(e)


# ---------------------------------------------------------------------------------------------
# ImageNet (TFRecord shards of JPEG-encoded images)


def _imagenet_records(rng, n, base=1, shape=(40, 48, 3)):
    images = [random_images(rng, 1, shape)[0] for _ in range(n)]
    labels = [int(l) + base for l in rng.integers(0, 1000, n)]
    return images, [(jpeg(img), l) for img, l in zip(images, labels)]


@pytest.mark.parametrize("layout,base", [("tf_scripts", 1), ("tfds", 0)])
def test_imagenet_round_trip(tmp_path, layout, base):
    rng = np.random.default_rng(8)
    _, train = _imagenet_records(rng, 5, base)
    _, val = _imagenet_records(rng, 3, base)
    train[0] = (train[0][0], base)            # class 0
    train[1] = (train[1][0], 999 + base)      # class 999
    write_imagenet(str(tmp_path), train, val, layout=layout)
    source = load_imagenet(str(tmp_path))
    assert source.train.size == 5 and source.test.size == 3
    assert source.input_shape == (224, 224, 3) and source.num_classes == 1000
    # Unshuffled order: the two train shards are read in parallel; compare as a multiset.
    got = sorted((bytes(e.numpy()), int(l)) for e, l in source.train.dataset)
    assert got == sorted((e, l - base) for e, l in train)
    assert {l for _, l in got} >= {0, 999}
    got_val = [(bytes(e.numpy()), int(l)) for e, l in source.test.dataset]
    assert got_val == [(e, l - base) for e, l in val]
    # The JPEG decodes to the written pixels up to quality-100 JPEG error (chroma subsampling
    # and rounding), so only a loose bound is honest here; the maps are checked exactly below.
    decoded = tf.io.decode_jpeg(got_val[0][0]).numpy().astype(int)
    assert decoded.shape == (40, 48, 3)


def test_imagenet_explicit_label_base(tmp_path):
    rng = np.random.default_rng(9)
    _, train = _imagenet_records(rng, 2, base=0)
    train = [(train[0][0], 0), (train[1][0], 999)]
    write_imagenet(str(tmp_path), train, train[:1], shards=(1, 1))
    # TF-script keys default to base 1, so label 0 is out of range...
    with pytest.raises(DataError) as e:
        load_imagenet(str(tmp_path))
    assert "train-00000-of-00001" in one_line(e) and "label 0 out of range 1..1000" in one_line(e)
    # ...unless the base is given explicitly.
    source = load_imagenet(str(tmp_path), label_base=0)
    assert sorted(int(l) for _, l in source.train.dataset) == [0, 999]


def test_imagenet_counts_are_stored_and_invalidated(tmp_path):
    rng = np.random.default_rng(10)
    _, train = _imagenet_records(rng, 4)
    write_imagenet(str(tmp_path), train, train[:2])
    assert load_imagenet(str(tmp_path)).train.size == 4
    assert os.path.isfile(tmp_path / COUNTS_FILE)
    # A rewritten shard (new size) is counted again rather than trusted from the stored counts.
    with tf.io.TFRecordWriter(str(tmp_path / "train-00001-of-00002")) as w:
        for e, l in train * 3:
            w.write(example(e, l))
    assert load_imagenet(str(tmp_path)).train.size == 2 + 12


def test_imagenet_eval_map_resizes_and_centre_crops(tmp_path):
    # Left and right halves of different colours, split on a JPEG block boundary so that
    # quality-100 JPEG reproduces each half to within rounding; 256 rows need no resize.
    colour_a, colour_b = (200, 40, 40), (30, 90, 220)
    image = np.concatenate([solid(256, 160, colour_a), solid(256, 160, colour_b)], axis=1)
    write_imagenet(str(tmp_path), [(jpeg(image), 5)], [(jpeg(image), 5)], shards=(1, 1))
    source = load_imagenet(str(tmp_path))
    x, y = next(iter(eval_batches(source.test, 1, source.eval_map)))
    assert x.shape == (1, 224, 224, 3) and int(y[0]) == 4
    pixels = x.numpy()[0] * np.array(augment.IMAGENET_STD) + np.array(augment.IMAGENET_MEAN)
    # Centre crop of 320 columns keeps 48..271: 112 columns of A, then 112 of B.
    np.testing.assert_allclose(pixels[:, :104], np.broadcast_to(np.array(colour_a) / 255, (224, 104, 3)), atol=3 / 255)
    np.testing.assert_allclose(pixels[:, 120:], np.broadcast_to(np.array(colour_b) / 255, (224, 104, 3)), atol=3 / 255)


def test_imagenet_train_map_crops_resizes_and_is_seeded(tmp_path):
    colour = (10, 200, 120)
    write_imagenet(str(tmp_path), [(jpeg(solid(64, 96, colour)), 3)] * 6, [(jpeg(solid(8, 8, colour)), 3)],
                   shards=(1, 1))
    source = load_imagenet(str(tmp_path))
    runs = [[(x.numpy(), y.numpy(), m.numpy()) for x, y, m in
             train_batches(source.train, 4, epoch=1, seed=3, map_fn=source.train_map)] for _ in range(2)]
    (x, y, m), _ = runs[0]
    assert x.shape == (4, 224, 224, 3) and list(y) == [2] * 4 and list(m) == [1.0] * 4
    # A crop of a solid image is that colour, normalised.
    pixels = x * np.array(augment.IMAGENET_STD) + np.array(augment.IMAGENET_MEAN)
    np.testing.assert_allclose(pixels, np.broadcast_to(np.array(colour) / 255, x.shape), atol=3 / 255)
    for (a, _, _), (b, _, _) in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_imagenet_random_crops_differ_between_examples_and_epochs(tmp_path):
    # A horizontal gradient: different crops or flips give different images.
    ramp = np.tile(np.linspace(0, 255, 128).astype(np.uint8)[None, :, None], (96, 1, 3))
    write_imagenet(str(tmp_path), [(jpeg(ramp), 1)] * 4, [(jpeg(ramp), 1)], shards=(1, 1))
    source = load_imagenet(str(tmp_path))
    epoch1 = next(iter(train_batches(source.train, 4, 1, seed=0, map_fn=source.train_map)))[0].numpy()
    epoch2 = next(iter(train_batches(source.train, 4, 2, seed=0, map_fn=source.train_map)))[0].numpy()
    assert len({a.tobytes() for a in epoch1}) == 4
    assert not np.array_equal(epoch1, epoch2)


def _imagenet_dir(tmp_path, n=3):
    rng = np.random.default_rng(11)
    _, train = _imagenet_records(rng, n, shape=(16, 16, 3))
    write_imagenet(str(tmp_path), train, train[:1])
    return str(tmp_path)


def test_imagenet_missing_directory(tmp_path):
    with pytest.raises(DataError) as e:
        load_imagenet(str(tmp_path / "gone"))
    assert "gone" in one_line(e) and "not found" in one_line(e)


def test_imagenet_missing_shards(tmp_path):
    d = _imagenet_dir(tmp_path)
    os.remove(os.path.join(d, "validation-00000-of-00001"))
    with pytest.raises(DataError) as e:
        load_imagenet(d)
    assert d in one_line(e) and "no validation shards" in one_line(e)


def test_imagenet_truncated_shard(tmp_path):
    d = _imagenet_dir(tmp_path)
    path = os.path.join(d, "train-00000-of-00002")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)
    with pytest.raises(DataError) as e:
        load_imagenet(d)
    assert path in one_line(e) and "truncated" in one_line(e)


def test_imagenet_label_out_of_range(tmp_path):
    rng = np.random.default_rng(12)
    _, train = _imagenet_records(rng, 2, shape=(16, 16, 3))
    write_imagenet(str(tmp_path), [train[0], (train[1][0], 1001)], train[:1], shards=(1, 1))
    with pytest.raises(DataError) as e:
        load_imagenet(str(tmp_path))
    assert "train-00000-of-00001" in one_line(e) and "label 1001 out of range" in one_line(e)


def test_imagenet_empty_shard(tmp_path):
    d = _imagenet_dir(tmp_path)
    path = os.path.join(d, "validation-00000-of-00001")
    open(path, "wb").close()
    with pytest.raises(DataError) as e:
        load_imagenet(d)
    assert path in one_line(e) and "empty" in one_line(e)


def test_imagenet_unknown_feature_keys(tmp_path):
    d = _imagenet_dir(tmp_path)
    path = os.path.join(d, "train-00000-of-00002")
    feature = {"pixels": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"x"]))}
    with tf.io.TFRecordWriter(path) as w:
        w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    with pytest.raises(DataError) as e:
        load_imagenet(d)
    assert path in one_line(e) and "unknown feature keys" in one_line(e)


# ---------------------------------------------------------------------------------------------
# The pipeline with seeded augmentation


def test_augmented_pipeline_is_deterministic_and_epochs_differ(tmp_path):
    train, test = _cifar10_data(per_batch=8)
    write_cifar10(str(tmp_path), train, test)
    source = load_cifar10(str(tmp_path))

    def epoch(e, seed=0):
        return [(x.numpy(), y.numpy(), m.numpy()) for x, y, m in
                train_batches(source.train, 16, e, seed=seed, map_fn=source.train_map, deterministic=True)]

    a, b, c = epoch(1), epoch(1), epoch(2)
    assert len(a) == 3 and a[-1][2].tolist() == [1.0] * 8 + [0.0] * 8   # 40 = 16 + 16 + 8
    for (xa, ya, ma), (xb, yb, mb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert not all(np.array_equal(xa, xc) for (xa, _, _), (xc, _, _) in zip(a, c))
    # Every example of the epoch appears once among the real (unmasked) rows.
    labels = np.concatenate([y[m > 0] for _, y, m in a])
    assert sorted(labels.tolist()) == sorted(int(l) for _, y in train for l in y)


def test_augmentation_does_not_depend_on_parallel_map_scheduling(tmp_path):
    train, test = _cifar10_data(per_batch=8)
    write_cifar10(str(tmp_path), train, test)
    source = load_cifar10(str(tmp_path))

    def epoch_images(deterministic):
        batches = train_batches(source.train, 40, 1, seed=5, map_fn=source.train_map,
                                deterministic=deterministic)
        (x, _, _), = [(x.numpy(), y, m) for x, y, m in batches]
        return sorted(img.tobytes() for img in x)

    # Each example's crop and flip are tied to its position in the epoch, not to which parallel
    # map call finished first: unordered output holds exactly the same augmented images.
    assert epoch_images(False) == epoch_images(True)
