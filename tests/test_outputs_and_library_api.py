"""Output files are written atomically and a finished run's results survive a failed write; the
library Engine takes NumPy float64 batches and restarts its learners from z at a learning-rate drop."""
import json
import os

import keras
import numpy as np
import pytest

from crossbow_tf import cli
from crossbow_tf.algorithms import SMA
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.files import OutputError, atomic_write_text, check_writable
from crossbow_tf.results import RunResults

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _results():
    r = RunResults("sma", {"seed": 0}, env={"python": "3"})
    r.add_evaluation(epoch=1, iteration=10, examples=160, wall_time=1.5, accuracy=0.9, loss=0.3)
    return r


def test_atomic_write_leaves_only_the_file_and_keeps_a_users_tmp_file(tmp_path):
    users = tmp_path / "run.json.tmp"       # the name the old writer used for its temporary file
    users.write_text("the user's own file")
    path = tmp_path / "run.json"
    _results().save(str(path))
    _results().save(str(path))               # replacing works too
    assert sorted(os.listdir(tmp_path)) == ["run.json", "run.json.tmp"]
    assert users.read_text() == "the user's own file"
    assert json.loads(path.read_text())["evaluations"][0]["accuracy"] == 0.9


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "keep.txt"
    path.write_text("old")
    with pytest.raises(TypeError):
        atomic_write_text(str(path), object())   # fails while writing
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["keep.txt"]


def test_results_survive_an_unwritable_path(tmp_path, capsys):
    """The directory checked before training was replaced by a file when the run ended."""
    target = tmp_path / "out" / "run.json"
    check_writable(str(target), what="results file")   # fine before training
    (tmp_path / "out").write_text("now a file")
    with pytest.raises(OutputError, match="cannot write the results .*; they are saved in (.*\\.json)") as info:
        cli.save_results(_results(), str(target))
    fallback = str(info.value).rsplit("saved in ", 1)[1]
    try:
        assert json.load(open(fallback))["evaluations"][0]["accuracy"] == 0.9
    finally:
        os.remove(fallback)


def _engine(devices, m=2):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    return Engine(model, LOSS, SMA(), CrossbowStrategy(devices=devices, learners_per_device=m))


def _batch(seed, rows=8):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 4)), rng.integers(0, 3, rows)   # float64 and int64, as NumPy makes them


def test_engine_takes_float64_numpy_batches(cpu_devices):
    engine = _engine(cpu_devices[:1])
    x, y = _batch(0)
    assert x.dtype == np.float64
    loss, predictions = engine.train_step(x, y, None, 0.1)
    same = _engine(cpu_devices[:1])
    loss32, _ = same.train_step(x.astype("float32"), y, np.ones(8), 0.1)
    assert np.isfinite(float(loss)) and float(loss) == float(loss32)
    assert predictions.shape == (8, 3)


def _trained(devices, rates, reset_on_lr_drop=True, reset_before=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=devices, learners_per_device=2),
                    reset_on_lr_drop=reset_on_lr_drop)
    for i, lr in enumerate(rates):
        if i == reset_before:
            engine.reset_learners()
        engine.train_step(*_batch(i), None, lr)
    return engine.learner_weights()


def test_engine_resets_learners_when_the_rate_drops(cpu_devices):
    rates = (0.1, 0.1, 0.1, 0.01, 0.01, 0.02)
    automatic = _trained(cpu_devices[:1], rates)
    by_hand = _trained(cpu_devices[:1], rates, reset_on_lr_drop=False, reset_before=3)
    never = _trained(cpu_devices[:1], rates, reset_on_lr_drop=False)
    for a, b in zip(automatic, by_hand):
        for wa, wb in zip(a, b):
            np.testing.assert_array_equal(wa, wb)
    # Equal to one reset by hand before iteration 3: none at the steady rates or the rise after it.
    assert not np.array_equal(automatic[0][0], never[0][0])


def test_engine_reset_can_be_left_to_the_caller(cpu_devices):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2),
                    reset_on_lr_drop=False)
    calls = []
    engine._reset = lambda: calls.append(1)
    for i, lr in enumerate((0.1, 0.05, 0.01)):
        engine.train_step(*_batch(i), None, lr)
    assert calls == []
