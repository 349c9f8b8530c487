"""Auto-tuning learners per device: Crossbow's decision rule, the real measurement, config and CLI."""
import json
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf import config as config_lib
from crossbow_tf.algorithms import SMA
from crossbow_tf.data import from_arrays, load_embedded_mnist
from crossbow_tf.engine import core
from crossbow_tf.engine.autotune import DoesNotFit, autotune_learners, choose_learners, measure_throughput
from crossbow_tf.errors import ConfigError
from crossbow_tf.run import main

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Curve:
    """A synthetic throughput curve that records which m were measured, in order."""

    def __init__(self, values):
        self.values = values
        self.measured = []

    def __call__(self, m):
        self.measured.append(m)
        value = self.values[m]
        if isinstance(value, BaseException):
            raise value
        return value


# ---------------------------------------------------------------------------- the decision rule

@pytest.mark.parametrize("values, chosen", [
    ({1: 100, 2: 150, 3: 200, 4: 210, 5: 400}, 3),     # rising, then flat: 4 gains only 5%
    ({1: 100, 2: 80, 3: 400}, 1),                      # more learners are slower at once
    ({1: 100, 2: 120, 3: 130, 4: 400}, 2),             # 3 gains 30% over m=1 but only 8% over m=2
    ({1: 100, 2: 111, 3: 110, 4: 400}, 2),             # just above the threshold, then a dip
])
def test_stops_where_the_gain_falls_to_the_threshold_and_measures_no_further(values, chosen):
    curve = Curve(values)
    result = choose_learners(curve, threshold=0.10, max_learners=16)
    assert result.chosen == chosen
    assert curve.measured == list(range(1, chosen + 2))   # incremental, one past the choice, no more
    assert result.curve == {m: float(values[m]) for m in curve.measured}
    assert f"m={chosen + 1} gained" in result.stopped


@pytest.mark.parametrize("before, after", [(100, 110), (30, 33), (160, 176), (2000, 2200), (7, 7.7)])
def test_a_gain_of_exactly_the_threshold_is_not_more_than_it(before, after):
    # 33/30 - 1 is 0.10000000000000009 in floating point: it must still count as exactly 10%.
    curve = Curve({1: before, 2: after, 3: after * 10})
    assert choose_learners(curve, threshold=0.10).chosen == 1
    assert curve.measured == [1, 2]
    just_above = Curve({1: before, 2: after * 1.001, 3: after * 1.001})
    assert choose_learners(just_above, threshold=0.10).chosen == 2


def test_keeps_adding_while_it_pays_up_to_the_maximum():
    curve = Curve({m: 100.0 * m for m in range(1, 20)})
    result = choose_learners(curve, threshold=0.10, max_learners=6)
    assert result.chosen == 6
    assert curve.measured == [1, 2, 3, 4, 5, 6]
    assert "maximum of 6" in result.stopped


def test_maximum_of_one_measures_only_one():
    curve = Curve({1: 100, 2: 1000})
    assert choose_learners(curve, max_learners=1).chosen == 1
    assert curve.measured == [1]


@pytest.mark.parametrize("error", [tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"),
                                   DoesNotFit("too big"), MemoryError()],
                         ids=["tf_resource_exhausted", "does_not_fit", "memory_error"])
def test_out_of_memory_keeps_the_last_m_that_fitted(error):
    curve = Curve({1: 100, 2: 200, 3: 300, 4: error, 5: 500})
    result = choose_learners(curve, threshold=0.10)
    assert result.chosen == 3
    assert curve.measured == [1, 2, 3, 4]
    assert result.curve == {1: 100.0, 2: 200.0, 3: 300.0, 4: None}
    assert "does not fit" in result.stopped and "out of memory" in result.summary()


def test_one_learner_that_does_not_fit_is_an_error():
    with pytest.raises(DoesNotFit, match="one learner per device does not fit"):
        choose_learners(Curve({1: tf.errors.ResourceExhaustedError(None, None, "OOM")}))


def test_other_errors_are_not_mistaken_for_out_of_memory():
    with pytest.raises(ZeroDivisionError):
        choose_learners(Curve({1: 100, 2: ZeroDivisionError()}))


def test_threshold_zero_adds_a_learner_for_any_gain():
    curve = Curve({1: 100, 2: 100.5, 3: 100.5, 4: 999})
    assert choose_learners(curve, threshold=0.0).chosen == 2
    assert curve.measured == [1, 2, 3]


@pytest.mark.parametrize("bad", [0, -5.0, float("nan"), float("inf")])
def test_a_measurement_that_is_not_a_positive_rate_is_refused(bad):
    with pytest.raises(ValueError, match="m=2 must be a positive number of images/s"):
        choose_learners(Curve({1: 100, 2: bad}))


def test_summary_and_record_show_the_curve_and_choice():
    result = choose_learners(Curve({1: 1000, 2: 1500, 3: 1550}), threshold=0.10)
    line = result.summary()
    assert "chose m=2" in line and "m=1: 1000" in line and "m=2: 1500 (+50%)" in line and "m=3: 1550 (+3%)" in line
    record = json.loads(json.dumps(result.to_dict()))
    assert record["chosen"] == 2 and record["threshold"] == 0.10
    assert record["curve"] == {"1": 1000.0, "2": 1500.0, "3": 1550.0}


# ---------------------------------------------------------------------------- real measurement

def _tiny_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 5, activation="relu"),
                             keras.layers.MaxPooling2D(4), keras.layers.Flatten(), keras.layers.Dense(10)])


@pytest.fixture(scope="module")
def small_mnist():
    (x, y), (xt, yt) = load_embedded_mnist()
    return from_arrays("mnist", (x[:512], y[:512]), (xt[:64], yt[:64]), num_classes=10)


def test_real_measurement_records_a_positive_curve_and_leaves_the_model_alone(small_mnist, cpu_devices,
                                                                               monkeypatch):
    model = _tiny_model()
    before = [w.copy() for w in model.get_weights()]
    engine_kwargs = []
    real_engine = core.Engine

    def recording_engine(*args, **kwargs):
        engine_kwargs.append(kwargs)
        return real_engine(*args, **kwargs)
    monkeypatch.setattr(core, "Engine", recording_engine)
    random.seed(42)
    np.random.seed(42)
    py_state, np_state = random.getstate(), np.random.get_state()

    result = autotune_learners(model, LOSS, SMA(), cpu_devices[:2], small_mnist.train, 8, threshold=0.10,
                               max_learners=3, warmup_iterations=1, measure_iterations=3, jit_compile=False)

    assert 1 <= result.chosen <= 3
    measured = sorted(result.curve)
    assert measured[0] == 1 and measured == list(range(1, len(measured) + 1))
    assert all(result.curve[m] > 0 for m in measured)
    # The recorded curve, fed back to the rule, gives the same answer: the choice came from it.
    assert choose_learners(lambda m: result.curve[m], 0.10, 3).chosen == result.chosen
    assert result.seconds > 0 and str(result.chosen) in result.summary()
    assert [kw.get("jit_compile") for kw in engine_kwargs] == [False] * len(measured)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    assert random.getstate() == py_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), np_state))


def test_out_of_memory_during_measurement_keeps_the_smaller_m(small_mnist, cpu_devices, monkeypatch):
    real_engine = core.Engine

    def engine_with_little_memory(model, loss, algorithm, strategy, **kwargs):
        if strategy.learners_per_device > 1:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape [2,1024]")
        return real_engine(model, loss, algorithm, strategy, **kwargs)
    monkeypatch.setattr(core, "Engine", engine_with_little_memory)
    result = autotune_learners(_tiny_model, LOSS, SMA(), cpu_devices[:1], small_mnist.train, 8,
                               max_learners=4, warmup_iterations=1, measure_iterations=2)
    assert result.chosen == 1 and result.curve[1] > 0 and result.curve[2] is None
    with pytest.raises(DoesNotFit, match="2 learners per device: OOM"):
        measure_throughput(_tiny_model, LOSS, SMA(), cpu_devices[:1], small_mnist.train, 8, 2)


def test_measurement_needs_an_untimed_warm_up(small_mnist, cpu_devices):
    with pytest.raises(ValueError, match="first iteration traces"):
        measure_throughput(_tiny_model, LOSS, SMA(), cpu_devices[:1], small_mnist.train, 8, 1,
                           warmup_iterations=0)


def test_auto_run_equals_the_run_with_the_chosen_m(cpu_devices, tmp_path):
    """Tuning draws random numbers; the run must still start from the seed's weights. (On 640 real
    digits, 160 to test.)"""
    from crossbow_tf.experiment import run_experiment
    from test_checkpoint import tiny_mnist
    base = dict(model="lenet", data={"name": "mnist", "data_dir": tiny_mnist(tmp_path / "mnist")},
                learners_per_device="auto", batch_size=16, epochs=1, seed=3,
                autotune=dict(max_learners_per_device=2, warmup_iterations=1, measure_iterations=3),
                learning_rate=dict(base=0.02))
    lines = []
    tuned = run_experiment(config_lib.from_dict(base), log=lines.append)
    record = tuned.extra["autotune"]
    chosen = record["chosen"]
    assert chosen in (1, 2) and tuned.extra["num_learners"] == chosen   # one device: no logical_cpu
    assert all(record["curve"][str(m)] > 0 for m in range(1, chosen + 1))
    assert record["threshold"] == 0.10 and record["max_learners_per_device"] == 2
    assert any(line.startswith(f"auto-tuned learners per device: chose m={chosen}") for line in lines)
    fixed = run_experiment(config_lib.from_dict(dict(base, learners_per_device=chosen)), log=lambda *a: None)
    assert "autotune" not in fixed.extra
    for a, b in zip(tuned.evaluations, fixed.evaluations):
        assert (a["accuracy"], a["loss"], a["train_loss"]) == (b["accuracy"], b["loss"], b["train_loss"])


# ---------------------------------------------------------------------------- configuration

def test_config_accepts_auto_and_positive_integers():
    assert config_lib.from_dict({"learners_per_device": "auto"}).learners_per_device == "auto"
    assert config_lib.from_dict({"learners_per_device": 3}).learners_per_device == 3
    tuned = config_lib.from_dict({"autotune": {"threshold": 0.05, "max_learners_per_device": 4}}).autotune
    assert (tuned.threshold, tuned.max_learners_per_device) == (0.05, 4)


@pytest.mark.parametrize("mapping, message", [
    ({"learners_per_device": "automatic"}, "learners_per_device: must be a positive integer or \"auto\", got 'automatic'"),
    ({"learners_per_device": 0}, "learners_per_device: must be a positive integer or \"auto\", got 0"),
    ({"learners_per_device": 2.5}, "learners_per_device: expected int or str, got 2.5"),
    ({"autotune": {"threshold": 10}}, "autotune.threshold: must be a fraction in [0, 1)"),
    ({"autotune": {"max_learners_per_device": 0}}, "autotune.max_learners_per_device: must be at least 1"),
    ({"autotune": {"warmup_iterations": 0}}, "autotune.warmup_iterations: must be at least 1"),
    ({"autotune": {"measure_iterations": 0}}, "autotune.measure_iterations: must be at least 1"),
    ({"autotune": {"patience": 3}}, "autotune.patience: unknown key"),
])
def test_config_rejects_bad_learners_and_tuning_settings(mapping, message):
    with pytest.raises(ConfigError) as error:
        config_lib.from_dict(mapping)
    assert message in str(error.value)


@pytest.mark.parametrize("value", ["automatic", "0", "-1"])
def test_cli_rejects_bad_learners_in_one_line(capsys, value):
    assert main(["--learners-per-device", value]) == 2
    err = capsys.readouterr().err.strip()
    assert "command line: learners_per_device: must be a positive integer or \"auto\"" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_accepts_auto_and_numbers():
    from crossbow_tf.run import build_config, parse_args
    assert build_config(parse_args(["--learners-per-device", "auto"])).learners_per_device == "auto"
    assert build_config(parse_args(["--learners-per-device", "3"])).learners_per_device == 3

