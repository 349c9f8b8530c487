"""use_sma with Functional multi-input/multi-output, subclassed, BatchNorm, Dropout and frozen layers."""
import keras
import numpy as np
import pytest

from crossbow_tf import CrossbowStrategy
from crossbow_tf.keras import get_training, use_sma


def _multi_io(seed=2):
    keras.utils.set_random_seed(seed)
    a = keras.Input((4,), name="a")
    ids = keras.Input((), dtype="int32", name="ids")
    h = keras.layers.Concatenate()([keras.layers.Dense(6, activation="relu")(a), keras.layers.Embedding(10, 3)(ids)])
    outputs = {"cls": keras.layers.Dense(3, name="cls")(h), "reg": keras.layers.Dense(1, name="reg")(h)}
    model = keras.Model({"a": a, "ids": ids}, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
                  loss_weights={"cls": 1.0, "reg": 0.5},
                  metrics={"cls": ["accuracy"], "reg": ["mae"]})
    return model


@pytest.mark.parametrize("n", [72, 60])      # 3 full iterations of k*b = 24; 2 and a partial one of 12
def test_functional_multi_input_multi_output_ssgd_equals_keras(cpu_devices, n):
    rng = np.random.default_rng(0)
    k, b = 4, 6
    x = {"a": rng.normal(size=(n, 4)).astype("float32"), "ids": rng.integers(0, 10, n).astype("int32")}
    y = {"cls": rng.integers(0, 3, n).astype("int32"), "reg": rng.normal(size=(n, 1)).astype("float32")}
    plain = _multi_io()
    plain_history = plain.fit(x, y, batch_size=k * b, epochs=2, shuffle=False, verbose=0)
    model = use_sma(_multi_io(), CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2), algorithm="ssgd")
    history = model.fit(x, y, batch_size=k * b, epochs=2, shuffle=False, verbose=0)
    for ours, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert set(history.history) == set(plain_history.history)      # incl. per-output losses and metrics
    for key, values in plain_history.history.items():
        if n % (k * b) and key in ("cls_loss", "reg_loss"):
            # Keras weighs its per-output loss trackers by the static batch size, which is unknown
            # (weight 1) once its step is retraced for a partial batch; ours weigh by real examples.
            continue
        np.testing.assert_allclose(history.history[key], values, atol=1e-5, err_msg=key)
    preds = model.predict(x, verbose=0)
    np.testing.assert_allclose(preds["cls"], plain.predict(x, verbose=0)["cls"], atol=1e-4)


class Net(keras.Model):
    """A subclassed model with BatchNorm and Dropout."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16)
        self.norm = keras.layers.BatchNormalization()
        self.drop = keras.layers.Dropout(0.5)
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        h = keras.activations.relu(self.norm(self.hidden(x), training=training))
        return self.out(self.drop(h, training=training))


def _net(seed=5):
    keras.utils.set_random_seed(seed)
    model = Net()
    model(np.zeros((1, 8), "float32"))       # a subclassed model creates its weights on its first call
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def test_subclassed_dropout_masks_differ_and_batchnorm_statistics_average(cpu_devices):
    model = use_sma(_net(), CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    training = get_training(model)
    # Every learner sees the same examples from the same weights: only their dropout masks differ.
    x = np.tile(np.linspace(-1, 1, 8, dtype="float32"), (16, 1)) + np.linspace(0, 1, 16, dtype="float32")[:, None]
    x = np.concatenate([x] * 4)
    y = np.tile(np.arange(16) % 3, 4).astype("int32")
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    learners = training.learner_weights()
    kernels = [learner[0] for learner in learners]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.allclose(kernels[i], kernels[j]), f"learners {i} and {j} drew the same dropout mask"
    # z's BatchNorm moving statistics are the mean of the learners' statistics (here each learner
    # sees different examples, so each keeps different statistics).
    x = np.random.default_rng(3).normal(size=(64, 8)).astype("float32")
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    engine = training.engine
    float_states = [i for i, f in enumerate(engine._float_state) if f]
    assert len(float_states) == 2                                   # moving mean and variance
    for i in float_states:
        stacked = np.concatenate([engine.states[d][i].numpy() for d in range(2)])
        np.testing.assert_allclose(model.non_trainable_variables[i].numpy(), stacked.mean(axis=0), rtol=1e-5, atol=1e-6)
        assert not np.allclose(stacked[0], stacked[1])             # learners keep their own statistics


def test_subclassed_model_learns_and_saves_weights(cpu_devices, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(192, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    model = use_sma(_net(), CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    before = model.evaluate(x, y, verbose=0)[0]
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    after = model.evaluate(x, y, verbose=0)[0]
    assert after < before and history.history["loss"][-1] < history.history["loss"][0]
    path = str(tmp_path / "net.weights.h5")
    model.save_weights(path)
    plain = _net(seed=11)
    plain.load_weights(path)
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.parametrize("learners", ["replicated", None])     # None: the engine's default (fused if it can)
def test_frozen_layer_stays_and_full_model_reloads_with_plain_keras(cpu_devices, tmp_path, learners):
    keras.utils.set_random_seed(3)
    frozen = keras.layers.Dense(6, activation="tanh", trainable=False)
    model = keras.Sequential([keras.Input((5,)), frozen, keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, weight_decay=1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    frozen_before = [w.copy() for w in frozen.get_weights()]
    head_before = model.layers[-1].get_weights()[0].copy()
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(64, 5)).astype("float32"), rng.integers(0, 3, 64).astype("int32")
    model = use_sma(model, CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=4), learners=learners)
    assert get_training(model).algorithm.weight_decay == pytest.approx(1e-4)   # SGD(weight_decay) is lambda
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    for a, b in zip(frozen.get_weights(), frozen_before):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(model.layers[-1].get_weights()[0], head_before)
    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    assert type(reloaded) is keras.Sequential
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    assert reloaded.evaluate(x, y, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0), abs=1e-6)
