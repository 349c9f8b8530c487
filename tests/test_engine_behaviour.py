"""Engine behaviour beyond the update rules: Keras equivalence, determinism, per-learner state."""
import keras
import numpy as np
import pytest

from crossbow_tf.algorithms import SMA, SynchronousSGD
from crossbow_tf.data import from_arrays, load_embedded_mnist
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.schedule import StepSchedule
from crossbow_tf.engine.trainer import train
from crossbow_tf.models import build_model
from crossbow_tf.results import RunResults

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def small_cnn(seed, dropout=0.0, batchnorm=False):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 5, activation="relu"),
              keras.layers.MaxPooling2D(2)]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"),
               keras.layers.Dropout(dropout), keras.layers.Dense(10)]
    return keras.Sequential(layers)


@pytest.fixture(scope="module")
def mnist():
    return load_embedded_mnist()


@pytest.mark.parametrize("num_examples", [256, 250], ids=["full_batches", "partial_last_batch"])
def test_ssgd_epoch_equals_keras_fit_at_global_batch(num_examples, mnist, cpu_devices):
    (x, y), _ = mnist
    x, y = x[:num_examples], y[:num_examples]
    b, lr, mu = 8, 0.05, 0.9
    model = small_cnn(3)
    reference = small_cnn(3)
    reference.set_weights(model.get_weights())
    strategy = CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2)
    engine = Engine(model, LOSS, SynchronousSGD(momentum=mu), strategy)
    data = from_arrays("mnist", (x, y), (x[:32], y[:32]), num_classes=10)
    train(engine, data, b, 1, StepSchedule(lr), RunResults("t", env={}), shuffle=False, log=lambda *a: None)

    reference.compile(optimizer=keras.optimizers.SGD(lr, momentum=mu), loss=LOSS)
    reference.fit(x, y, batch_size=strategy.num_learners * b, epochs=1, shuffle=False, verbose=0)
    moved = 0.0
    for got, want, start in zip(engine.center_weights(), reference.get_weights(), small_cnn(3).get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        moved = max(moved, np.abs(want - start).max())
    assert moved > 1e-2


def _train_lenet_subset(mnist, devices, seed):
    (x, y), (xt, yt) = mnist
    keras.utils.set_random_seed(seed)
    model = build_model("lenet", (28, 28, 1), 10)
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=devices, learners_per_device=2))
    data = from_arrays("mnist", (x[:384], y[:384]), (xt[:100], yt[:100]), num_classes=10)
    train(engine, data, 16, 1, StepSchedule(0.02), RunResults("t", env={}), seed=seed, log=lambda *a: None)
    return engine.center_weights()


def test_same_seed_gives_bit_identical_center(mnist, cpu_devices):
    first = _train_lenet_subset(mnist, cpu_devices[:2], seed=5)
    second = _train_lenet_subset(mnist, cpu_devices[:2], seed=5)
    other = _train_lenet_subset(mnist, cpu_devices[:2], seed=6)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, c) for a, c in zip(first, other))


def _identical_slices_step(dropout, cpu_devices):
    """Two learners on one device, both fed the same examples, one step without correction."""
    model = small_cnn(7, dropout=dropout)
    engine = Engine(model, LOSS, SMA(alpha=0.0, momentum=0.0),
                    CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2))
    rng = np.random.default_rng(0)
    half = rng.random((8, 28, 28, 1), dtype=np.float32)
    labels = rng.integers(0, 10, 8).astype(np.int32)
    engine.train_step(np.concatenate([half, half]), np.concatenate([labels, labels]), np.ones(16), 0.1)
    return engine.learner_weights()


def test_each_learner_draws_its_own_dropout_masks(cpu_devices):
    same = _identical_slices_step(0.0, cpu_devices)
    for a, b in zip(*same):
        np.testing.assert_array_equal(a, b)
    different = _identical_slices_step(0.5, cpu_devices)
    assert any(not np.array_equal(a, b) for a, b in zip(*different))


def test_center_batchnorm_statistics_are_the_learners_mean(mnist, cpu_devices):
    (x, y), _ = mnist
    model = small_cnn(11, batchnorm=True)
    strategy = CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=3)
    engine = Engine(model, LOSS, SMA(), strategy)
    engine.train_step(x[:48], y[:48], np.ones(48), 0.05)
    float_states = [i for i, v in enumerate(model.non_trainable_variables) if "moving" in v.path]
    assert len(float_states) == 2
    for i in float_states:
        stacked = np.concatenate([engine.states[d][i].numpy() for d in range(2)])
        assert stacked.shape[0] == 6
        assert np.ptp(stacked, axis=0).max() > 0   # learners saw different data
        np.testing.assert_allclose(engine.center_states[0][i].numpy(), stacked.mean(0), atol=1e-6)
        np.testing.assert_allclose(engine.center_states[1][i].numpy(), stacked.mean(0), atol=1e-6)
    engine.write_center_to_model()
    np.testing.assert_allclose(model.non_trainable_variables[float_states[0]].numpy(),
                               engine.center_states[0][float_states[0]].numpy())


def test_unbuilt_model_is_refused(cpu_devices):
    model = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not built"):
        Engine(model, LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:1]))


def test_state_no_learner_changes_stays_exactly_zs(cpu_devices):
    """A Normalization layer's adapted statistics are non-trainable float state that training never
    writes: with k = 3 learners (a sum of 3 equal values divided by 3 rounds) z keeps them bit for bit."""
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(24, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=24).astype(np.int32)
    keras.utils.set_random_seed(0)
    norm = keras.layers.Normalization()
    norm.adapt(x)
    model = keras.Sequential([keras.Input((5,)), norm, keras.layers.Dense(3)])
    adapted = [v.numpy().copy() for v in model.non_trainable_variables]
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=3))
    for t in range(3):
        engine.train_step(x[:6], y[:6], None, 0.1)
    engine.write_center_to_model()
    assert any(not np.array_equal(a, b) for a, b in zip(engine.center_weights(), engine.learner_weights()[0]))
    for before, after in zip(adapted, model.non_trainable_variables):
        assert before.tobytes() == after.numpy().tobytes()
