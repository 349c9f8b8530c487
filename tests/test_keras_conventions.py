"""Keras's fit conventions under use_sma (issue 18): the batch is the global batch per step
(tf.distribute's convention) or, with per_learner_batch, each learner's; the notice line; models
Keras builds inside fit; PyDataset with batch_size; sample and class weights; add_loss-only models;
compile(jit_compile=True); validation in the user's batch size.

References are plain Keras on the same data: S-SGD at a global batch B equals Keras's SGD at B, and
after one SMA step from z every learner equals a plain Keras model stepped on its own slice.
"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf import CrossbowStrategy
from crossbow_tf.keras import get_training, use_sma
from keras_learners import four_learners

K, B = 4, 6           # 4 learners (keras_learners.four_learners) of 6 examples: a global batch G = 24
G = K * B


def _data(n=72, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _compiled(model, loss=None, **compile_options):
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **compile_options)
    return model


def _mlp(seed=1, with_input=True, **compile_options):
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    return _compiled(keras.Sequential(([keras.Input((5,))] if with_input else []) + layers), **compile_options)


def _strategy(cpu_devices):
    return four_learners(cpu_devices)


def _assert_same_weights(a, b, atol=1e-5):
    for ours, theirs in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=atol)


def _notices(out):
    return [line for line in out.splitlines() if " per step, " in line]


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.train, self.test = 0, 0

    def on_train_batch_end(self, batch, logs=None):
        self.train += 1

    def on_test_batch_end(self, batch, logs=None):
        self.test += 1


# ------------------------------------------------------------------------------ the batch convention
def test_batch_size_is_the_global_batch_and_per_learner_batch_keeps_crossbows(cpu_devices, capsys):
    x, y = _data(66)              # 66 examples: 2 full steps of 24 and a partial one of 18
    xv, yv = _data(30, seed=5)
    plain, plain_count = _mlp(), CountBatches()
    plain.fit(x, y, batch_size=G, epochs=1, shuffle=False, verbose=0, validation_data=(xv, yv),
              callbacks=[plain_count])
    capsys.readouterr()

    global_batch, global_count = use_sma(_mlp(), _strategy(cpu_devices), algorithm="ssgd"), CountBatches()
    global_batch.fit(x, y, batch_size=G, epochs=1, shuffle=False, verbose=2, validation_data=(xv, yv),
                     callbacks=[global_count])
    assert _notices(capsys.readouterr().out) == ["crossbow_tf: 4 learners x 6 examples = 24 per step, "
                                                 "3 steps per epoch"]
    _assert_same_weights(global_batch, plain)            # S-SGD at B = Keras's SGD at B
    # Validation runs in the user's batch: on_test_batch_* fires as often as in plain Keras (ceil(30 / 24)).
    assert (global_count.train, global_count.test) == (plain_count.train, plain_count.test) == (3, 2)

    per_learner, per_learner_count = _mlp(), CountBatches()
    use_sma(per_learner, _strategy(cpu_devices), algorithm="ssgd", per_learner_batch=True)
    per_learner.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=2, validation_data=(xv, yv),
                    callbacks=[per_learner_count])
    assert _notices(capsys.readouterr().out) == ["crossbow_tf: 4 learners x 6 examples = 24 per step, "
                                                 "3 steps per epoch"]
    _assert_same_weights(per_learner, plain)
    assert per_learner_count.train == 3
    assert per_learner_count.test == 5                   # validation in the user's batch of 6: ceil(30 / 6)

    # A dataset's batch is the global batch too; with per_learner_batch, k of its batches form a step.
    dataset = _mlp()
    use_sma(dataset, _strategy(cpu_devices), algorithm="ssgd")
    dataset.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(G), epochs=1, verbose=2)
    grouped = _mlp()
    use_sma(grouped, _strategy(cpu_devices), algorithm="ssgd", per_learner_batch=True)
    grouped.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=2)
    assert _notices(capsys.readouterr().out) == ["crossbow_tf: 4 learners x 6 examples = 24 per step, "
                                                 "3 steps per epoch"] * 2
    _assert_same_weights(dataset, plain)
    _assert_same_weights(grouped, plain)


def test_a_batch_the_learners_do_not_divide_is_one_error_naming_both(cpu_devices):
    x, y = _data()
    model = use_sma(_mlp(), _strategy(cpu_devices))
    weights = model.get_weights()
    with pytest.raises(ValueError, match=r"^batch_size=30 is the global batch per step and cannot be split "
                                         r"among the 4 learners: use a multiple of 4 \(such as 28 or 32\)"):
        model.fit(x, y, batch_size=30, verbose=0)
    with pytest.raises(ValueError, match=r"^the dataset's batch of 30 .* among the 4 learners"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(30), verbose=0)
    three = use_sma(_mlp(), CrossbowStrategy(devices=cpu_devices[:3], learners_per_device=1))
    with pytest.raises(ValueError, match=r"^the default batch_size=32 .* among the 3 learners"):
        three.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match="per_learner_batch must be True or False"):
        use_sma(_mlp(), _strategy(cpu_devices), per_learner_batch="yes")
    for a, b in zip(model.get_weights(), weights):       # refused before any step
        np.testing.assert_array_equal(a, b)
    assert model.optimizer.iterations.numpy() == 0


# ------------------------------------------------------------------------ models Keras builds in fit
class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


def test_models_without_input_are_built_on_their_first_batch(cpu_devices):
    x, y = _data()
    plain = _mlp(with_input=False)
    plain.fit(x, y, batch_size=G, epochs=2, shuffle=False, verbose=0)
    model = use_sma(_mlp(with_input=False), _strategy(cpu_devices), algorithm="ssgd")
    assert not model.built
    with pytest.raises(ValueError, match="not built yet"):
        get_training(model).learner_weights()
    model.fit(x, y, batch_size=G, epochs=2, shuffle=False, verbose=0)
    _assert_same_weights(model, plain)
    assert get_training(model).engine.learner_computation.fused      # built as a Functional graph, so it fuses

    keras.utils.set_random_seed(4)
    subclassed = _compiled(Subclassed())
    use_sma(subclassed, _strategy(cpu_devices), algorithm="ssgd")
    keras.utils.set_random_seed(4)
    plain_subclassed = _compiled(Subclassed())
    plain_subclassed.fit(x, y, batch_size=G, epochs=1, shuffle=False, verbose=0)
    subclassed.fit(x, y, batch_size=G, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(subclassed, plain_subclassed)


# ---------------------------------------------------------------------------------------- PyDataset
class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[rows], self.y[rows]


def _fit_warnings(model, data, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=1, shuffle=False, verbose=0, **kwargs)
    return sorted(str(w.message) for w in caught)


def test_pydataset_ignores_batch_size_as_keras_does(cpu_devices):
    x, y = _data()
    plain = _mlp()
    plain_warnings = _fit_warnings(plain, Batches(x, y, G), batch_size=64)
    model = use_sma(_mlp(), _strategy(cpu_devices), algorithm="ssgd")
    ours = _fit_warnings(model, Batches(x, y, G), batch_size=64)
    assert ours == plain_warnings                         # whatever Keras says about it, and nothing more
    assert model.optimizer.iterations.numpy() == 3        # the PyDataset's batches of 24, not 64
    _assert_same_weights(model, plain)


# ------------------------------------------------------------------------------------ sample weights
def test_sample_and_class_weights_weigh_the_loss_as_keras_does(cpu_devices):
    x, y = _data()
    w = np.random.default_rng(3).uniform(0.0, 2.0, len(y)).astype("float32")
    class_weight = {0: 0.5, 1: 2.0, 2: 1.0}
    cases = {
        "sample_weight": (dict(x=x, y=y, sample_weight=w, batch_size=G), dict(x=x, y=y, sample_weight=w, batch_size=G)),
        "class_weight": (dict(x=x, y=y, class_weight=class_weight, batch_size=G),) * 2,
        "dataset (x, y, w)": (dict(x=x, y=y, sample_weight=w, batch_size=G),
                              dict(x=tf.data.Dataset.from_tensor_slices((x, y, w)).batch(G))),
    }
    for name, (plain_args, sma_args) in cases.items():
        plain = _mlp(weighted_metrics=["accuracy"])
        plain_history = plain.fit(epochs=2, shuffle=False, verbose=0, **plain_args)
        model = use_sma(_mlp(weighted_metrics=["accuracy"]), _strategy(cpu_devices), algorithm="ssgd")
        history = model.fit(epochs=2, shuffle=False, verbose=0, **sma_args)
        _assert_same_weights(model, plain)
        for key in ("loss", "accuracy", "weighted_accuracy"):
            np.testing.assert_allclose(history.history[key], plain_history.history[key], atol=1e-5,
                                       err_msg=f"{name}: {key}")
    unweighted = use_sma(_mlp(), _strategy(cpu_devices), algorithm="ssgd")
    unweighted.fit(x, y, batch_size=G, epochs=2, shuffle=False, verbose=0)
    assert not np.allclose(unweighted.get_weights()[0], model.get_weights()[0], atol=1e-3)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight"])
def test_every_learner_takes_keras_weighted_loss_on_its_own_slice(cpu_devices, reduction):
    # After one SMA step from z each learner has taken one SGD step on its slice: the same as a
    # plain Keras model trained on that slice with its weights.
    x, y = _data(G)
    w = np.random.default_rng(4).uniform(0.0, 3.0, G).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    model = use_sma(_mlp(loss=loss), _strategy(cpu_devices))
    model.fit(x, y, sample_weight=w, batch_size=G, epochs=1, shuffle=False, verbose=0)
    for j, learner in enumerate(get_training(model).learner_weights()):
        plain = _mlp(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction))
        rows = slice(j * B, (j + 1) * B)
        plain.train_on_batch(x[rows], y[rows], sample_weight=w[rows])
        for ours, theirs in zip(learner, plain.get_weights()):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, err_msg=f"learner {j}")


# --------------------------------------------------------------------------------- add_loss only
class SelfSupervised(keras.layers.Layer):
    """Adds the reconstruction error of its input as the model's only loss."""

    def call(self, inputs):
        reconstruction, target = inputs
        self.add_loss(keras.ops.mean(keras.ops.square(reconstruction - target)))
        return reconstruction


def _autoencoder(seed=6):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    code = keras.layers.Dense(2, activation="tanh")(inputs)
    outputs = SelfSupervised()([keras.layers.Dense(5)(code), inputs])
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    return model


def test_a_model_whose_only_loss_is_add_loss_trains_as_in_keras(cpu_devices):
    x, _ = _data()
    plain = _autoencoder()
    plain_history = plain.fit(x, batch_size=G, epochs=3, shuffle=False, verbose=0)
    model = use_sma(_autoencoder(), _strategy(cpu_devices), algorithm="ssgd")
    history = model.fit(x, batch_size=G, epochs=3, shuffle=False, verbose=0)
    _assert_same_weights(model, plain)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], atol=1e-5)
    assert history.history["loss"][-1] < history.history["loss"][0]

    nothing = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    nothing.compile(optimizer=keras.optimizers.SGD(0.1))        # no loss, and no add_loss either
    use_sma(nothing, _strategy(cpu_devices))
    with pytest.raises(ValueError, match="No loss to compute"):
        nothing.fit(x, batch_size=G, verbose=0)


# ------------------------------------------------------------------------------------------ XLA
def test_compile_jit_compile_true_says_it_is_not_applied(cpu_devices, capsys):
    use_sma(_mlp(jit_compile=True), _strategy(cpu_devices))
    lines = [line for line in capsys.readouterr().out.splitlines() if "jit_compile" in line]
    assert len(lines) == 1 and "is not applied" in lines[0], lines
    use_sma(_mlp(), _strategy(cpu_devices))               # Keras's "auto" (off on CPU): nothing to say
    assert "jit_compile" not in capsys.readouterr().out


# ------------------------------------------------------------------------------- the strategy line
def test_a_strategy_created_after_tensorflow_started_says_where_it_belongs(cpu_devices):
    # In this process, whose TensorFlow started on the session's 4 devices (conftest.py), as a user's
    # script that ran a tf.data pipeline before its strategy (a process of its own costs 6 CPU s).
    from crossbow_tf.errors import ConfigError
    assert len(tf.config.list_logical_devices("CPU")) == len(cpu_devices) == 4
    with pytest.raises(ConfigError) as error:
        CrossbowStrategy(learners_per_device=2, logical_cpu_devices=2)
    message = str(error.value)
    assert "\n" not in message
    assert "TensorFlow was already initialised with 4 logical CPU device(s); 2 were asked for" in message
    assert "right after the imports" in message
