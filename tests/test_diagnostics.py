"""Per-epoch learner diagnostics, the collapse stop and z's BatchNorm statistics recomputed."""
import keras
import numpy as np
import pytest

from crossbow_tf.algorithms import SMA
from crossbow_tf.data import from_arrays, load_embedded_mnist
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine import diagnostics
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.schedule import StepSchedule
from crossbow_tf.engine.trainer import batchnorm_batches, train
from crossbow_tf.results import RunResults

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def bn_cnn(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 5, use_bias=False),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.MaxPooling2D(2),
                             keras.layers.Flatten(), keras.layers.Dense(16, use_bias=False),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.Dense(10)])


@pytest.fixture(scope="module")
def small_mnist():
    (x, y), (xt, yt) = load_embedded_mnist()
    return from_arrays("mnist", (x[:512], y[:512]), (xt[:200], yt[:200]), num_classes=10)


def test_distance_to_center_against_numpy(cpu_devices):
    engine = Engine(bn_cnn(0), LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    assert diagnostics.mean_distance_to_center(engine) == 0.0          # learners start at z
    rng = np.random.default_rng(0)
    x = rng.random((16, 28, 28, 1), dtype=np.float32)
    engine.train_step(x, rng.integers(0, 10, 16).astype(np.int32), np.ones(16), 0.1)
    z = engine.center_weights()
    want = np.mean([np.sqrt(sum(np.sum((w - c) ** 2) for w, c in zip(learner, z)))
                    for learner in engine.learner_weights()])
    assert want > 0
    assert diagnostics.mean_distance_to_center(engine) == pytest.approx(want, rel=1e-5)


def test_write_learner_to_model_evaluates_that_learner(cpu_devices):
    engine = Engine(bn_cnn(1), LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    rng = np.random.default_rng(1)
    x = rng.random((16, 28, 28, 1), dtype=np.float32)
    engine.train_step(x, rng.integers(0, 10, 16).astype(np.int32), np.ones(16), 0.1)
    diagnostics.write_learner_to_model(engine, 3)                       # device 1, learner 1
    for var, w in zip(engine.model.trainable_variables, engine.learner_weights()[3]):
        np.testing.assert_array_equal(var.numpy(), w)
    for var, state in zip(engine.model.non_trainable_variables, engine.states[1]):
        np.testing.assert_array_equal(var.numpy(), state.numpy()[1])
    engine.write_center_to_model()
    for var, z in zip(engine.model.trainable_variables, engine.center_weights()):
        np.testing.assert_array_equal(var.numpy(), z)


def test_recompute_batchnorm_is_the_mean_of_batch_statistics():
    model = bn_cnn(2)
    rng = np.random.default_rng(2)
    batches = [rng.random((32, 28, 28, 1), dtype=np.float32) * (1 + i) for i in range(3)]
    assert diagnostics.recompute_batchnorm(model, iter(batches)) == 3
    first = model.layers[1]
    conv = keras.Model(model.inputs, model.layers[0].output)
    stats = [conv(b).numpy() for b in batches]
    np.testing.assert_allclose(first.moving_mean.numpy(), np.mean([s.mean(axis=(0, 1, 2)) for s in stats], 0),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(first.moving_variance.numpy(), np.mean([s.var(axis=(0, 1, 2)) for s in stats], 0),
                               rtol=1e-4, atol=1e-6)
    assert first.momentum == 0.99                                       # restored
    assert diagnostics.recompute_batchnorm(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                                           iter([np.ones((2, 3))])) == 0


def plain_model(weights, states):
    """A plain Keras bn_cnn holding WEIGHTS and STATES (NumPy arrays)."""
    model = bn_cnn(0)
    for variable, value in zip(model.trainable_variables, weights, strict=True):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, states, strict=True):
        variable.assign(value)
    return model


def accuracy_of(model, split):
    x, y = split
    return float(np.mean(np.argmax(model(x, training=False).numpy(), -1) == y))


def batch_statistics(model, batches):
    """Per BatchNorm layer of a bn_cnn, the mean over BATCHES of its inputs' batch means and
    (biased) variances, with every BatchNorm normalising by its batch's statistics (training)."""
    conv, norm1, relu, pool, flatten, dense, norm2 = model.layers[:7]
    means, variances = ([], []), ([], [])
    for x in batches:
        first = conv(x)
        second = dense(flatten(pool(relu(norm1(first, training=True)))))
        for i, (values, axes) in enumerate(((first, (0, 1, 2)), (second, (0,)))):
            means[i].append(np.mean(values.numpy(), axes))
            variances[i].append(np.var(values.numpy(), axes))
    return [np.mean(means[0], 0), np.mean(variances[0], 0), np.mean(means[1], 0), np.mean(variances[1], 0)]


def test_trainer_records_diagnostics_and_both_batchnorm_accuracies(small_mnist, cpu_devices):
    """The recorded learner-0 accuracy is a plain Keras model's with learner 0's weights and state,
    and the recomputed-BatchNorm accuracy a plain model's with z's weights and, as moving statistics,
    the mean of its BatchNorm inputs' batch statistics over the trainer's batches."""
    engine = Engine(bn_cnn(3), LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    results = RunResults("sma", env={})
    train(engine, small_mnist, 16, 2, StepSchedule(0.1), results, batchnorm_eval="both", batchnorm_batches_count=2,
          eval_batch_size=100, log=lambda *a: None)
    # The trainer's batches, drawn as it draws them (tf.data's shuffle takes the global seed too).
    batches = list(batchnorm_batches(small_mnist, 100, 2, seed=0))
    for e in results.evaluations:
        assert 0 <= e["learner_accuracy"] <= 1 and e["learner_distance"] > 0 and e["test_examples"] == 200
        assert 0 <= e["accuracy_bn_recomputed"] <= 1 and e["bn_recompute_time"] > 0
    last = results.evaluations[-1]
    (_, _), (xt, yt) = load_embedded_mnist()
    test = (xt[:200], yt[:200])
    learner = plain_model(engine.learner_weights()[0], [s.numpy()[0] for s in engine.states[0]])
    center = plain_model(engine.center_weights(), [s.numpy() for s in engine.center_states[0]])
    assert last["learner_accuracy"] == accuracy_of(learner, test)
    assert last["accuracy"] == accuracy_of(center, test)
    assert last["learner_accuracy"] != last["accuracy"]   # learner 0 is not z: the check can tell them apart
    averaged = [v.numpy() for v in center.non_trainable_variables]
    recomputed = batch_statistics(plain_model(engine.center_weights(), averaged), batches)
    assert len(recomputed) == len(averaged) == 4
    assert all(np.abs(a - r).max() > 1e-3 for a, r in zip(averaged, recomputed, strict=True))
    with_recomputed = plain_model(engine.center_weights(), recomputed)
    assert last["accuracy_bn_recomputed"] == accuracy_of(with_recomputed, test)
    # "both" reports the averaged statistics' accuracy and leaves z's averaged statistics in the model.
    for var, z, f in zip(engine.model.non_trainable_variables, engine.center_states[0], engine._float_state,
                         strict=True):
        if f:
            np.testing.assert_array_equal(var.numpy(), z.numpy())
    with pytest.raises(ValueError, match="batchnorm_eval"):
        train(engine, small_mnist, 16, 1, StepSchedule(0.05), RunResults("sma", env={}), batchnorm_eval="mean")


def test_a_run_at_chance_stops_as_collapsed(small_mnist, cpu_devices):
    keras.utils.set_random_seed(4)
    # A huge rate kills every ReLU: the logits are the output bias alone, the same for every image.
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2))
    results = RunResults("sma", env={})
    lines = []
    train(engine, small_mnist, 16, 6, StepSchedule(1e6), results, collapse_epochs=2, log=lines.append)
    assert results.extra.get("collapsed") is True, [e["accuracy"] for e in results.evaluations]
    assert len(results.evaluations) == 3                                # epochs 2 and 3 at chance after the first
    assert any(line.startswith("collapsed: test accuracy at chance") for line in lines)
