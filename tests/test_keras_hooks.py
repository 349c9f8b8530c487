"""A model's own training logic under use_sma (issue 44, crossbow_tf/training_hooks.py): an overridden
compute_loss is every learner's objective, against plain Keras with the same override; test_step and
predict_step stay the model's own in evaluate and predict; the overrides use_sma cannot honour are
refused in one line before training, naming the class, the method and what to do instead.

References are plain Keras on the same data: S-SGD at a global batch G equals Keras's SGD at G (for a
loss that is a mean over the batch), and after one SMA step from z each learner equals a plain Keras
model stepped on its own slice.
"""
import os

import keras
import numpy as np
import pytest
from keras import ops

from crossbow_tf import training_hooks as hooks
from crossbow_tf.keras import get_training, use_sma
from keras_learners import four_learners

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K, B = 4, 6
G = K * B
PENALTY = 100.0


def _plain_and_ssgd(make, cpu_devices, x, y=None, epochs=2, **fit_args):
    """MAKE()'s model fitted by plain Keras and a second one by use_sma's synchronous SGD at the global batch G,
    the reference for a loss that is a mean over the batch: (plain model, its history, ours, its history)."""
    plain = make()
    plain_history = plain.fit(x, y, batch_size=G, epochs=epochs, shuffle=False, verbose=0, **fit_args)
    model = use_sma(make(), four_learners(cpu_devices), algorithm="ssgd")
    history = model.fit(x, y, batch_size=G, epochs=epochs, shuffle=False, verbose=0, **fit_args)
    return plain, plain_history, model, history


def _assert_same_weights(ours, theirs, err_msg=""):
    for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=err_msg)


def _data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n).astype("int32")


class Penalised(keras.Model):
    """Keras's loss plus a known constant and a term in the predictions (so that the override changes
    the gradients too)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + PENALTY + 0.5 * ops.mean(ops.square(y_pred))


def _functional(cls, seed=1, loss="default"):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = cls(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True) if loss == "default" else loss)
    return model


def test_an_overridden_compute_loss_gives_plain_keras_first_step_loss(cpu_devices):
    x, y = _data(G)
    plain = _functional(Penalised).train_on_batch(x, y)
    model = use_sma(_functional(Penalised), four_learners(cpu_devices))
    ours = model.train_on_batch(x, y)
    assert plain > PENALTY
    np.testing.assert_allclose(ours, plain, rtol=1e-6)


def test_each_learner_steps_on_the_override_with_its_own_slice(cpu_devices):
    x, y = _data(G)
    model = use_sma(_functional(Penalised), four_learners(cpu_devices))
    model.fit(x, y, batch_size=G, epochs=1, shuffle=False, verbose=0)
    for j, learner in enumerate(get_training(model).learner_weights()):
        plain = _functional(Penalised)
        plain.train_on_batch(x[j * B:(j + 1) * B], y[j * B:(j + 1) * B])
        for ours, theirs in zip(learner, plain.get_weights()):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, err_msg=f"learner {j}")
    # The compiled loss alone steps elsewhere: the override really is the objective.
    compiled_only = _functional(keras.Model)
    compiled_only.train_on_batch(x[:B], y[:B])
    assert not np.allclose(compiled_only.get_weights()[-1], get_training(model).learner_weights()[0][-1], atol=1e-4)


def test_synchronous_sgd_with_the_override_equals_keras_at_the_global_batch(cpu_devices):
    x, y = _data()
    plain, plain_history, model, history = _plain_and_ssgd(lambda: _functional(Penalised), cpu_devices, x, y)
    _assert_same_weights(model, plain)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-6)


class Distiller(keras.Model):
    """keras-io's knowledge distillation in small: a frozen teacher, compiled without a loss, the
    objective in compute_loss from x, y and the teacher's soft targets."""

    def __init__(self, student, teacher, **kwargs):
        super().__init__(**kwargs)
        self.student, self.teacher = student, teacher
        self.teacher.trainable = False

    def call(self, x, training=False):
        return self.student(x, training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        teacher = self.teacher(x, training=False)
        student_loss = keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
        distillation = keras.losses.kl_divergence(ops.softmax(teacher / 2.0), ops.softmax(y_pred / 2.0)) * 4.0
        weights = 1.0 if sample_weight is None else sample_weight
        return ops.sum((0.1 * student_loss + 0.9 * distillation) * weights) / ops.cast(ops.shape(y)[0], "float32")


def _distiller(seed=2):
    keras.utils.set_random_seed(seed)
    teacher = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    student = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    model = Distiller(student, teacher)
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["sparse_categorical_accuracy"])
    return model


def test_a_distiller_compiled_without_a_loss_trains_on_its_own_objective(cpu_devices):
    # Before issue 44: refused with "No loss to compute ... Provide a `loss` argument in `compile()`".
    x, y = _data()
    plain, plain_history, model, history = _plain_and_ssgd(_distiller, cpu_devices, x, y)
    _assert_same_weights(model.student, plain.student)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["sparse_categorical_accuracy"],
                               plain_history.history["sparse_categorical_accuracy"])


class Reconstructing(keras.Model):
    """An autoencoder whose compute_loss reads x, fitted without targets."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        assert y is None
        return ops.mean(ops.square(y_pred - x)) + ops.sum(self.losses)


def test_an_override_that_reads_x_trains_without_targets(cpu_devices):
    x, _ = _data()

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        code = keras.layers.Dense(2, activation="tanh", activity_regularizer=keras.regularizers.L2(0.01))(inputs)
        model = Reconstructing(inputs, keras.layers.Dense(5)(code))
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
        return model
    plain, plain_history, model, history = _plain_and_ssgd(build, cpu_devices, x)
    _assert_same_weights(model, plain)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)


def test_the_run_paths_evaluations_report_the_models_own_loss_as_keras_evaluate_does():
    # crossbow_tf.run's evaluation of z: a compute_loss of the model's own is the test loss, as in Keras.
    import tensorflow as tf

    from crossbow_tf.data.source import Split
    from crossbow_tf.engine.trainer import Evaluator
    x, y = _data(50)
    model = _functional(Penalised)
    split = Split(tf.data.Dataset.from_tensor_slices((x, y)), len(y))
    accuracy, loss = Evaluator(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True))(split, 20)
    keras_says = model.evaluate(x, y, batch_size=50, verbose=0, return_dict=True)
    assert loss > PENALTY
    np.testing.assert_allclose(loss, keras_says["loss"], rtol=1e-5)
    np.testing.assert_allclose(accuracy, np.mean(np.argmax(model.predict(x, verbose=0), -1) == y))
    # tf_ssgd's evaluation across workers (outside Keras's evaluate) says the same.
    from baselines.tf_ssgd import evaluate_outside_fit
    np.testing.assert_allclose(evaluate_outside_fit(model, split.dataset.batch(20)), (accuracy, loss), rtol=1e-5)


class OwnEvaluation(keras.Model):
    """Its own test_step and predict_step, each marking what it returns."""

    def test_step(self, data):
        x, y = data
        return {"own_test": ops.mean(self(x, training=False)) * 0.0 + 7.0}

    def predict_step(self, data):
        return self(data, training=False) * 0.0 - 3.0


def test_evaluate_and_predict_use_the_models_own_steps_on_z(cpu_devices):
    x, y = _data()
    model = use_sma(_functional(OwnEvaluation), four_learners(cpu_devices))
    history = model.fit(x, y, batch_size=G, epochs=1, validation_data=(x, y), shuffle=False, verbose=0)
    assert history.history["val_own_test"] == [7.0]
    assert model.evaluate(x, y, batch_size=G, verbose=0, return_dict=True) == {"own_test": 7.0}
    assert np.all(model.predict(x, batch_size=G, verbose=0) == -3.0)


class OwnTrainStep(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


class OwnFit(keras.Model):
    def fit(self, *args, **kwargs):
        return super().fit(*args, **kwargs)


class OwnTrainOnBatch(keras.Model):
    def train_on_batch(self, *args, **kwargs):
        return super().train_on_batch(*args, **kwargs)


class OwnTrainFunction(keras.Model):
    def make_train_function(self, force=False):
        return super().make_train_function(force)


@pytest.mark.parametrize("cls, method", [(OwnFit, "fit"),
                                         (OwnTrainOnBatch, "train_on_batch"),
                                         (OwnTrainFunction, "make_train_function")])
def test_an_override_use_sma_cannot_honour_is_refused_in_one_line_before_training(cpu_devices, cls, method):
    model = _functional(cls)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError) as refused:
        use_sma(model, four_learners(cpu_devices))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{cls.__name__} overrides {method}, which use_sma cannot honour (")
    assert message.endswith(hooks.BY_NAME[method].instead)
    assert not hasattr(model, "_crossbow_training")             # the model is left as it was: plain Keras
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_keras_own_classes_override_nothing():
    for cls in (keras.Model, keras.Sequential, type(_functional(keras.Model))):
        assert hooks.overridden(cls) == []
    assert [hook.name for hook in hooks.overridden(Penalised)] == ["compute_loss"]
    assert [hook.name for hook in hooks.overridden(OwnEvaluation)] == ["test_step", "predict_step"]


def test_docs_keras_holds_the_hooks_table():
    with open(os.path.join(REPO, "docs", "keras.md"), encoding="utf-8") as f:
        assert hooks.markdown_table() in f.read()


# ------------------------------------------------------------------------------- train_step of its own
class CustomFit(keras.Model):
    """keras-io's "Customizing what happens in fit()" (its first train_step, in Keras 3's form)."""

    def train_step(self, data):
        import tensorflow as tf
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _custom_fit(seed=1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    model = CustomFit(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def test_a_models_own_train_step_runs_per_learner_and_equals_keras_under_synchronous_sgd(cpu_devices):
    x, y = _data()
    plain, plain_history, model, history = _plain_and_ssgd(_custom_fit, cpu_devices, x, y)
    _assert_same_weights(model, plain)
    assert set(history.history) == {"loss", "accuracy"}
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[key], plain_history.history[key], rtol=1e-5, err_msg=key)


def test_each_learner_steps_with_what_its_own_train_step_applies(cpu_devices):
    x, y = _data(G)
    model = use_sma(_custom_fit(), four_learners(cpu_devices))
    model.fit(x, y, batch_size=G, epochs=1, shuffle=False, verbose=0)
    for j, learner in enumerate(get_training(model).learner_weights()):
        plain = _custom_fit()   # its train_step takes (x, y): fit, as train_on_batch adds a sample weight
        plain.fit(x[j * B:(j + 1) * B], y[j * B:(j + 1) * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
        for ours, theirs in zip(learner, plain.get_weights()):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, err_msg=f"learner {j}")


def test_a_last_partial_batch_steps_each_learner_on_its_real_rows_alone(cpu_devices):
    # B + 2 examples for K*B places: learner 0 has B real rows, learner 1 has 2, learners 2 and 3 have only
    # the padding (repeated real examples), which must neither train nor count in the trackers.
    x, y = _data(B + 2)
    initial = _custom_fit().get_weights()
    model = use_sma(_custom_fit(), four_learners(cpu_devices))
    history = model.fit(x, y, batch_size=G, epochs=1, shuffle=False, verbose=0)
    plain_losses = []
    learners = get_training(model).learner_weights()
    assert len(learners) == K
    for j, learner in enumerate(learners):
        rows = slice(j * B, min((j + 1) * B, len(x)))
        if j < 2:
            plain = _custom_fit()
            plain_losses.append(plain.fit(x[rows], y[rows], batch_size=B, epochs=1, shuffle=False,
                                          verbose=0).history["loss"][0])
            expected = plain.get_weights()
            assert not np.allclose(expected[-1], initial[-1], atol=1e-4)   # a real step: the two cases differ
        else:
            expected = initial
        for ours, theirs in zip(learner, expected, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, err_msg=f"learner {j}")
    np.testing.assert_allclose(history.history["loss"][0], np.mean(plain_losses), rtol=1e-5)


class VAE(keras.Model):
    """keras-io's variational autoencoder in small: encoder and decoder models, its own train_step with a
    KL term, its own trackers, compiled without a loss, no call of its own."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        import tensorflow as tf
        with tf.GradientTape() as tape:
            z_mean, z_log_var = self.encoder(data)
            z = z_mean + tf.exp(0.5 * z_log_var) * 0.5    # a fixed draw: the runs stay comparable
            reconstruction = self.decoder(z)
            reconstruction_loss = tf.reduce_mean(tf.reduce_sum(tf.square(data - reconstruction), axis=1))
            kl_loss = -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))
            kl_loss = tf.reduce_mean(tf.reduce_sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def _vae(seed=4):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    encoder = keras.Model(inputs, [keras.layers.Dense(2)(hidden), keras.layers.Dense(2)(hidden)])
    code = keras.Input((2,))
    decoder = keras.Model(code, keras.layers.Dense(5)(keras.layers.Dense(8, activation="relu")(code)))
    model = VAE(encoder, decoder)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    return model


def test_a_vae_with_its_own_train_step_and_trackers_reports_what_keras_reports(cpu_devices):
    # Before issue 44: refused with "No loss to compute ... Provide a `loss` argument in `compile()`".
    x, _ = _data()
    plain, plain_history, model, history = _plain_and_ssgd(_vae, cpu_devices, x, epochs=3)
    assert set(history.history) == {"loss", "reconstruction_loss", "kl_loss"}
    for key in history.history:
        np.testing.assert_allclose(history.history[key], plain_history.history[key], rtol=1e-5, err_msg=key)
    _assert_same_weights(model, plain)
    # Under SMA the learners differ, and the trackers still follow the objective down.
    sma = use_sma(_vae(), four_learners(cpu_devices))
    sma_history = sma.fit(x, batch_size=G, epochs=3, shuffle=False, verbose=0)
    assert sma_history.history["loss"][-1] < sma_history.history["loss"][0]
    assert sma_history.history["kl_loss"][0] > 0


class TwoOptimizers(keras.Model):
    """A GAN's shape: its train_step steps a second optimizer of its own."""

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.other_optimizer = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        import tensorflow as tf
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.other_optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_a_train_step_that_drives_another_optimizer_is_refused_in_one_line(cpu_devices):
    x, y = _data(G)
    model = _functional(TwoOptimizers)
    use_sma(model, four_learners(cpu_devices))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError) as refused:
        model.fit(x, y, batch_size=G, epochs=1, verbose=0)
    message = str(refused.value)
    assert message.startswith("TwoOptimizers's train_step applies gradients with an optimizer other than "
                              "model.optimizer (SGD "), message
    assert "train a model with several optimizers (a GAN's) without use_sma" in message and "\n" not in message
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_an_own_train_step_under_loss_scaling_is_refused_before_training(cpu_devices):
    model = _custom_fit()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"^CustomFit overrides train_step, and its LossScaleOptimizer "
                                         r"\(mixed_float16\) scales a loss use_sma cannot see"):
        use_sma(model, four_learners(cpu_devices))


# ------------------------------------------- losses and weights the model owns, with an override
def test_the_override_with_class_weight_and_sample_weight_equals_keras(cpu_devices):
    x, y = _data()
    weights = np.random.default_rng(5).uniform(0.5, 2.0, len(y)).astype("float32")
    runs = {}
    for name, fit_args in (("class_weight", dict(class_weight={0: 1.0, 1: 3.0, 2: 0.5})),
                           ("sample_weight", dict(sample_weight=weights))):
        plain, plain_history, model, history = _plain_and_ssgd(lambda: _functional(Penalised), cpu_devices, x, y,
                                                               **fit_args)
        _assert_same_weights(model, plain, err_msg=name)
        np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5, err_msg=name)
        runs[name] = model.get_weights()[0]
    assert not np.allclose(runs["class_weight"], runs["sample_weight"], atol=1e-4)   # the weights mattered


def _two_outputs(cls, seed=7):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = cls(inputs, {"label": keras.layers.Dense(3, name="label")(hidden),
                         "value": keras.layers.Dense(1, name="value")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss={"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "value": "mse"},
                  loss_weights={"label": 1.0, "value": 0.25})
    return model


class PenalisedOutputs(keras.Model):
    """Keras's loss over two weighted outputs, plus a term in one of them."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.5 * ops.mean(ops.square(y_pred["value"]))


def test_the_override_over_several_weighted_outputs_equals_keras(cpu_devices):
    x, y = _data()
    targets = {"label": y, "value": x[:, :1] * 2.0}
    plain, plain_history, model, history = _plain_and_ssgd(lambda: _two_outputs(PenalisedOutputs), cpu_devices,
                                                           x, targets)
    _assert_same_weights(model, plain)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
