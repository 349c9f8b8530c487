"""train_batches(rows=...): one worker's rows of every iteration, decoded alone, hold the same values
as those rows of the whole iteration (padding of the last one and seeded augmentation included)."""
import numpy as np
import pytest

from crossbow_tf.data import augment
from crossbow_tf.data.pipeline import train_batches
from crossbow_tf.data.source import from_arrays


@pytest.mark.parametrize("augmented", [False, True])
def test_rows_equal_the_same_rows_of_the_whole_iteration(augmented):
    rng = np.random.default_rng(0)
    n, global_batch = 100, 24   # 5 iterations, the last with 4 real examples and 20 of padding
    x = rng.integers(0, 256, (n, 32, 32, 3)).astype(np.uint8)
    y = rng.integers(0, 10, n).astype(np.int32)
    train_map = augment.cifar_maps(np.zeros(3), np.ones(3))[0] if augmented else None
    split = from_arrays("t", (x, y), (x[:1], y[:1]), num_classes=10).train
    whole = list(train_batches(split, global_batch, epoch=2, seed=5, map_fn=train_map))
    assert len(whole) == 5
    for start, stop in [(0, 8), (8, 16), (16, 24)]:   # 3 workers' rows
        part = list(train_batches(split, global_batch, epoch=2, seed=5, map_fn=train_map, rows=(start, stop)))
        assert len(part) == len(whole)
        for (wx, wy, wm), (px, py, pm, count) in zip(whole, part):
            np.testing.assert_array_equal(px.numpy(), wx.numpy()[start:stop])
            np.testing.assert_array_equal(py.numpy(), wy.numpy()[start:stop])
            np.testing.assert_array_equal(pm.numpy(), wm.numpy()[start:stop])
            assert float(count) == wm.numpy().sum()
    assert float(part[-1][3]) == 4 and part[-1][2].numpy().sum() == 0   # the last worker's rows: all padding
