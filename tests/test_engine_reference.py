"""The engine against a plain NumPy transcription of SMA, S-SGD and elastic averaging (issue 2)."""
import math

import keras
import numpy as np
import pytest

from crossbow_tf.algorithms import SMA, ElasticAveragingSGD, SynchronousSGD
from crossbow_tf.data import from_arrays
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.schedule import StepSchedule
from crossbow_tf.engine.trainer import train
from crossbow_tf.results import RunResults
from numpy_reference import run_reference

N, FEATURES, CLASSES, B = 40, 4, 3, 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def small_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def toy_data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=N).astype(np.int32)
    return x, y


# (devices, learners per device): k = 1, 3 and 8 over 1, 2, 3 and 4 devices.
PLACEMENTS = [(1, 1), (1, 3), (3, 1), (1, 8), (2, 4), (4, 2)]
XLA_PLACEMENT = (1, 3)   # the update compiled with XLA here, as by default; without it elsewhere
HYPER = {"plain": dict(mu=0.0, mu_z=0.0, wd=0.0), "momentum_wd": dict(mu=0.9, mu_z=0.9, wd=0.01)}


def make_algorithm(name, h):
    if name == "sma":
        # With mu_z = 0, one learner's default alpha = 1 sits exactly on the central loop's bound.
        return SMA(momentum=h["mu"], central_momentum=h["mu_z"], weight_decay=h["wd"],
                   allow_unstable=h["mu_z"] == 0)
    if name == "ssgd":
        return SynchronousSGD(momentum=h["mu"], weight_decay=h["wd"])
    return ElasticAveragingSGD(momentum=h["mu"], weight_decay=h["wd"])


def assert_engine_matches(engine, z_ref, w_ref, params0, atol):
    """Z_REF and W_REF (every learner's weights) equal the engine's, list for list, and the engine's
    z moved well beyond the tolerance from PARAMS0: a comparison of too little, or of nothing that
    moved, proves nothing."""
    z = engine.center_weights()
    assert len(z) == len(z_ref) == len(params0) > 0
    for got, want in zip(z, z_ref, strict=True):
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    learners = engine.learner_weights()
    assert len(learners) == len(w_ref) == engine.num_learners
    for j, (got_j, want_j) in enumerate(zip(learners, w_ref, strict=True)):
        assert len(got_j) == len(want_j) == len(params0), f"learner {j}"
        for got, want in zip(got_j, want_j, strict=True):
            np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=f"learner {j}")
    assert max(np.abs(a - b).max() for a, b in zip(z, params0, strict=True)) > 1e-2


def run_engine(algorithm, devices, m, iterations_wanted, base_lr, drops, jit_update=True):
    """JIT_UPDATE False skips XLA's compilation of the learners' update (two thirds of a small engine's
    tracing): XLA compiles the update's arithmetic, which the placement does not change, so each rule
    setting is checked under XLA at one placement and without it at the others."""
    x, y = toy_data()
    model = small_mlp()
    params0 = [v.numpy() for v in model.trainable_variables]
    strategy = CrossbowStrategy(devices=devices, learners_per_device=m)
    engine = Engine(model, LOSS, algorithm, strategy, jit_update=jit_update)
    k = strategy.num_learners
    per_epoch = math.ceil(N / (k * B))
    epochs = math.ceil(iterations_wanted / per_epoch)
    data = from_arrays("toy", (x, y), (x, y), num_classes=CLASSES)
    train(engine, data, B, epochs, StepSchedule(base_lr, drops, 0.1), RunResults("t", env={}),
          shuffle=False, log=lambda *a: None, learner_diagnostics=False)
    return engine, params0, x, y, k, epochs * per_epoch


@pytest.mark.parametrize("algorithm", ["sma", "ssgd", "easgd"])
@pytest.mark.parametrize("hyper", sorted(HYPER))
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"D{p[0]}xm{p[1]}")
def test_engine_matches_numpy_reference(algorithm, hyper, placement, cpu_devices):
    num_devices, m = placement
    h = HYPER[hyper]
    drops = [3]   # a learning-rate drop at iteration 3: SMA resets its learners to z there
    engine, params0, x, y, k, iterations = run_engine(
        make_algorithm(algorithm, h), cpu_devices[:num_devices], m, 6, 0.1, drops,
        jit_update=placement == XLA_PLACEMENT)
    assert iterations >= 5
    z_ref, w_ref = run_reference(algorithm, params0, x, y, k, B, iterations, 0.1, drops, 0.1,
                                 mu=h["mu"], mu_z=h["mu_z"], wd=h["wd"])
    assert_engine_matches(engine, z_ref, w_ref, params0, atol=1e-5)


def test_reference_detects_a_wrong_rule(cpu_devices):
    """The comparison has teeth: a rule with the correction's sign flipped does not match."""
    class WrongSMA(SMA):
        def local(self, w, v, g, z, lr, share=None):
            v = self.momentum * v - lr * (g + self.weight_decay * w)
            delta = self.alpha * (w - z)
            return w + v + delta, v, delta

    engine, params0, x, y, k, iterations = run_engine(WrongSMA(), cpu_devices[:2], 2, 6, 0.1, [])
    z_ref, _ = run_reference("sma", params0, x, y, k, B, iterations, 0.1)
    assert max(np.abs(a - b).max() for a, b in zip(engine.center_weights(), z_ref)) > 1e-4


def test_learning_rate_drop_resets_sma_learners_to_center(cpu_devices):
    """A real drop of the rate (0.1, 0.1, then 0): train_step restarts every learner from z before the
    step, and a step at rate 0 from z leaves SMA's learners (without momentum) at z exactly. An engine
    that does not reset on drops keeps its learners apart from z across the same drop."""
    x, y = toy_data()

    def learners_after_drop(reset):
        engine = Engine(small_mlp(), LOSS, SMA(momentum=0.0, central_momentum=0.0),
                        CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2),
                        jit_update=False, reset_on_lr_drop=reset)
        for lr in (0.1, 0.1):
            engine.train_step(x[:2 * B], y[:2 * B], None, lr)
        assert max(np.abs(a - b).max() for a, b in zip(engine.learner_weights()[0], engine.center_weights(),
                                                         strict=True)) > 1e-6
        engine.train_step(x[:2 * B], y[:2 * B], None, 0.0)   # the drop
        return engine.learner_weights(), engine.center_weights()

    learners, z = learners_after_drop(reset=True)
    assert len(learners) == 2
    for learner in learners:
        for a, b in zip(learner, z, strict=True):
            np.testing.assert_array_equal(a, b)
    learners, z = learners_after_drop(reset=False)
    assert max(np.abs(a - b).max() for a, b in zip(learners[0], z, strict=True)) > 1e-6


@pytest.mark.parametrize("algorithm, hyper", [("sma", "momentum_wd"), ("easgd", "plain")])
def test_update_in_one_launch_per_layer_matches_numpy_reference(algorithm, hyper, cpu_devices, monkeypatch):
    """The toy MLP's weights are small enough for one update launch; this splits it per layer."""
    import crossbow_tf.engine.core as core
    monkeypatch.setattr(core, "MIN_GROUP_BYTES", 0)
    h = HYPER[hyper]
    engine, params0, x, y, k, iterations = run_engine(make_algorithm(algorithm, h), cpu_devices[:2], 2, 6, 0.1, [3])
    assert engine._update_groups == [[0, 1], [2, 3]]
    z_ref, w_ref = run_reference(algorithm, params0, x, y, k, B, iterations, 0.1, [3], 0.1,
                                 mu=h["mu"], mu_z=h["mu_z"], wd=h["wd"])
    assert_engine_matches(engine, z_ref, w_ref, params0, atol=1e-5)


def test_update_groups_are_whole_layers_formed_from_the_output_side():
    from crossbow_tf.engine.core import _update_groups
    from crossbow_tf.models import build_model
    lenet = build_model("lenet", (28, 28, 1), 10)   # conv 0.8 k and 51 k, dense 1.05 M and 10 k floats
    # The dense layers (finished first by backpropagation) form one group, the convolutions another,
    # so the dense layers' update overlaps the convolutions' backward pass.
    assert _update_groups(lenet.trainable_variables, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _update_groups(lenet.trainable_variables, 1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    resnet = build_model("resnet32", (32, 32, 3), 10)
    groups = _update_groups(resnet.trainable_variables, 8)
    assert sorted(i for g in groups for i in g) == list(range(len(resnet.trainable_variables)))
    assert 2 <= len(groups) <= 4 and all(g == list(range(g[0], g[-1] + 1)) for g in groups)
