"""model.fit with use_sma against plain Keras (S-SGD) and against NumPy transcriptions (SMA, EASGD)."""
import math

import keras
import numpy as np
import pytest

from crossbow_tf import CrossbowStrategy
from crossbow_tf.keras import get_training, use_sma


def _data(n, features=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, n).astype("int32")
    return x, y


def _mlp(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])


def _compile(model, optimizer):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.mark.parametrize("devices,per_device", [(2, 2), (1, 3)])
def test_ssgd_fit_equals_keras_sgd_at_batch_kb(cpu_devices, devices, per_device):
    k, b = devices * per_device, 8
    x, y = _data(100)          # 100 = 3 full iterations of k*b (or more) and a partial last one
    plain = _compile(_mlp(), keras.optimizers.SGD(0.1, momentum=0.9))
    plain_history = plain.fit(x, y, batch_size=k * b, epochs=1, shuffle=False, verbose=0)

    model = _compile(_mlp(), keras.optimizers.SGD(0.1, momentum=0.9))
    strategy = CrossbowStrategy(devices=cpu_devices[:devices], learners_per_device=per_device)
    model = use_sma(model, strategy, algorithm="ssgd")
    history = model.fit(x, y, batch_size=k * b, epochs=1, shuffle=False, verbose=0)   # the global batch

    for ours, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    # Loss and accuracy of each step cover all k*b examples of all learners, as Keras's do at batch k*b.
    assert history.history["loss"][0] == pytest.approx(plain_history.history["loss"][0], abs=1e-5)
    assert history.history["accuracy"][0] == pytest.approx(plain_history.history["accuracy"][0], abs=1e-6)
    assert model.optimizer.iterations.numpy() == math.ceil(100 / (k * b))


# ---------------------------------------------------------------------------- NumPy transcription
def _softmax_ce(w, bias, x, y):
    logits = x @ w + bias
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    losses = -np.log(p[np.arange(len(y)), y])
    return losses, p


def _gradient(w, bias, x, y):
    """Gradient of the mean cross-entropy of softmax regression over the slice (0 for an empty one)."""
    if len(y) == 0:
        return np.zeros_like(w), np.zeros_like(bias)
    _, p = _softmax_ce(w, bias, x, y)
    d = p.copy()
    d[np.arange(len(y)), y] -= 1.0
    d /= len(y)
    return x.T @ d, d.sum(axis=0)


def numpy_reference(params, x, y, k, b, epochs, lr_at, algorithm, mu, mu_z, alpha, lam):
    """Issue 2's equations, iteration by iteration; returns (z, learners, per-epoch mean loss, resets)."""
    params = [p.astype(np.float64) for p in params]
    x, y = x.astype(np.float64), y
    w = [[p.copy() for p in params] for _ in range(k)]
    v = [[np.zeros_like(p) for p in params] for _ in range(k)]
    z = [p.copy() for p in params]
    u = [np.zeros_like(p) for p in params]
    n, g = len(y), k * b
    previous, t, resets, epoch_losses = None, 0, 0, []
    for epoch in range(epochs):
        losses = []
        for start in range(0, n, g):
            lr = lr_at(epoch, t)
            if algorithm == "sma" and previous is not None and lr < previous:
                w = [[zi.copy() for zi in z] for _ in range(k)]
                resets += 1
            previous = lr
            idx = np.arange(start, min(start + g, n))
            total = [np.zeros_like(p) for p in params]
            for j in range(k):
                s = idx[j * b:(j + 1) * b]
                losses.extend(_softmax_ce(w[j][0], w[j][1], x[s], y[s])[0])
                grads = _gradient(w[j][0], w[j][1], x[s], y[s])
                for i in range(len(params)):
                    delta = alpha * (w[j][i] - z[i])
                    v[j][i] = mu * v[j][i] - lr * (grads[i] + lam * w[j][i])
                    w[j][i] = w[j][i] + v[j][i] - delta
                    total[i] += delta
            for i in range(len(params)):
                if algorithm == "sma":
                    u[i] = mu_z * u[i] + total[i]
                    z[i] = z[i] + u[i]
                else:
                    z[i] = z[i] + total[i]
            t += 1
        epoch_losses.append(float(np.mean(losses)))
    return z, w, epoch_losses, resets


def _softmax_regression(seed=3):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    # Non-zero bias so that the reference checks the bias path too.
    model.layers[0].bias.assign(np.array([0.1, -0.2, 0.05], "float32"))
    return model


CASES = {
    # SMA with Keras's LearningRateScheduler dropping eta at epoch 2: learners reset to z there.
    "sma-scheduler-callback": dict(algorithm="sma", devices=2, per_device=2, b=4, lr="callback", lam=1e-3),
    # SMA with a LearningRateSchedule inside the optimizer, dropping mid-epoch (iteration 5).
    "sma-schedule-object": dict(algorithm="sma", devices=1, per_device=3, b=5, lr="schedule", lam=0.0),
    "easgd-constant": dict(algorithm="easgd", devices=2, per_device=2, b=4, lr="constant", lam=1e-3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fit_matches_numpy_transcription(cpu_devices, case):
    c = CASES[case]
    k, b, epochs, mu, mu_z = c["devices"] * c["per_device"], c["b"], 3, 0.9, 0.9
    x, y = _data(42, seed=4)         # 42 examples: the last iteration has a partial and an empty learner slice
    callbacks = []
    if c["lr"] == "callback":
        learning_rate = 0.05
        lr_at = lambda epoch, t: 0.05 if epoch < 2 else 0.005  # noqa: E731
        callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 if epoch < 2 else 0.005)]
    elif c["lr"] == "schedule":
        learning_rate = keras.optimizers.schedules.PiecewiseConstantDecay([4], [0.05, 0.01])
        lr_at = lambda epoch, t: 0.05 if t <= 4 else 0.01  # noqa: E731
    else:
        learning_rate = 0.05
        lr_at = lambda epoch, t: 0.05  # noqa: E731

    model = _softmax_regression()
    initial = [p.copy() for p in model.get_weights()]
    model.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=mu, weight_decay=c["lam"] or None),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    strategy = CrossbowStrategy(devices=cpu_devices[:c["devices"]], learners_per_device=c["per_device"])
    options = dict(central_momentum=mu_z) if c["algorithm"] == "sma" else {}
    model = use_sma(model, strategy, algorithm=c["algorithm"], **options)
    history = model.fit(x, y, batch_size=k * b, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)

    alpha = 1.0 / k if c["algorithm"] == "sma" else 0.9 / k
    z, learners, losses, resets = numpy_reference(initial, x, y, k, b, epochs, lr_at, c["algorithm"],
                                                  mu, mu_z, alpha, c["lam"])
    training = get_training(model)
    ours_z = model.get_weights()                          # the model object holds z
    assert len(ours_z) == len(z) == len(initial) > 0
    for ours, ref in zip(ours_z, z, strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-5)
    # z moved well beyond the tolerance, or the comparison proves nothing.
    assert max(np.abs(a - b).max() for a, b in zip(ours_z, initial, strict=True)) > 1e-3
    ours_learners = training.learner_weights()
    assert len(ours_learners) == len(learners) == k
    for ours, ref in zip(ours_learners, learners, strict=True):
        assert len(ours) == len(ref) == len(initial)
        for a, r in zip(ours, ref, strict=True):
            np.testing.assert_allclose(a, r, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], losses, atol=1e-5)
    assert int(training.resets.numpy()) == resets
    assert resets == (1 if c["algorithm"] == "sma" and c["lr"] != "constant" else 0)
    if c["lr"] == "callback":     # what LearningRateScheduler set, as History recorded it
        np.testing.assert_allclose(history.history["learning_rate"], [0.05, 0.05, 0.005], rtol=1e-6)
