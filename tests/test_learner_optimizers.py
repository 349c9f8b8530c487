"""Any elementwise Keras optimizer for the learners (issue 18): each learner takes the optimizer's
own step with its own state, stacked along the learner axis, and the rule's correction follows it.

Checked against NumPy transcriptions of Adam, AdamW and RMSprop (tests/numpy_reference.py), against
plain Keras (fit with Adam on the embedded digits), and through the command line (the YAML
``optimizer:`` key, checkpoints with the stacked state, tf_ssgd with the same optimizer)."""
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.algorithms import SMA, ElasticAveragingSGD, LocalSGD, SynchronousSGD
from crossbow_tf.data import from_arrays
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.schedule import StepSchedule
from crossbow_tf.engine.trainer import train
from crossbow_tf.results import RunResults
from numpy_reference import NumpyAdam, NumpyRMSprop, run_reference_optimizer
from conftest import DEVICES
from test_averaging_rules import assert_matches
from test_engine_reference import B, CLASSES, LOSS, N, small_mlp, toy_data


def run_engine(algorithm, optimizer, devices, m, iterations_wanted, base_lr, drops=()):
    x, y = toy_data()
    model = small_mlp()
    params0 = [v.numpy() for v in model.trainable_variables]
    strategy = CrossbowStrategy(devices=devices, learners_per_device=m)
    engine = Engine(model, LOSS, algorithm, strategy, optimizer=optimizer)
    k = strategy.num_learners
    per_epoch = math.ceil(N / (k * B))
    epochs = math.ceil(iterations_wanted / per_epoch)
    data = from_arrays("toy", (x, y), (x, y), num_classes=CLASSES)
    train(engine, data, B, epochs, StepSchedule(base_lr, list(drops), 0.1), RunResults("t", env={}),
          shuffle=False, log=lambda *a: None)
    return engine, params0, x, y, k, epochs * per_epoch


# (name, Keras optimizer, its NumPy transcription, devices, learners per device, SMA's sync period)
CASES = {
    "adam_D1xm2": (lambda: keras.optimizers.Adam(), NumpyAdam(), 1, 2, 1),
    "adamw_D2xm2": (lambda: keras.optimizers.AdamW(weight_decay=0.05), NumpyAdam(weight_decay=0.05), 2, 2, 1),
    "rmsprop_D2xm1": (lambda: keras.optimizers.RMSprop(momentum=0.5, centered=True),
                      NumpyRMSprop(momentum=0.5, centered=True), 2, 1, 1),
    "adam_sync_every_2_D2xm1": (lambda: keras.optimizers.Adam(beta_1=0.8), NumpyAdam(beta_1=0.8), 2, 1, 2),
    # Clipping applies per learner: each learner's gradient tensors, or one learner's global norm.
    "adam_clipnorm_D1xm2": (lambda: keras.optimizers.Adam(clipnorm=0.05), NumpyAdam(clipnorm=0.05), 1, 2, 1),
    "adam_global_clipnorm_D2xm1": (lambda: keras.optimizers.Adam(global_clipnorm=0.1),
                                   NumpyAdam(global_clipnorm=0.1), 2, 1, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sma_learners_with_keras_optimizer_match_numpy_reference(case, cpu_devices):
    make_optimizer, reference, num_devices, m, period = CASES[case]
    drops = [3]   # a step drop of the rate at iteration 3: SMA's learners restart from z, keeping their state
    engine, params0, x, y, k, iterations = run_engine(
        SMA(momentum=0.0, sync_period=period), make_optimizer(), cpu_devices[:num_devices], m, 6, 0.05, drops)
    z_ref, w_ref = run_reference_optimizer("sma", reference, params0, x, y, k, B, iterations, 0.05, drops,
                                           period=period)
    assert_matches(engine, z_ref, w_ref, params0)
    # The comparison has teeth: the transcription with another decay rate of its moments ends elsewhere.
    other = dict(vars(reference), **({"beta_1": 0.5} if isinstance(reference, NumpyAdam) else {"rho": 0.5}))
    z_other, _ = run_reference_optimizer("sma", type(reference)(**other), params0, x, y, k, B, iterations, 0.05,
                                         drops, period=period)
    assert max(np.abs(a - b).max() for a, b in zip(engine.center_weights(), z_other)) > 1e-4
    # Each learner has its own optimizer state: the slots are stacks of m learners, and they differ.
    # Every slot that is not a scalar (the step count) is a stack of m learners of one weight's shape.
    shapes = {tuple(v.shape) for v in engine.weights[0]}
    slots = [v.numpy() for v in engine.optimizer_states[0] if v.shape.rank]
    assert slots and all(s.shape[0] == m and s.shape in shapes for s in slots)
    if m > 1:
        assert any(not np.array_equal(s[0], s[1]) for s in slots)
    assert int(engine.optimizers.clones[0].iterations.numpy()) == iterations


def test_clipping_per_learner_bites():
    """The clipped cases above are only evidence if clipping changed the steps: without it the
    NumPy reference ends elsewhere."""
    x, y = toy_data()
    params0 = [v.numpy() for v in small_mlp().trainable_variables]
    clipped, _ = run_reference_optimizer("sma", NumpyAdam(clipnorm=0.05), params0, x, y, 2, B, 6, 0.05, [3])
    free, _ = run_reference_optimizer("sma", NumpyAdam(), params0, x, y, 2, B, 6, 0.05, [3])
    assert max(np.abs(a - b).max() for a, b in zip(clipped, free)) > 1e-3


def test_localsgd_with_adamw_inner_steps_matches_numpy_reference(cpu_devices):
    """DiLoCo's shape: AdamW inner steps, every 3 iterations a Nesterov outer step on z."""
    algorithm = LocalSGD(period=3, momentum=0.0, outer_learning_rate=0.7, outer_momentum=0.9, nesterov=True)
    engine, params0, x, y, k, iterations = run_engine(
        algorithm, keras.optimizers.AdamW(weight_decay=0.1), cpu_devices[:2], 2, 9, 0.05)
    z_ref, w_ref = run_reference_optimizer("localsgd", NumpyAdam(weight_decay=0.1), params0, x, y, k, B,
                                           iterations, 0.05, period=3, outer_lr=0.7, outer_mu=0.9, nesterov=True)
    assert_matches(engine, z_ref, w_ref, params0)


def test_easgd_learners_with_rmsprop_match_numpy_reference(cpu_devices):
    engine, params0, x, y, k, iterations = run_engine(
        ElasticAveragingSGD(momentum=0.0), keras.optimizers.RMSprop(), cpu_devices[:2], 1, 6, 0.02)
    z_ref, w_ref = run_reference_optimizer("easgd", NumpyRMSprop(), params0, x, y, k, B, iterations, 0.02)
    assert_matches(engine, z_ref, w_ref, params0)


# --- Keras fit -------------------------------------------------------------------------------------

def digits_mlp(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def digits():
    from crossbow_tf.data import load_embedded_mnist
    return load_embedded_mnist()


@pytest.fixture(scope="module")
def adam_on_256_digits(digits):
    """use_sma with Adam(2e-3) (noise matching on: auto) on 2 devices x 2 learners, fitted for one
    unshuffled epoch on the first 256 digits, and its weights right after the fit: the rate-scale
    test's reference and the noise-matching test's matched learners (which then changes the model)."""
    import crossbow_tf
    (x, y), _ = digits
    strategy = CrossbowStrategy(devices=DEVICES[:2], learners_per_device=2)
    model = crossbow_tf.use_sma(digits_mlp(keras.optimizers.Adam(2e-3)), strategy)
    model.fit(x[:256], y[:256], batch_size=64, epochs=1, shuffle=False, verbose=0)
    return model, [w.copy() for w in model.get_weights()]


def test_use_sma_with_adam_trains_within_a_band_of_plain_keras_adam(digits, tmp_path):
    import crossbow_tf
    (x, y), (x_test, y_test) = digits
    plain = digits_mlp(keras.optimizers.Adam(1e-3))
    plain.fit(x, y, batch_size=64, epochs=2, verbose=0)
    _, plain_accuracy = plain.evaluate(x_test, y_test, verbose=0)

    strategy = CrossbowStrategy(devices=DEVICES[:2], learners_per_device=2)
    model = crossbow_tf.use_sma(digits_mlp(keras.optimizers.Adam(1e-3)), strategy)
    model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    engine = crossbow_tf.keras.get_training(model).engine
    assert engine.optimizers is not None and not engine.velocities[0]   # Adam's own step, no SGD velocity
    assert plain_accuracy > 0.85 and abs(accuracy - plain_accuracy) < 0.03, (accuracy, plain_accuracy)

    # BackupAndRestore's sidecar carries every learner's Adam state with the learners.
    training = crossbow_tf.keras.get_training(model)
    saved = [v.numpy() for v in engine.optimizer_states[1]]
    assert int(engine.optimizers.clones[1].iterations.numpy()) == 2 * 63   # ceil(4000 / 64) steps per epoch
    training.save_state(str(tmp_path / "state.npz"))
    engine.optimizers.restart()
    assert int(engine.optimizers.clones[1].iterations.numpy()) == 0
    assert training.load_state(str(tmp_path / "state.npz"))
    for got, want in zip(engine.optimizer_states[1], saved):
        np.testing.assert_array_equal(got.numpy(), want)


def test_ssgd_with_adam_and_a_schedule_is_keras_adam_at_the_global_batch(digits):
    """S-SGD's z takes the optimizer's step with the learners' mean gradient: exactly what Keras's
    fit does with Adam at the global batch, its learning-rate schedule and clipping included."""
    import crossbow_tf
    (x, y), _ = digits
    x, y = x[:512], y[:512]

    def adam():
        return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(2e-3, 4, 0.5), clipnorm=0.5)
    plain = digits_mlp(adam())
    plain.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    strategy = CrossbowStrategy(devices=DEVICES[:2], learners_per_device=2)
    model = crossbow_tf.use_sma(digits_mlp(adam()), strategy, algorithm="ssgd")
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    initial = digits_mlp(adam()).get_weights()
    for got, want, start in zip(model.get_weights(), plain.get_weights(), initial):
        assert np.abs(want - start).max() > 1e-3
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_learning_rate_scale_is_the_learners_rate_and_only_theirs(digits, adam_on_256_digits):
    """use_sma(learning_rate_scale=s) with Adam(lr) trains as use_sma with Adam(s*lr), while the
    compiled rate (schedules, callbacks, logs) stays lr; refused where the average is already linear."""
    import crossbow_tf
    (x, y), _ = digits
    x, y = x[:256], y[:256]
    strategy = CrossbowStrategy(devices=DEVICES[:2], learners_per_device=2)
    scaled = crossbow_tf.use_sma(digits_mlp(keras.optimizers.Adam(1e-3)), strategy, learning_rate_scale=2.0)
    scaled.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    _, compiled = adam_on_256_digits   # use_sma with Adam(2e-3), fitted alike
    initial = digits_mlp(keras.optimizers.Adam()).get_weights()
    assert len(scaled.get_weights()) == len(compiled) == len(initial) == 4
    for got, want, start in zip(scaled.get_weights(), compiled, initial, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        assert np.abs(want - start).max() > 1e-3   # both trained: the match is not of untouched weights
    assert float(scaled.optimizer.learning_rate) == pytest.approx(1e-3)
    for optimizer, algorithm, match in ((keras.optimizers.SGD(0.1, momentum=0.9), "sma", "average linearly"),
                                        (keras.optimizers.Adam(), "ssgd", "mean gradient")):
        with pytest.raises(ValueError, match=match):
            crossbow_tf.use_sma(digits_mlp(optimizer), strategy, algorithm=algorithm, learning_rate_scale=2.0)
    for bad in (0, -1.0, float("nan"), True, "2"):
        with pytest.raises(ValueError, match="learning_rate_scale must be a number > 0"):
            crossbow_tf.use_sma(digits_mlp(keras.optimizers.Adam()), strategy, learning_rate_scale=bad)


@pytest.mark.parametrize("optimizer, reason", [
    (lambda: keras.optimizers.Lamb(), "trust ratio"),
    (lambda: keras.optimizers.Adafactor(), "factors its second moments"),
    (lambda: keras.optimizers.Muon(), "orthogonalises"),
    (lambda: keras.optimizers.Adam(use_ema=True), "use_ema"),
    (lambda: keras.optimizers.Adam(gradient_accumulation_steps=2), "gradient_accumulation_steps"),
])
def test_optimizers_that_are_not_elementwise_are_refused_with_the_reason(optimizer, reason):
    import crossbow_tf
    strategy = CrossbowStrategy(devices=DEVICES[:1], learners_per_device=2)
    with pytest.raises(ValueError, match=reason):
        crossbow_tf.use_sma(digits_mlp(optimizer()), strategy)


@pytest.mark.parametrize("optimizer, says", [
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), r"Engine\(\.\.\., loss_scale=True\)"),
    (lambda: keras.optimizers.SGD(0.1, loss_scale_factor=128.0), r"loss_scale_factor.*loss_scale=True"),
])
def test_the_engine_refuses_a_loss_scaling_optimizer_naming_its_own_loss_scaling(optimizer, says):
    with pytest.raises(ValueError, match=says):
        Engine(small_mlp(), LOSS, SMA(), CrossbowStrategy(devices=DEVICES[:1], learners_per_device=2),
               optimizer=optimizer())


def adamw_sparing_biases():
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


@pytest.mark.parametrize("name", ["SGD_nesterov", "Adagrad", "Adamax", "Nadam", "Lion", "Adadelta", "Ftrl",
                                  "AdamW_sparing_biases"])
def test_every_elementwise_keras_optimizer_takes_its_own_step_per_learner(name, cpu_devices):
    """One learner on a device alone (alpha = 0) is exactly one Keras model with that optimizer
    taking its own steps on its slice: the stacked state is per-learner Keras state."""
    make = {"SGD_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
            # Adadelta's rate multiplies a step that is already of the weights' scale.
            "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
            # exclude_from_weight_decay names the model's variables; the stacks follow them.
            "AdamW_sparing_biases": adamw_sparing_biases}.get(name, lambda: getattr(keras.optimizers, name)(0.05))
    x, y = toy_data()
    model = small_mlp()
    strategy = CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2)
    engine = Engine(model, LOSS, SMA(alpha=0.0, momentum=0.0), strategy, optimizer=make())
    reference = [small_mlp() for _ in range(2)]
    optimizers = [make() for _ in range(2)]
    for t in range(3):
        rows = slice(t * 2 * B, (t + 1) * 2 * B)
        engine.train_step(x[rows], y[rows], None, 1.0 if name == "Adadelta" else 0.05)
        for j, (ref, opt) in enumerate(zip(reference, optimizers)):
            xs, ys = x[rows][j * B:(j + 1) * B], y[rows][j * B:(j + 1) * B]
            with tf.GradientTape() as tape:
                loss = LOSS(ys, ref(xs, training=True))
            opt.apply(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables)
    for j, ref in enumerate(reference):
        for got, want in zip(engine.learner_weights()[j], ref.get_weights()):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"{name}, learner {j}")
    assert max(np.abs(a - b).max() for a, b in zip(reference[0].get_weights(), reference[1].get_weights())) > 1e-3


# --- the command line: the YAML optimizer key, checkpoints of the stacked state, tf_ssgd ------------

def test_yaml_optimizer_key_errors_are_one_line_with_exit_2(tmp_path, capsys):
    from crossbow_tf.run import main
    from test_checkpoint import write_config
    for optimizer, message in (({"name": "lamb"}, "optimizer.name: lamb cannot be the learners' optimizer"),
                               ({"name": "adm"}, "optimizer.name: unknown optimizer 'adm'"),
                               ({"name": "adam", "learning_rate": 0.1}, "optimizer.learning_rate: the learning rate"),
                               ({"name": "adam", "betta_1": 0.9}, "optimizer.betta_1: Adam takes no argument 'betta_1'"),
                               ({"name": "adam", "use_ema": True}, "Adam(use_ema=True) is not supported")):
        config = write_config(tmp_path / "c.yaml", optimizer=optimizer, devices={"logical_cpu": 4},
                              learners_per_device=1, epochs=1)
        assert main(["--config", config]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_tf_ssgd_takes_the_same_optimizer_key(tmp_path):
    """The stock baseline compiles the YAML's optimizer (Adam here), so a comparison is like for like."""
    import json

    from baselines.tf_ssgd import main
    from test_checkpoint import tiny_mnist, write_config
    config = write_config(tmp_path / "c.yaml", model="test_learner_optimizers:tiny_cnn",
                          data={"name": "mnist", "data_dir": tiny_mnist(tmp_path / "mnist")}, batch_size=32,
                          learning_rate={"base": 0.003}, optimizer={"name": "adam", "beta_2": 0.99}, epochs=2, seed=1)
    assert main(["--config", config, "--results", str(tmp_path / "r.json")]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["optimizer"] == "keras.src.optimizers.adam.Adam"
    assert results["evaluations"][-1]["accuracy"] > 0.6


def tiny_cnn(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Conv2D(8, 5, strides=2, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(num_classes)])


def test_sigkill_then_resume_with_adam_state_stacked_per_learner_is_bit_identical(tmp_path):
    """crossbow_tf.run with `optimizer: {name: adam}` (a BatchNorm + Dropout model, that of the
    checkpoint tests without its convolution: adam_checkpoint_model.py): the checkpoint holds Adam's
    step count and moments of every learner, and a run killed and resumed ends bit for bit where an
    uninterrupted one does."""
    import os
    import random
    import signal

    from crossbow_tf.engine.checkpoint import checkpoint_paths
    from test_checkpoint import Process, assert_bit_identical, kill_and_resume, tiny_config
    model = os.path.join(os.path.dirname(__file__), "adam_checkpoint_model.py") + ":bn_dropout_dense"
    config = tiny_config(tmp_path, model=model, optimizer={"name": "adam"},
                         learning_rate={"base": 0.003, "drops_at_epochs": [1]}, epochs=2,
                         checkpoint={"every_iterations": 3})
    command = ["-m", "crossbow_tf.run", "--config", config, "--checkpoint-dir"]
    # The uninterrupted reference runs beside the killed one; the kill lands after observed checkpoints.
    reference = Process(command + [str(tmp_path / "reference")])
    killed = kill_and_resume(command + [str(tmp_path / "killed"), "--resume"], tmp_path / "killed",
                             kills=1, rng=random.Random(7))
    assert reference.finish() == 0, reference.output
    assert killed[-1].proc.returncode == 0, killed[-1].output
    assert killed[0].proc.returncode == -signal.SIGKILL and "resuming from" in killed[-1].output
    assert_bit_identical(tmp_path / "killed", tmp_path / "reference")
    reader = tf.train.load_checkpoint(checkpoint_paths(str(tmp_path / "killed"))[0])
    shapes = {k: s for k, s in reader.get_variable_to_shape_map().items() if k.startswith("optimizer_states/")}
    weights = {k: s for k, s in reader.get_variable_to_shape_map().items() if k.startswith("weights/")}
    # Per device: Adam's step count, its rate, and a first and second moment per weight, each [m, ...].
    assert len(shapes) == 2 * (2 + 2 * len(weights) // 2)
    assert sorted(s for s in shapes.values() if s) == sorted(list(weights.values()) * 2)
    steps = [reader.get_tensor(k) for k, s in shapes.items() if not s and reader.get_tensor(k).dtype.kind == "i"]
    assert steps == [40, 40]   # 2 epochs of 20 iterations on each device's clone
    # Adam's learners run with noise matching (use_sma's and the YAML's auto): its running means are
    # in the checkpoint too, and the bit-identical resume above restored them.
    noise = {k: s for k, s in reader.get_variable_to_shape_map().items() if k.startswith("noise_statistics/")}
    assert sorted(noise.values()) == sorted([s[1:] for s in weights.values()] * 2)
    assert all(reader.get_tensor(k).max() > 0 for k in noise)
    assert "noise matching (decay 0.999)" in reference.output
    # BatchNorm's moving mean and variance and Dropout's seed, per learner of each device, are in it too.
    states = [s for k, s in reader.get_variable_to_shape_map().items() if k.startswith("states/")]
    assert sorted(states) == sorted([[2, 16], [2, 16], [2, 2]] * 2)


# --- noise matching ----------------------------------------------------------------------------------

def run_noise_matched(algorithm, optimizer, devices, m, iterations_wanted, base_lr):
    x, y = toy_data()
    model = small_mlp()
    params0 = [v.numpy() for v in model.trainable_variables]
    strategy = CrossbowStrategy(devices=devices, learners_per_device=m)
    engine = Engine(model, LOSS, algorithm, strategy, optimizer=optimizer, noise_matching=True)
    k = strategy.num_learners
    per_epoch = math.ceil(N / (k * B))
    epochs = math.ceil(iterations_wanted / per_epoch)
    data = from_arrays("toy", (x, y), (x, y), num_classes=CLASSES)
    train(engine, data, B, epochs, StepSchedule(base_lr, [], 0.1), RunResults("t", env={}),
          shuffle=False, log=lambda *a: None)
    return engine, params0, x, y, k, epochs * per_epoch


# (Keras optimizer, its NumPy transcription, rule, the reference's rule name, devices, learners per device)
NOISE_CASES = {
    "adam_sma_D1xm2": (lambda: keras.optimizers.Adam(), NumpyAdam(), lambda: SMA(momentum=0.0), "sma", 1, 2, {}),
    "adamw_sma_D2xm2": (lambda: keras.optimizers.AdamW(weight_decay=0.05), NumpyAdam(weight_decay=0.05),
                        lambda: SMA(momentum=0.0), "sma", 2, 2, {}),
    "rmsprop_easgd_D2xm1": (lambda: keras.optimizers.RMSprop(), NumpyRMSprop(),
                            lambda: ElasticAveragingSGD(momentum=0.0), "easgd", 2, 1, {}),
    "adam_localsgd_D2xm2": (lambda: keras.optimizers.Adam(beta_2=0.9), NumpyAdam(beta_2=0.9),
                            lambda: LocalSGD(period=1, momentum=0.0), "localsgd", 2, 2, {}),
}


@pytest.mark.parametrize("case", sorted(NOISE_CASES))
def test_noise_matched_learners_match_numpy_reference(case, cpu_devices):
    make_optimizer, reference, make_rule, name, num_devices, m, options = NOISE_CASES[case]
    engine, params0, x, y, k, iterations = run_noise_matched(make_rule(), make_optimizer(),
                                                             cpu_devices[:num_devices], m, 9, 0.05)
    decay = engine.noise_decay
    assert decay == getattr(reference, "beta_2", getattr(reference, "rho", None))
    z_ref, w_ref = run_reference_optimizer(name, reference, params0, x, y, k, B, iterations, 0.05,
                                           noise_decay=decay, **options)
    assert_matches(engine, z_ref, w_ref, params0)
    # Teeth: the factors moved off 1, and the unmatched reference ends measurably elsewhere.
    factors = np.concatenate([f.numpy().ravel() for f in engine.noise_factors()])
    assert factors.max() > 1.05 and factors.min() >= 1.0 and factors.max() <= math.sqrt(k) + 1e-6
    z_plain, _ = run_reference_optimizer(name, reference, params0, x, y, k, B, iterations, 0.05, **options)
    assert max(np.abs(a - b).max() for a, b in zip(engine.center_weights(), z_plain)) > 1e-3
    # Every device keeps the same statistics (each updates its copy from the all-reduced sums).
    for d in range(1, num_devices):
        for a0, ad in zip(engine.learner_square[0] + engine.global_square[0],
                          engine.learner_square[d] + engine.global_square[d]):
            np.testing.assert_array_equal(a0.numpy(), ad.numpy())


@pytest.mark.parametrize("optimizer, rule, says", [
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), lambda: SMA(momentum=0.0),
     "linear in the gradient"),
    (lambda: keras.optimizers.Adam(), lambda: SynchronousSGD(momentum=0.0), "synchronous SGD already steps z"),
    (lambda: keras.optimizers.Adam(), lambda: SMA(momentum=0.0, sync_period=2), "does not synchronise every iteration"),
    (lambda: keras.optimizers.Adam(), lambda: LocalSGD(period=1, momentum=0.0, local_after_epochs=1),
     "does not synchronise every iteration"),
    # Not noise matching's refusal, but the Engine's: the rule's own momentum would be unused.
    (lambda: keras.optimizers.Adam(), lambda: SMA(), "give SMA momentum=0.0 .*momentum=0.9 would be unused"),
])
def test_noise_matching_is_refused_where_it_does_not_apply(optimizer, rule, says, cpu_devices):
    with pytest.raises(ValueError, match=says):
        Engine(small_mlp(), LOSS, rule(), CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2),
               optimizer=optimizer(), noise_matching=True)


def test_use_sma_turns_noise_matching_on_exactly_where_it_applies(digits, adam_on_256_digits):
    """auto: on for Adam / RMSprop under SMA, EASGD and local SGD averaging every step; off for SGD,
    for S-SGD and for a rule with a sync period. True where it does not apply, or a bad value, is
    one clear error; False gives the learners the optimizer's plain steps (another end point)."""
    import crossbow_tf
    (x, y), _ = digits
    x, y = x[:256], y[:256]
    strategy = CrossbowStrategy(devices=DEVICES[:2], learners_per_device=2)

    def engine_of(optimizer, fit=False, **options):
        model = crossbow_tf.use_sma(digits_mlp(optimizer), strategy, **options)   # built: its engine exists
        if fit:
            model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        return model, crossbow_tf.keras.sma.get_training(model).engine

    matched, _ = adam_on_256_digits   # engine_of(Adam(2e-3), fit=True), shared with the rate-scale test
    engine = crossbow_tf.keras.sma.get_training(matched).engine
    assert engine.noise_decay == 0.999
    # Weights set from outside: the learners restart from them, and the statistics with their optimizer.
    saved = [w.numpy().copy() for w in engine.learner_square[0]]
    assert all(w.max() > 0 for w in saved)
    matched.set_weights([0.5 * w for w in matched.get_weights()])
    assert crossbow_tf.keras.sma.get_training(matched).adopt_model_weights()
    assert all(not v.numpy().any() for d in engine.learner_square + engine.global_square for v in d)
    matched.set_weights([2.0 * w for w in matched.get_weights()])
    assert engine_of(keras.optimizers.RMSprop(1e-3), algorithm=LocalSGD(period=1))[1].noise_decay == 0.9
    unmatched, engine = engine_of(keras.optimizers.Adam(2e-3), fit=True, noise_matching=False)
    assert engine.noise_decay is None
    assert max(np.abs(a - b).max() for a, b in zip(matched.get_weights(), unmatched.get_weights())) > 1e-4
    for optimizer, options in ((keras.optimizers.SGD(0.05, momentum=0.9), {}),
                               (keras.optimizers.Adam(), {"algorithm": "ssgd"}),
                               (keras.optimizers.Adam(), {"algorithm": SMA(sync_period=2)})):
        assert engine_of(optimizer, **options)[1].noise_decay is None
    for optimizer, options, match in (
            (keras.optimizers.SGD(0.05, momentum=0.9), {}, "SGD's step is linear"),
            (keras.optimizers.Adam(), {"algorithm": "ssgd"}, "synchronous SGD already steps z"),
            (keras.optimizers.Adam(), {"algorithm": SMA(sync_period=4)}, "does not synchronise every iteration")):
        with pytest.raises(ValueError, match=match):
            crossbow_tf.use_sma(digits_mlp(optimizer), strategy, noise_matching=True, **options)
    for bad in ("on", 1, None):
        with pytest.raises(ValueError, match="noise_matching must be \"auto\", True or False"):
            crossbow_tf.use_sma(digits_mlp(keras.optimizers.Adam()), strategy, noise_matching=bad)


def test_yaml_noise_matching_key(tmp_path, capsys):
    """algorithm.noise_matching: true where it does not apply, or not auto/true/false, is one line
    with exit 2; auto (the default) is on for Adam's learners and off for the default SGD."""
    from crossbow_tf.config import load_config, noise_matching_on
    from crossbow_tf.run import main
    from test_checkpoint import write_config
    for options, message in (({}, "algorithm.noise_matching: it applies to an adaptive optimizer"),
                             ({"optimizer": {"name": "sgd", "momentum": 0.9}}, "SGD's step is linear"),
                             ({"optimizer": {"name": "adam"}, "algorithm": {"name": "ssgd"}},
                              "synchronous SGD already steps z"),
                             ({"optimizer": {"name": "adam"}, "algorithm": {"name": "sma", "sync_period": 2}},
                              "does not synchronise every iteration")):
        algorithm = dict({"name": "sma"}, **options.pop("algorithm", {}), noise_matching=True)
        config = write_config(tmp_path / "c.yaml", algorithm=algorithm, devices={"logical_cpu": 4},
                              learners_per_device=1, epochs=1, **options)
        assert main(["--config", config]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    config = write_config(tmp_path / "c.yaml", algorithm={"name": "sma", "noise_matching": "yes"},
                          devices={"logical_cpu": 4}, learners_per_device=1, epochs=1)
    assert main(["--config", config]) == 2
    assert "algorithm.noise_matching: must be auto, true or false, got 'yes'" in capsys.readouterr().err
    adam = write_config(tmp_path / "adam.yaml", optimizer={"name": "adam"}, devices={"logical_cpu": 4},
                        learners_per_device=1, epochs=1)
    sgd = write_config(tmp_path / "sgd.yaml", devices={"logical_cpu": 4}, learners_per_device=1, epochs=1)
    assert noise_matching_on(load_config(adam)) and not noise_matching_on(load_config(sgd))
