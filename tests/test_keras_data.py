"""fit's data under use_sma: arrays, tf.data, generators, PyDataset, steps_per_epoch, validation,
all in tf.distribute's batch convention (the batch is the global batch B = k*b per step; see
tests/test_keras_conventions.py for per_learner_batch); and the clear errors for bad use."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.keras import get_training, use_sma
from keras_learners import four_learners

K, B = 4, 6          # 4 learners of 6 examples: a global batch of K * B = 24 per step
G = K * B


def _data(n=66, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _model(optimizer=None, loss=None, seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _sma(cpu_devices, **kwargs):
    return use_sma(_model(**kwargs), four_learners(cpu_devices))


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, b):
        super().__init__()
        self.x, self.y, self.b = x, y, b

    def __len__(self):
        return -(-len(self.x) // self.b)

    def __getitem__(self, i):
        return self.x[i * self.b:(i + 1) * self.b], self.y[i * self.b:(i + 1) * self.b]


def test_every_input_kind_trains_the_same_iterations(cpu_devices):
    x, y = _data()                   # 66 examples: iterations of k*b = 24, 24 and a partial 18
    reference = _sma(cpu_devices)
    reference.fit(x, y, batch_size=G, epochs=2, shuffle=False, verbose=0)
    assert reference.optimizer.iterations.numpy() == 6

    kinds = {
        "dataset": dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(G), epochs=2),
        "pydataset": dict(x=Batches(x, y, G), epochs=2, shuffle=False),   # else Keras shuffles its items
    }
    for name, kwargs in kinds.items():
        model = _sma(cpu_devices)
        model.fit(verbose=0, **kwargs)
        assert model.optimizer.iterations.numpy() == 6, name
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def reference_72():
    """2 epochs on 72 = 3 * k*b arrays in order, which the generator and validation_split tests
    (that train on the same 72 examples) are held against."""
    from tests.conftest import DEVICES
    reference = _sma(DEVICES)
    reference.fit(*_data(72), batch_size=G, epochs=2, shuffle=False, verbose=0)
    return reference


def test_generator_and_repeated_dataset_take_one_batch_per_step(cpu_devices, reference_72):
    # A generator (or a repeated dataset) has no epochs: each iteration takes its next batch, and steps_per_epoch counts
    # iterations. With 72 = 3 * k*b examples per pass, iterations align with passes over the data.
    x, y = _data(72)
    reference = reference_72

    def generator():
        while True:
            for i in range(0, len(x), G):
                yield x[i:i + G], y[i:i + G]

    repeated = tf.data.Dataset.from_tensor_slices((x, y)).batch(G).repeat()
    for name, data in (("generator", generator()), ("repeated dataset", repeated)):
        model = _sma(cpu_devices)
        model.fit(data, epochs=2, steps_per_epoch=3, verbose=0)
        assert model.optimizer.iterations.numpy() == 6, name
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-6, err_msg=name)


def test_validation_split_freq_and_dataset(cpu_devices, reference_72):
    held_out = _data(24, seed=7)
    x, y = (np.concatenate(parts) for parts in zip(_data(72), held_out, strict=True))   # the reference's 72 first
    xv, yv = _data(30, seed=5)
    reference = reference_72
    model = _sma(cpu_devices)
    history = model.fit(x, y, batch_size=G, epochs=2, shuffle=False, verbose=0, validation_split=0.25)
    for a, b in zip(model.get_weights(), reference.get_weights()):      # trained on the first 75% only
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert history.history["val_loss"][-1] == pytest.approx(model.evaluate(x[72:], y[72:], verbose=0)[0], abs=1e-5)

    model = _sma(cpu_devices)
    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(7)
    history = model.fit(x, y, batch_size=G, epochs=4, verbose=0, validation_data=val, validation_freq=2)
    assert len(history.history["loss"]) == 4 and len(history.history["val_loss"]) == 2
    assert history.history["val_accuracy"][-1] == pytest.approx(model.evaluate(xv, yv, verbose=0)[1], abs=1e-6)


def test_progress_bar_is_keras_own(cpu_devices, capsys):
    x, y = _data()
    _sma(cpu_devices).fit(x, y, batch_size=G, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "3/3" in out and "loss:" in out and "accuracy:" in out


def test_train_on_batch_splits_one_global_batch(cpu_devices):
    x, y = _data(24)
    plain = _model()
    plain.train_on_batch(x, y)
    model = use_sma(_model(), four_learners(cpu_devices), algorithm="ssgd")
    model.train_on_batch(x, y)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_set_weights_between_fits_restarts_learners_from_them(cpu_devices):
    x, y = _data()
    model = _sma(cpu_devices)
    model.fit(x, y, batch_size=G, epochs=1, verbose=0)
    fresh = _model(seed=8).get_weights()
    model.set_weights(fresh)
    training = get_training(model)
    assert training.adopt_model_weights()
    for learner in training.learner_weights():
        for a, b in zip(learner, fresh):
            np.testing.assert_array_equal(a, b)
    assert not training.adopt_model_weights()      # now z is the model's weights: nothing to do


# ----------------------------------------------------------------------------------------- errors
def _strategy(cpu_devices):
    return four_learners(cpu_devices)


@pytest.mark.parametrize("optimizer,message", [
    (keras.optimizers.Lamb(0.01), "Lamb cannot be the learners' optimizer: its layer-wise trust ratio"),
    (keras.optimizers.Adam(0.01, use_ema=True), r"Adam\(use_ema=True\) is not supported"),
    (keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), r"SGD\(gradient_accumulation_steps=2\)"),
])
def test_non_sma_optimizer_is_rejected(cpu_devices, optimizer, message):
    with pytest.raises(ValueError, match=message):
        use_sma(_model(optimizer=optimizer), _strategy(cpu_devices))


def test_uncompiled_and_bad_loss_are_rejected(cpu_devices):
    uncompiled = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not compiled"):
        use_sma(uncompiled, _strategy(cpu_devices))
    with pytest.raises(ValueError, match="Keras rejects the compiled loss 'no_such_loss'"):
        use_sma(_model(loss="no_such_loss"), _strategy(cpu_devices))
    with pytest.raises(ValueError, match="reduction='sum'"):
        use_sma(_model(loss=keras.losses.MeanSquaredError(reduction="sum")), _strategy(cpu_devices))
    with pytest.raises(ValueError, match="central_momentum applies to SMA only"):
        use_sma(_model(), _strategy(cpu_devices), algorithm="ssgd", central_momentum=0.5)
    with pytest.raises(ValueError, match="unknown algorithm"):
        use_sma(_model(), _strategy(cpu_devices), algorithm="adam")


def test_bad_batches_are_rejected(cpu_devices):
    x, y = _data()
    model = _sma(cpu_devices)
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="positive integer"):
            model.fit(x, y, batch_size=bad, verbose=0)
    with pytest.raises(ValueError, match="must be batched"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)), verbose=0)
    # A generator's batches that grow after the first cannot be cut into the learners' slices of b.
    growing = (batch for batch in [(x[:8], y[:8]), (x[8:36], y[8:36]), (x[36:], y[36:])])
    with pytest.raises(Exception, match=r"more than B = k\*b = 8"):
        model.fit(growing, verbose=0)
