"""Dynamic loss scaling for mixed_float16, as Keras's LossScaleOptimizer: one shared scale, an
iteration whose gradients overflow skipped by every learner and z alike with the scale halved, the
scale doubled after dynamic_growth_steps good iterations, its state in checkpoints; use_sma with
Keras's LossScaleOptimizer (and its fit's accuracy: tests/test_mixed_precision.py) and the command
line under mixed_float16."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from crossbow_tf.algorithms import SMA
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
# Keras's global policy is process-wide: the autouse fixture leaves it float32 after each test.
from test_mixed_precision import float32_after_each_test, global_policy  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SHAPE, CLASSES = (8, 8, 2), 4


def small_cnn():
    inputs = keras.Input(SHAPE)
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(0.3)(x)
    x = keras.layers.Dense(CLASSES)(x)
    return keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(x))


def make_engine(devices, rule=SMA(), learners="fused", **options):
    with global_policy("mixed_float16"):
        keras.utils.set_random_seed(0)
        model = small_cnn()
    return Engine(model, LOSS, rule, CrossbowStrategy(devices=devices, learners_per_device=2), learners=learners,
                  loss_scale=True, **options)


def everything(engine):
    """Every variable an iteration may change: learners' weights, velocities and state, optimizer
    state, z, u and z's state."""
    groups = engine.weights + engine.velocities + engine.states + engine.optimizer_states
    groups += engine.center + engine.center_velocity + engine.center_states
    groups += engine.learner_square + engine.global_square   # noise matching's running means (when on)
    return [v.numpy().copy() for group in groups for v in group]


def batch(engine, seed):
    rng = np.random.default_rng(seed)
    kb = engine.num_learners * 8
    return rng.random((kb,) + SHAPE, dtype=np.float32), rng.integers(0, CLASSES, kb).astype(np.int32)


@pytest.mark.parametrize("learners, rule, optimizer", [
    ("fused", SMA(), None), ("replicated", SMA(sync_period=2), None), ("fused", SMA(momentum=0.0), "adam")])
def test_an_overflow_skips_the_iteration_everywhere_and_halves_the_scale(cpu_devices, learners, rule, optimizer):
    """A scale of 2**40 makes the float16 backward pass overflow (the loss itself stays finite):
    nothing changes, in the synchronising and the local step alike, and the scale halves; at a
    scale the gradients fit, the step trains and counts a good step."""
    # Adam's learners with noise matching, as use_sma runs them: a skipped iteration leaves its statistics too.
    options = {} if optimizer is None else dict(optimizer=keras.optimizers.Adam(1e-3), noise_matching=True)
    # One device of 2 learners: every learner overflows here; one learner's overflow reaching the
    # other device's learners is the next test's.
    engine = make_engine(cpu_devices[:1], rule, learners, initial_scale=2.0 ** 40, **options)
    for iteration in range(2):   # with sync_period=2: a local step, then a synchronising one
        before = everything(engine)
        loss, _ = engine.train_step(*batch(engine, iteration), None, 0.05, iteration=iteration)
        assert np.isfinite(float(loss))
        assert all(np.array_equal(a, b) for a, b in zip(before, everything(engine)))
        assert engine.loss_scale.numpy() == 2.0 ** (39 - iteration) and engine.good_steps.numpy() == 0
        assert engine.non_finite() == []
    engine.loss_scale.assign(2.0 ** 8)
    for iteration in range(2, 4):
        before = everything(engine)
        engine.train_step(*batch(engine, iteration), None, 0.05, iteration=iteration)
        changed = [not np.array_equal(a, b) for a, b in zip(before, everything(engine))]
        assert sum(changed) > len(changed) // 3
        assert engine.loss_scale.numpy() == 2.0 ** 8 and engine.good_steps.numpy() == iteration - 1
    assert all(v.dtype == "float32" for group in engine.weights + engine.center for v in group)


@pytest.mark.parametrize("learners, rule", [("fused", SMA()), ("replicated", SMA(sync_period=2))])
def test_one_learner_overflowing_skips_the_iteration_for_every_learner(cpu_devices, learners, rule):
    """Only the last learner (on the second device) sees an input that is infinite in float16, so
    only its gradients overflow: still no learner, z or statistic changes, and the scale halves.
    The same batch without that learner's rows trains, so the skip is the flag's doing."""
    engine = make_engine(cpu_devices[:2], rule, learners, initial_scale=2.0 ** 8)
    b = 8
    for iteration in range(2):   # with sync_period=2: a local step, then a synchronising one
        x, y = batch(engine, iteration)
        overflowing = x.copy()
        overflowing[-b:] = 1e30   # the last learner's slice of b rows
        before = everything(engine)
        engine.train_step(overflowing, y, None, 0.05, iteration=iteration)
        assert all(np.array_equal(a, c) for a, c in zip(before, everything(engine), strict=True))
        assert engine.loss_scale.numpy() == 2.0 ** (7 - iteration) and engine.good_steps.numpy() == 0
        engine.train_step(x, y, None, 0.05, iteration=iteration)
        changed = [not np.array_equal(a, c) for a, c in zip(before, everything(engine), strict=True)]
        assert sum(changed) > len(changed) // 3
        assert engine.good_steps.numpy() == 1


def test_the_scale_doubles_after_the_growth_steps_and_underflow_is_a_divergence(cpu_devices):
    engine = make_engine(cpu_devices[:1], initial_scale=4.0, dynamic_growth_steps=3)
    scales = []
    for iteration in range(7):
        engine.train_step(*batch(engine, iteration), None, 0.05)
        scales.append((float(engine.loss_scale.numpy()), int(engine.good_steps.numpy())))
    assert scales == [(4, 1), (4, 2), (8, 0), (8, 1), (8, 2), (16, 0), (16, 1)]
    # A scale below float32's smallest normal number: the step's loss is NaN and names it.
    engine.loss_scale.assign(float(np.finfo(np.float32).tiny))
    engine.train_step(*batch(engine, 9), None, 0.05, iteration=8)   # a good step keeps it
    x, y = batch(engine, 10)
    x[:] = 1e30   # inf in float16: every gradient overflows, the scale halves below tiny
    loss, _ = engine.train_step(x, y, None, 0.05)
    assert np.isnan(float(loss))
    assert any(name.startswith("the loss scale (underflowed") for name in engine.non_finite())


def test_loss_scaling_is_refused_with_bad_options(cpu_devices):
    with pytest.raises(ValueError, match="dynamic_growth_steps must be an integer >= 1"):
        make_engine(cpu_devices[:1], dynamic_growth_steps=0)
    with pytest.raises(ValueError, match="initial_scale must be a finite positive number"):
        make_engine(cpu_devices[:1], initial_scale=float("inf"))


def test_sigkill_then_resume_with_a_loss_scale_in_the_checkpoint_is_bit_identical(tmp_path):
    """The command line under mixed_float16 (crossbow_tf.run with a BatchNorm + Dropout model): it
    records the precision, learns, and its checkpoints hold the loss scale and its good-step count,
    which a resumed run continues (restarted, the count would end lower)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_checkpoint import DRIVER, HEADER, Process, assert_bit_identical, final_state, tiny_config
    from crossbow_tf.engine.checkpoint import checkpoint_paths
    config = tiny_config(tmp_path, checkpoint={"every_iterations": 3}, precision="mixed_float16", epochs=1)
    reference = Process([DRIVER, "--config", config, "--checkpoint-dir", str(tmp_path / "reference"),
                         "--results", str(tmp_path / "reference.json")])
    assert reference.wait_for(HEADER)
    assert reference.finish() == 0, reference.output
    args = [DRIVER, "--config", config, "--checkpoint-dir", str(tmp_path / "killed"), "--resume",
            "--results", str(tmp_path / "killed.json"), "--force"]
    killed = [Process(args)]
    assert killed[0].wait_for(HEADER)
    deadline = time.time() + 300
    while len(checkpoint_paths(str(tmp_path / "killed"))) < 2:   # killed after its first checkpoint past iteration 0
        assert killed[0].proc.poll() is None and time.time() < deadline, killed[0].output
        time.sleep(0.01)
    killed[0].proc.send_signal(signal.SIGKILL)
    killed[0].finish()
    killed.append(Process(args))
    killed[1].finish()
    codes = [p.proc.returncode for p in killed]
    assert codes[-1] == 0 and -signal.SIGKILL in codes, (codes, killed[-1].output)
    resumed = [int(m) for p in killed for m in re.findall(r"resuming from \S+: iteration (\d+)", p.output)]
    assert any(i > 0 for i in resumed), killed[1].output
    state = final_state(tmp_path / "reference")
    scale = [v for k, v in state.items() if k.startswith("loss_scale/")]
    assert sorted(v.dtype.name for v in scale) == ["float32", "int64"]
    assert sorted(float(v) for v in scale) == [20.0, 2.0 ** 15]   # no overflow in this run's 20 iterations
    d = json.loads((tmp_path / "reference.json").read_text())
    assert d["config"]["precision"] == "mixed_float16" and ", precision mixed_float16" in reference.output
    assert d["evaluations"][-1]["accuracy"] > 0.8
    assert_bit_identical(tmp_path / "killed", tmp_path / "reference")


def test_use_sma_takes_the_scales_rules_from_a_loss_scale_optimizer_around_adam(cpu_devices):
    import crossbow_tf
    with global_policy("mixed_float16"):
        model = small_cnn()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0 ** 10,
                                                                dynamic_growth_steps=5), loss=LOSS)
    crossbow_tf.use_sma(model, CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2))
    engine = getattr(model, crossbow_tf.keras.sma._ATTRIBUTE).engine
    assert engine.loss_scale.numpy() == 2.0 ** 10 and engine.dynamic_growth_steps == 5
    assert isinstance(engine.optimizers.template, keras.optimizers.Adam)   # the learners take Adam's steps
    assert engine.algorithm.momentum == 0.0


def test_the_loss_scale_comes_back_from_keras_weight_files(cpu_devices, tmp_path):
    """use_sma keeps the engine's scale in the compiled LossScaleOptimizer's variables, so that
    save_weights holds it and a fresh model's load_weights brings it back at fit's start."""
    import crossbow_tf
    from crossbow_tf.keras import get_training

    def compiled():
        with global_policy("mixed_float16"):
            keras.utils.set_random_seed(0)
            model = small_cnn()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                                    initial_scale=2.0 ** 40), loss=LOSS)
        # One device: the scale is one variable shared by every learner, whatever the devices.
        return crossbow_tf.use_sma(model, CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2))
    rng = np.random.default_rng(0)
    # 2 steps: the first already overflows at 2**40, so the scale to restore differs from a fresh one's.
    x, y = rng.random((32,) + SHAPE, dtype=np.float32), rng.integers(0, CLASSES, 32).astype(np.int32)
    model = compiled()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    engine = get_training(model).engine
    trained = (float(engine.loss_scale.numpy()), int(engine.good_steps.numpy()))
    assert trained[0] < 2.0 ** 40   # the scale fell from its initial value: there is something to restore
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    again = compiled()
    again.load_weights(path)
    training = get_training(again)
    assert float(training.engine.loss_scale.numpy()) == 2.0 ** 40
    training.adopt_model_weights()   # what fit runs at its start
    assert (float(training.engine.loss_scale.numpy()), int(training.engine.good_steps.numpy())) == trained
