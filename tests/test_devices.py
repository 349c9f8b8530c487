"""The devices a run trains on and how they reduce (issue 30): every accepted cross-device
reduction gives the same run, the device count means the same k everywhere, and the choice is
stated. GPU machines are given to the device-choice logic as lists; nothing here runs on a GPU."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.algorithms import SMA
from crossbow_tf.data import from_arrays, load_embedded_mnist
from crossbow_tf.device_choice import choose_devices, describe_devices, reduction_problem, visible_gpu_ids
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.schedule import StepSchedule
from crossbow_tf.engine.trainer import train
from crossbow_tf.errors import ConfigError
from crossbow_tf.models import build_model
from crossbow_tf.results import RunResults

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def few_digits():
    (x, y), (xt, yt) = load_embedded_mnist()
    return from_arrays("mnist", (x[:192], y[:192]), (xt[:64], yt[:64]), num_classes=10)


def lenet_sma_run(data, devices, learners_per_device, reduction):
    """LeNet, SMA, 192 digits, 1 epoch of batch 16 per learner, seed 0: z at the end."""
    keras.utils.set_random_seed(0)
    model = build_model("lenet", (28, 28, 1), 10)
    strategy = CrossbowStrategy(devices=devices, learners_per_device=learners_per_device,
                                cross_device_reduction=reduction)
    engine = Engine(model, LOSS, SMA(), strategy)
    train(engine, data, 16, 1, StepSchedule(0.05), RunResults("t", env={}), seed=0, log=lambda *a: None)
    return engine.center_weights()


def assert_same_weights(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)


@pytest.mark.parametrize("num_devices", [3, 4])
def test_every_accepted_reduction_gives_the_run_of_one_device(few_digits, cpu_devices, num_devices):
    # The reference has no cross-device reduction at all: the same k learners on one device.
    reference = lenet_sma_run(few_digits, cpu_devices[:1], num_devices, "auto")
    keras.utils.set_random_seed(0)
    start = [w.numpy() for w in build_model("lenet", (28, 28, 1), 10).trainable_weights]
    assert max(np.abs(r - s).max() for r, s in zip(reference, start, strict=True)) > 1e-3   # it trained
    accepted = [r for r in ("auto", "one_device", "hierarchical_copy") if not reduction_problem(r, num_devices)]
    assert accepted == (["auto", "one_device"] if num_devices == 3 else ["auto", "one_device", "hierarchical_copy"])
    for reduction in accepted:
        assert_same_weights(lenet_sma_run(few_digits, cpu_devices[:num_devices], 1, reduction), reference)


def test_tensorflow_hierarchical_copy_drops_a_device_of_three(cpu_devices):
    # Why it is refused: TensorFlow's own implementation, given 1, 10 and 100, returns 11.
    from tensorflow.python.distribute import values as values_lib
    ops = tf.distribute.HierarchicalCopyAllReduce(num_packs=1)
    per_device = []
    for d, value in zip(cpu_devices[:3], (1.0, 10.0, 100.0), strict=True):
        with tf.device(d):
            per_device.append(tf.constant([value]))
    value = values_lib.PerReplica(per_device)
    total = ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(value, value)])[0]
    assert [float(v.numpy()[0]) for v in total.values] != [111.0] * 3


def test_hierarchical_copy_on_an_odd_device_count_is_refused_in_one_line(cpu_devices):
    with pytest.raises(ConfigError, match=r"^cross_device_reduction: hierarchical_copy needs an even number "
                                          r"of devices \(TensorFlow's implementation drops the last of 3\)") as e:
        CrossbowStrategy(devices=cpu_devices[:3], cross_device_reduction="hierarchical_copy")
    assert "\n" not in str(e.value)
    from baselines.tf_ssgd import make_strategy
    with pytest.raises(ConfigError, match="hierarchical_copy needs an even number"):
        make_strategy(cpu_devices[:3], "hierarchical_copy")
    assert reduction_problem("hierarchical_copy", 1) is None and reduction_problem("hierarchical_copy", 8) is None
