"""Keras's own callbacks under use_sma: each sees the central model z (and BackupAndRestore resumes
the learners too). The LearningRateScheduler (eta_t and the learner reset at a drop) is checked
against the NumPy transcription in test_keras_equivalence.py."""
import csv
import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.keras import get_training, use_sma
from keras_learners import four_learners

EPOCHS = 3


def _problem(n_train=256, n_val=64, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 3))
    x = rng.normal(size=(n_train + n_val, 8)).astype("float32")
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n_train + n_val, 3)), axis=1).astype("int32")
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def _model(seed=1, lr=0.05):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _sma_model(cpu_devices, seed=1, lr=0.05):
    return use_sma(_model(seed, lr), four_learners(cpu_devices))


class Snapshots(keras.callbacks.Callback):
    """Records the model's weights at every epoch end and whether they were z at that moment."""

    def __init__(self):
        super().__init__()
        self.weights, self.held_z, self.batches = [], [], 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        weights = self.model.get_weights()
        self.weights.append(weights)
        center = get_training(self.model).center_weights()
        self.held_z.append(all(np.array_equal(a, b) for a, b in zip(self.model.trainable_weights, center)))


def _evaluate_plain(weights, x, y):
    """Loss and accuracy of WEIGHTS in a plain Keras model (no crossbow code)."""
    model = _model(seed=7)
    model.set_weights(weights)
    return model.evaluate(x, y, batch_size=64, verbose=0)


@pytest.fixture(scope="module")
def logged_fit(tmp_path_factory):
    """One fit of EPOCHS with validation that the history, CSVLogger and TensorBoard tests read: each
    callback only records the epochs, so one run serves the three (a fit each was a third of the file)."""
    from tests.conftest import DEVICES
    import tensorboard  # noqa: F401   (see test_tensorboard_logs_epoch_scalars)
    (x, y), (xv, yv) = _problem()
    folder = tmp_path_factory.mktemp("logged_fit")
    model = _sma_model(DEVICES)
    snaps = Snapshots()
    csv_path, log_dir = str(folder / "log.csv"), str(folder / "tb")
    history = model.fit(x, y, batch_size=32, epochs=EPOCHS, validation_data=(xv, yv), verbose=0,
                        callbacks=[snaps, keras.callbacks.CSVLogger(csv_path), keras.callbacks.TensorBoard(log_dir)])
    return dict(history=history, snaps=snaps, csv=csv_path, log_dir=log_dir, validation=(xv, yv))


def test_history_and_validation_report_z(logged_fit):
    history, snaps, (xv, yv) = logged_fit["history"], logged_fit["snaps"], logged_fit["validation"]
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(len(v) == EPOCHS for v in history.history.values())
    assert history.epoch == list(range(EPOCHS))
    assert snaps.batches == EPOCHS * 8                   # 256 examples / (k*b = 32) per epoch
    assert len(snaps.held_z) == EPOCHS and all(snaps.held_z)
    for epoch, weights in enumerate(snaps.weights):
        loss, accuracy = _evaluate_plain(weights, xv, yv)
        assert history.history["val_loss"][epoch] == pytest.approx(loss, abs=1e-5)
        assert history.history["val_accuracy"][epoch] == pytest.approx(accuracy, abs=1e-6)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_model_checkpoint_best_only_saves_z(cpu_devices, tmp_path):
    (x, y), (xv, yv) = _problem()
    model = _sma_model(cpu_devices, lr=0.02)
    snaps = Snapshots()
    best_path = str(tmp_path / "best.keras")
    callbacks = [
        keras.callbacks.ModelCheckpoint(best_path, monitor="val_accuracy", mode="max", save_best_only=True),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.weights.h5"), save_weights_only=True),
        snaps,
    ]
    history = model.fit(x, y, batch_size=32, epochs=4, validation_data=(xv, yv), callbacks=callbacks, verbose=0)
    best = int(np.argmax(history.history["val_accuracy"]))     # the first maximum: Keras needs strict improvement
    reloaded = keras.models.load_model(best_path)               # plain Keras
    for a, b in zip(reloaded.get_weights(), snaps.weights[best]):
        np.testing.assert_array_equal(a, b)
    _, accuracy = reloaded.evaluate(xv, yv, verbose=0)
    assert accuracy == pytest.approx(history.history["val_accuracy"][best], abs=1e-6)
    for epoch in range(4):
        plain = _model(seed=9)
        plain.load_weights(str(tmp_path / f"epoch{epoch + 1}.weights.h5"))
        for a, b in zip(plain.get_weights(), snaps.weights[epoch]):
            np.testing.assert_array_equal(a, b)
    assert not glob.glob(str(tmp_path / "*.crossbow.npz"))     # learners travel only with BackupAndRestore


def test_early_stopping_stops_on_z_validation_metric(cpu_devices):
    (x, y), (xv, yv) = _problem()
    model = _sma_model(cpu_devices)
    snaps = Snapshots()
    # From the third epoch on the learning rate is far too high, so z's validation loss worsens.
    blow_up = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 if epoch < 2 else 3.0)
    stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True)
    history = model.fit(x, y, batch_size=32, epochs=10, validation_data=(xv, yv),
                        callbacks=[blow_up, stopper, snaps], verbose=0)
    val = history.history["val_loss"]
    best, best_epoch, wait, expected_stop = np.inf, None, 0, None
    for epoch, value in enumerate(val):          # Keras's rule, replayed on the values z produced
        if value < best:
            best, best_epoch, wait = value, epoch, 0
        else:
            wait += 1
            if wait >= 1:
                expected_stop = epoch
                break
    assert expected_stop is not None and expected_stop < 9
    assert len(val) == expected_stop + 1 and stopper.stopped_epoch == expected_stop
    for epoch, weights in enumerate(snaps.weights):
        assert _evaluate_plain(weights, xv, yv)[0] == pytest.approx(val[epoch], rel=1e-5, abs=1e-5)
    for a, b in zip(model.get_weights(), snaps.weights[best_epoch]):       # restore_best_weights: best z
        np.testing.assert_array_equal(a, b)
    # The next fit starts every learner from the restored weights.
    assert get_training(model).adopt_model_weights()
    for learner in get_training(model).learner_weights():
        for a, b in zip(learner, snaps.weights[best_epoch]):
            np.testing.assert_array_equal(a, b)


def test_csv_logger_rows_match_history(logged_fit):
    history = logged_fit["history"]
    with open(logged_fit["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == list(range(EPOCHS))
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose([float(r[key]) for r in rows], history.history[key], rtol=1e-6)


def _scalars(log_dir, tag):
    values = []
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values.append((event.step, float(tf.make_ndarray(value.tensor))))
    return [v for _, v in sorted(values)]


def test_tensorboard_logs_epoch_scalars(logged_fit):
    # Keras's TensorBoard callback writes through the tensorboard package, which TF 2.21 no longer
    # installs: the test extra installs it, and a missing package fails here rather than skipping.
    import tensorboard  # noqa: F401
    history, log_dir = logged_fit["history"], logged_fit["log_dir"]
    np.testing.assert_allclose(_scalars(os.path.join(log_dir, "train"), "epoch_loss"), history.history["loss"],
                               rtol=1e-6)
    np.testing.assert_allclose(_scalars(os.path.join(log_dir, "validation"), "epoch_accuracy"),
                               history.history["val_accuracy"], rtol=1e-6)


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_learners_and_z(cpu_devices, tmp_path):
    (x, y), _ = _problem()
    backup = str(tmp_path / "backup")
    reference = _sma_model(cpu_devices)
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)

    interrupted = _sma_model(cpu_devices)
    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt(2)])
    assert os.path.exists(os.path.join(backup, "latest.weights.h5.crossbow.npz"))

    # A new process would build a new model: different initial weights, fresh learners.
    resumed = _sma_model(cpu_devices, seed=99)
    snaps = Snapshots()
    history = resumed.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup), snaps])
    assert history.epoch == [2]                       # resumed at the third epoch
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for ours, ref in zip(get_training(resumed).learner_weights(), get_training(reference).learner_weights()):
        for a, b in zip(ours, ref):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert resumed.optimizer.iterations.numpy() == reference.optimizer.iterations.numpy() == 24
    assert not os.path.exists(backup)                 # BackupAndRestore cleans up after a finished fit


def test_terminate_on_nan_stops_at_the_bad_iteration(cpu_devices):
    (x, y), _ = _problem()
    x = x.copy()
    x[70, 0] = np.nan                                 # example 70 is in iteration 2 (examples 64..95)
    model = _sma_model(cpu_devices)
    snaps = Snapshots()
    history = model.fit(x, y, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.TerminateOnNaN(), snaps])
    assert snaps.batches == 3
    assert len(history.epoch) == 1
    assert model.stop_training
