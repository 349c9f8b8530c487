"""use_sma with every Keras learning-rate schedule: the default reset rule lets each one train, and
learners restart from z exactly where a step schedule drops (never on a smooth decay)."""
import keras
import numpy as np
import pytest

from crossbow_tf import CrossbowStrategy
from crossbow_tf.data import load_embedded_mnist
from crossbow_tf.keras import get_training, use_sma

S = keras.optimizers.schedules
N_TRAIN, BATCH, LEARNERS, EPOCHS = 1024, 16, 2, 2
STEPS = EPOCHS * N_TRAIN // (BATCH * LEARNERS)   # 64 iterations

SCHEDULES = {
    "ExponentialDecay": lambda: S.ExponentialDecay(0.05, decay_steps=10, decay_rate=0.9),
    "ExponentialDecay-staircase": lambda: S.ExponentialDecay(0.05, decay_steps=16, decay_rate=0.5, staircase=True),
    "InverseTimeDecay": lambda: S.InverseTimeDecay(0.05, decay_steps=10, decay_rate=0.5),
    "InverseTimeDecay-staircase": lambda: S.InverseTimeDecay(0.05, decay_steps=24, decay_rate=1.0, staircase=True),
    "PolynomialDecay": lambda: S.PolynomialDecay(0.05, decay_steps=STEPS, end_learning_rate=0.001),
    "CosineDecay": lambda: S.CosineDecay(0.05, decay_steps=STEPS),
    "CosineDecay-warmup": lambda: S.CosineDecay(0.0, decay_steps=STEPS, warmup_target=0.05, warmup_steps=10),
    "CosineDecayRestarts": lambda: S.CosineDecayRestarts(0.05, first_decay_steps=20),
    "PiecewiseConstantDecay": lambda: S.PiecewiseConstantDecay([20, 45], [0.05, 0.02, 0.005]),
}
STEP_SCHEDULES = {"ExponentialDecay-staircase", "InverseTimeDecay-staircase", "PiecewiseConstantDecay"}


@pytest.fixture(scope="module")
def mnist():
    (x, y), (xt, yt) = load_embedded_mnist()
    return (x[:N_TRAIN], y[:N_TRAIN]), (xt[:500], yt[:500])


def _learners(cpu_devices):
    """The learners on one device: resets follow the rate, per iteration, whatever the devices; a
    device per learner would trace each step again (a third of these tests' CPU)."""
    return CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=LEARNERS)


class ResetLog(keras.callbacks.Callback):
    """The iterations (0-based, as optimizer.iterations counts them) at which the learners restarted."""

    def __init__(self):
        super().__init__()
        self.at, self.step, self.seen = [], 0, 0

    def on_train_batch_end(self, batch, logs=None):
        resets = int(get_training(self.model).resets.numpy())
        if resets > self.seen:
            self.at.append(self.step)
            self.seen = resets
        self.step += 1


def _drops(schedule):
    rates = [float(schedule(t)) for t in range(STEPS)]
    return [t for t in range(1, STEPS) if rates[t] < rates[t - 1]]


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_keras_schedule_trains_with_the_default_reset_rule(cpu_devices, mnist, capsys, name):
    (x, y), (xt, yt) = mnist
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    schedule = SCHEDULES[name]()
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    use_sma(model, _learners(cpu_devices))
    log = ResetLog()
    model.fit(x, y, batch_size=BATCH * LEARNERS, epochs=EPOCHS, callbacks=[log], verbose=2)
    rule = [line for line in capsys.readouterr().out.splitlines() if line.startswith("crossbow_tf: learner reset")]
    assert len(rule) == 1, rule
    drops = _drops(schedule)
    assert drops, "every schedule here falls at some iteration"
    if name in STEP_SCHEDULES:
        assert log.at == drops, (log.at, drops)
        assert "restarts from z when" in rule[0]
    else:
        assert log.at == [], f"{name} reset the learners at iterations {log.at}"
        assert "never" in rule[0] and "reset_on_lr_drop=True" in rule[0]
    _, accuracy = model.evaluate(xt, yt, verbose=0)
    assert accuracy > 0.5, f"{name}: test accuracy {accuracy:.3f} (chance is 0.1)"


def test_piecewise_schedule_resets_exactly_at_its_boundaries(cpu_devices, mnist):
    """Keras's PiecewiseConstantDecay gives values[i+1] from iteration boundaries[i] + 1 on."""
    (x, y), _ = mnist
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    schedule = S.PiecewiseConstantDecay([10, 30, 50], [0.05, 0.1, 0.01, 0.001])   # rises at 11, falls at 31, 51
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    use_sma(model, _learners(cpu_devices))
    log = ResetLog()
    model.fit(x, y, batch_size=BATCH * LEARNERS, epochs=EPOCHS, callbacks=[log], verbose=0)
    assert log.at == [31, 51]
    assert int(get_training(model).resets.numpy()) == 2


def test_explicit_true_resets_whenever_the_rate_falls(cpu_devices, mnist, capsys):
    (x, y), _ = mnist
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    schedule = S.ExponentialDecay(0.05, decay_steps=10, decay_rate=0.9)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss=keras.losses.SparseCategoricalCrossentropy(True))
    use_sma(model, _learners(cpu_devices), reset_on_lr_drop=True)
    log = ResetLog()
    model.fit(x[:256], y[:256], batch_size=BATCH * LEARNERS, epochs=1, callbacks=[log], verbose=1)
    assert log.at == list(range(1, 8))
    assert "whenever the learning rate falls (reset_on_lr_drop=True; ExponentialDecay may fall" in capsys.readouterr().out


def test_constant_rate_changed_by_a_callback_still_resets(cpu_devices, mnist):
    (x, y), _ = mnist
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(True))
    use_sma(model, _learners(cpu_devices))
    log = ResetLog()
    drop = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 if epoch == 0 else 0.005)
    model.fit(x[:512], y[:512], batch_size=BATCH * LEARNERS, epochs=2, callbacks=[drop, log], verbose=0)
    assert log.at == [16]
    assert np.isclose(float(model.optimizer.learning_rate), 0.005)
