"""Keras dtype policies: the fused learners compute what the replicated ones (Keras's own
stateless_call) compute under mixed_bfloat16 and mixed_float16, in the lower precision, while the
learners' weights, velocities, z and u stay float32; the precision key of the run, the baselines
and the harness; mixed_float16 (with loss scaling, tests/test_loss_scaling.py) refused only across
several workers."""
import contextlib
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from crossbow_tf.algorithms import SMA
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.fused import FusedLearners
from crossbow_tf.engine.replicated import ReplicatedLearners

from forking import PYTHON, forked_runs  # noqa: F401  (forked_runs: a fixture)

pytestmark = pytest.mark.usefixtures("forked_runs")   # TensorFlow imported once (tests/forking.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SHAPE, CLASSES = (12, 12, 3), 5


@pytest.fixture(autouse=True)
def float32_after_each_test():
    """Keras's global policy is process-wide: every test leaves it as the other tests expect it."""
    yield
    keras.mixed_precision.set_global_policy("float32")


@contextlib.contextmanager
def global_policy(name):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def small_cnn():
    """Convolution, BatchNorm, Dropout and dense layers; the last layer float32, as Keras's
    mixed-precision guide recommends."""
    inputs = keras.Input(SHAPE)
    x = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    pooled = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Concatenate()([pooled, keras.layers.Dense(4, activation="tanh")(keras.layers.Flatten()(x))])
    x = keras.layers.Dense(16, activation="relu")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.4)(x)
    x = keras.layers.Dense(CLASSES)(x)
    return keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(x))


def train(policy, learners, devices, lr, steps):
    with global_policy(policy):
        keras.utils.set_random_seed(0)
        model = small_cnn()
    engine = Engine(model, LOSS, SMA(), CrossbowStrategy(devices=devices, learners_per_device=2), learners=learners)
    rng = np.random.default_rng(0)
    kb = engine.num_learners * 8
    for _ in range(steps):
        loss, preds = engine.train_step(rng.random((kb,) + SHAPE, dtype=np.float32),
                                        rng.integers(0, CLASSES, kb).astype(np.int32), None, lr)
    return engine


def distance(a, b):
    """Largest difference of two lists of arrays, relative to the largest magnitude in A."""
    return max(np.abs(x - y).max() for x, y in zip(a, b)) / max(np.abs(x).max() for x in a)


def every_learner(engine):
    return [w for learner in engine.learner_weights() for w in learner]


# Relative rounding unit of each compute dtype (2^-8 for bfloat16's 8 significand bits, 2^-11 for float16).
ROUNDING = {"mixed_bfloat16": 2.0 ** -8, "mixed_float16": 2.0 ** -11}


# A small rate and few steps: BatchNorm over 8 examples amplifies the rounding differences of two
# correct computations step by step (tests/test_fused.py), the more so in low precision; and with no
# loss scaling yet, nothing may overflow float16.
RATE, STEPS = 0.01, 2


# One device of 2 learners: the policies act inside each learner's step, which a second device
# would only trace again (half these tests' CPU); float32 sums across devices: tests/test_fused.py.
@pytest.fixture(scope="module")
def float32_runs():
    from tests.conftest import DEVICES
    return {("float32", learners): train("float32", learners, DEVICES[:1], RATE, STEPS)
            for learners in ("fused", "replicated")}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_fused_equals_replicated_and_computes_in_the_policy(cpu_devices, float32_runs, policy):
    runs = {**float32_runs, **{(policy, learners): train(policy, learners, cpu_devices[:1], RATE, STEPS)
                               for learners in ("fused", "replicated")}}
    fused, replicated = runs[policy, "fused"], runs[policy, "replicated"]
    assert isinstance(fused.learner_computation, FusedLearners) and isinstance(replicated.learner_computation, ReplicatedLearners)
    # The layers compute in the policy's dtype; every variable of the engine is float32.
    assert {layer.compute_dtype for layer in fused.model.layers[1:-1]} == {policy.split("_")[1]}
    for engine in (fused, replicated):
        assert len(engine.center) == 1
        stacks = [v for d in range(len(engine.center)) for v in engine.center[d] + engine.center_velocity[d] + engine.weights[d]
                  + engine.velocities[d]]
        assert stacks and {v.dtype.name for v in stacks} == {"float32"}
    z_apart = distance(fused.center_weights(), replicated.center_weights())
    learners_apart = distance(every_learner(fused), every_learner(replicated))
    assert z_apart <= ROUNDING[policy] and learners_apart <= 2 * ROUNDING[policy]
    states = {learners: [s.numpy() for d in runs[policy, learners].states for s in d if s.dtype.is_floating]
              for learners in ("fused", "replicated")}
    assert distance(states["fused"], states["replicated"]) <= ROUNDING[policy]
    # Each is much further from its own float32 run (fused and replicated agree to 1e-5 under
    # float32, tests/test_fused.py): both really compute in the lower precision.
    for learners in ("fused", "replicated"):
        low, full = runs[policy, learners], runs["float32", learners]
        from_float32 = distance(low.center_weights(), full.center_weights())
        assert from_float32 > max(10 * z_apart, ROUNDING[policy])
        assert distance(every_learner(low), every_learner(full)) > 10 * learners_apart


@pytest.fixture(scope="module")
def replicated_bfloat16():
    from tests.conftest import DEVICES
    return train("mixed_bfloat16", "replicated", DEVICES[:1], RATE, STEPS)


# The forms a CPU without AVX-512 takes (crossbow_tf/engine/conv_forms.py), forced here whatever this CPU
# is: the fused learners with each form compute what Keras's own layers compute per learner (issue 43).
# (Under float32: per-learner, the Eigen kernels' form, against replicated learners in tests/test_fused.py's
# oneDNN-off run; every form against float64 per learner in tests/test_conv_forms.py.)
@pytest.mark.parametrize("form", ["grouped-float32", "per-learner", "patches"])
def test_each_convolution_form_trains_as_the_replicated_learners(cpu_devices, replicated_bfloat16, form):
    from crossbow_tf.engine import conv_forms
    with conv_forms.forcing(form):
        fused = train("mixed_bfloat16", "fused", cpu_devices[:1], RATE, STEPS)
    assert set(fused.learner_computation.conv_forms) == {"bfloat16"}
    assert {chosen for chosen, _ in fused.learner_computation.conv_forms.values()} == {form}
    bound = ROUNDING["mixed_bfloat16"]
    assert distance(fused.center_weights(), replicated_bfloat16.center_weights()) <= bound
    assert distance(every_learner(fused), every_learner(replicated_bfloat16)) <= 2 * bound


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_one_learner_call_returns_float32_gradients_and_loss(policy):
    """The gradients that reach the update are float32 (the variable dtype), the loss is computed in
    float32, and the fused outputs of a layer that computes in the policy's dtype are in it."""
    with global_policy(policy):
        keras.utils.set_random_seed(1)
        inputs = keras.Input(SHAPE)
        x = keras.layers.Flatten()(keras.layers.Conv2D(4, 3, activation="relu")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(x))   # no float32 layer: outputs in the policy
    m, b = 2, 4
    weights = [np.stack([v.numpy()] * m) for v in model.trainable_variables]
    from crossbow_tf.engine import conv_forms
    # The fused convolution in the policy's own dtype, as the replicated learners compute it: where the
    # grouped one does not compute (float16 on a CPU), the probe's choice computes it in float32, which
    # test_each_convolution_form_trains_as_the_replicated_learners compares in its own right.
    chosen = conv_forms.choose(policy.split("_")[1], "CPU")[0]
    form = conv_forms.PER_LEARNER if chosen == conv_forms.GROUPED_FLOAT32 else chosen
    rng = np.random.default_rng(0)
    x = rng.random((m, b) + SHAPE, dtype=np.float32)
    y = rng.integers(0, CLASSES, (m, b)).astype(np.int32)
    mask = np.ones((m, b), np.float32)
    outputs = {}
    for cls in (FusedLearners, ReplicatedLearners):
        with conv_forms.forcing(form):
            learners = cls(model, LOSS)
        losses, grads, _, preds = learners([tf.constant(w) for w in weights], [], tf.constant(x), tf.constant(y),
                                           tf.constant(mask))
        assert losses.dtype == tf.float32 and {g.dtype for g in grads} == {tf.float32}
        assert preds.dtype.name == policy.split("_")[1]
        outputs[cls] = (losses.numpy(), [g.numpy() for g in grads], preds.numpy().astype(np.float32))
    (loss_f, grads_f, preds_f), (loss_r, grads_r, preds_r) = outputs.values()
    np.testing.assert_allclose(preds_f, preds_r, rtol=2 * ROUNDING[policy], atol=2 * ROUNDING[policy])
    np.testing.assert_allclose(loss_f, loss_r, rtol=2 * ROUNDING[policy])
    assert distance(grads_r, grads_f) <= 4 * ROUNDING[policy]
    # A float32 computation on the same weights gives other predictions: the layers ran in low precision.
    with global_policy("float32"):
        keras.utils.set_random_seed(1)
        inputs = keras.Input(SHAPE)
        h = keras.layers.Flatten()(keras.layers.Conv2D(4, 3, activation="relu")(inputs))
        model32 = keras.Model(inputs, keras.layers.Dense(CLASSES)(h))
    float32_preds = np.stack([np.asarray(model32.stateless_call([tf.constant(w[i]) for w in weights], [], x[i])[0])
                              for i in range(m)])
    assert np.abs(preds_f - float32_preds).max() > 10 * np.abs(preds_f - preds_r).max() + 1e-6


def write(path, doc):
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def experiment(**changes):
    return dict(dict(name="mp", model="lenet", data={"name": "mnist_embedded"}, devices={"logical_cpu": 2},
                     learners_per_device=2, batch_size=16, learning_rate={"base": 0.05}, epochs=1, seed=0), **changes)


def tiny_model(folder):
    """A user's model file in FOLDER (a convolution and a dense layer), as the config's model key names it."""
    (folder / "tiny.py").write_text(
        "import keras\n"
        "def build(input_shape, num_classes):\n"
        "    return keras.Sequential([keras.Input(input_shape),\n"
        "                             keras.layers.Conv2D(8, 5, strides=2, activation='relu'),\n"
        "                             keras.layers.Flatten(), keras.layers.Dense(num_classes)])\n")
    return f"{folder / 'tiny.py'}:build"


def test_the_cli_trains_under_mixed_bfloat16_and_records_it(tmp_path, capsys):
    # The command's main in this process (a process of its own costs 6 CPU s to import TensorFlow):
    # on one of the session's devices with the 4 learners the 2 x 2 of experiment() would have.
    # A small convnet: what is recorded and that it learns do not need LeNet's size.
    from crossbow_tf.run import main as run
    results = tmp_path / "r.json"
    config = write(tmp_path / "c.yaml", experiment(devices={}, learners_per_device=4, model=tiny_model(tmp_path)))
    code = run(["--config", config, "--precision", "mixed_bfloat16", "--results", str(results)])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    d = json.loads(results.read_text())
    assert d["config"]["precision"] == "mixed_bfloat16" and ", precision mixed_bfloat16" in out.out
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"   # set for the run, as a user's script
    assert d["evaluations"][-1]["accuracy"] > 0.85   # float32: 0.879 after this one epoch of the small convnet


@pytest.mark.parametrize("policy, optimizer", [("mixed_bfloat16", "SGD"), ("mixed_float16", "LossScaleOptimizer")])
def test_tf_ssgd_runs_as_a_keras_user_runs_it(tmp_path, capsys, policy, optimizer):
    """The stock baseline sets the same global policy; under mixed_float16 Keras's compile wraps its
    SGD in Keras's own LossScaleOptimizer."""
    from baselines.tf_ssgd import main
    results = tmp_path / "r.json"
    # A small model: float16 kernels on a CPU are slow.
    cfg = write(tmp_path / "c.yaml", experiment(devices={}, batch_size=64, model=tiny_model(tmp_path)))
    assert main(["--config", cfg, "--precision", policy, "--results", str(results)]) == 0
    d = json.loads(results.read_text())
    assert d["config"]["precision"] == policy and d["compiled_optimizer"].endswith(f".{optimizer}")
    assert f", precision {policy} ({optimizer})" in capsys.readouterr().out
    assert d["evaluations"][-1]["accuracy"] > 0.8


def test_mixed_float16_passes_for_engine_methods_and_is_refused_across_workers_in_one_line(
        tmp_path, capsys, monkeypatch):
    from crossbow_tf.run import main as run
    cfg = write(tmp_path / "c.yaml", experiment())
    assert run(["--config", cfg, "--precision", "mixed_float16", "--check"]) == 0
    capsys.readouterr()
    # Across the workers of a TF_CONFIG, a rule that synchronises every iteration carries every
    # worker's overflow flag in its all-reduce; a periodic rule (local steps: no all-reduce) is refused
    # before any training.
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                                                "task": {"type": "worker", "index": 0}}))
    assert run(["--config", cfg, "--precision", "mixed_float16", "--check"]) == 0
    capsys.readouterr()
    periodic = write(tmp_path / "periodic.yaml", experiment(algorithm={"name": "sma", "sync_period": 4}))
    for args in (["--check"], []):
        assert run(["--config", periodic, "--precision", "mixed_float16", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("crossbow_tf: error:"), err
        assert "mixed_float16 (loss scaling) across several workers needs a rule that synchronises every" in err
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(SystemExit) as stop:
        run(["--config", cfg, "--precision", "float8"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "--precision: invalid choice: 'float8'" in err
    bad = write(tmp_path / "bad.yaml", experiment(precision="bfloat16"))
    assert run(["--config", bad]) == 2 and "precision: unknown 'bfloat16'" in capsys.readouterr().err
    # The harness: a key like any other (fixed or in a grid), for the engine's methods too.
    doc = dict(experiment(target_accuracy=0.9), compare=dict(budget=2, seeds=[0], methods={
        "tf_half": {"method": "tf_ssgd", "fixed": {"precision": "mixed_float16"}},
        "sma": {"grid": {"precision": ["float32", "mixed_bfloat16", "mixed_float16"]}}}))
    planned = subprocess.run([PYTHON, "tools/compare.py", "--config", write(tmp_path / "compare.yaml", doc),
                              "--out", str(tmp_path / "out"), "--dry-run"], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "precision=mixed_bfloat16" in planned.stdout and "precision=mixed_float16" in planned.stdout


def test_a_checkpoint_from_before_the_key_resumes_as_float32():
    from crossbow_tf import config as config_lib
    from crossbow_tf.engine.checkpoint import trajectory_differences
    current = config_lib.to_dict(config_lib.from_dict({}))
    saved = {k: v for k, v in current.items() if k != "precision"}
    assert trajectory_differences(saved, current) == []
    assert trajectory_differences(saved, dict(current, precision="mixed_bfloat16")) == [
        "precision ('float32' in the checkpoint, 'mixed_bfloat16' now)"]


def fit_digits(policy, devices):
    """A small CNN fitted through use_sma on the embedded digits under POLICY for 3 epochs: (the
    model, its test accuracy)."""
    import crossbow_tf
    (x, y), (x_test, y_test) = crossbow_tf.data.load_embedded_mnist()
    with global_policy(policy):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.MaxPooling2D(2),
            keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dropout(0.2),
            keras.layers.Dense(10), keras.layers.Activation("linear", dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=LOSS, metrics=["accuracy"])
        crossbow_tf.use_sma(model, CrossbowStrategy(devices=devices, learners_per_device=2))
        model.fit(x, y, batch_size=64, epochs=3, verbose=0)
    return model, model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]


@pytest.fixture(scope="module")
def float32_fit():
    """The float32 fit both policies' fits below are held against (run once for the two)."""
    from tests.conftest import DEVICES
    return fit_digits("float32", DEVICES[:2])


def test_fit_under_mixed_bfloat16_reaches_the_accuracy_of_float32(cpu_devices, float32_fit):
    """A Keras fit through use_sma on the embedded digits, float32 against mixed_bfloat16."""
    accuracy = {}
    for policy in ("float32", "mixed_bfloat16"):
        model, accuracy[policy] = float32_fit if policy == "float32" else fit_digits(policy, cpu_devices[:2])
        assert {v.dtype for v in model.weights} == {"float32"}
        assert model.layers[0].compute_dtype == policy.split("_")[-1]
    assert accuracy["float32"] > 0.9
    assert abs(accuracy["mixed_bfloat16"] - accuracy["float32"]) < 0.03, accuracy


def test_fit_under_mixed_float16_through_use_sma_reaches_the_accuracy_of_float32(cpu_devices, float32_fit):
    """Keras's compile wraps the SGD in its LossScaleOptimizer; use_sma takes the rate and momentum
    from the inner SGD and the scale's rules from the wrapper (loss scaling: tests/test_loss_scaling.py)."""
    import crossbow_tf
    accuracy = {}
    for policy in ("float32", "mixed_float16"):
        model, accuracy[policy] = float32_fit if policy == "float32" else fit_digits(policy, cpu_devices[:2])
        engine = getattr(model, crossbow_tf.keras.sma._ATTRIBUTE).engine
        if policy == "mixed_float16":
            assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            assert engine.algorithm.momentum == 0.9 and engine.optimizers is None
            assert 0 < engine.loss_scale.numpy() <= 2.0 ** 15
        else:
            assert engine.loss_scale is None
        assert {v.dtype for v in model.weights if v.dtype.startswith("float")} == {"float32"}
    assert accuracy["float32"] > 0.9
    assert abs(accuracy["mixed_float16"] - accuracy["float32"]) < 0.03, accuracy


def test_bench_throughput_measures_each_policy_side_by_side(cpu_devices, capsys, monkeypatch):
    # The tool's main in this process (a process of its own costs 6 CPU s to import TensorFlow), on
    # the session's first device where its own process would have split the CPU into its 1 device.
    import importlib.util

    from crossbow_tf.distribute import devices
    monkeypatch.setattr(sys, "path", list(sys.path))   # the tool puts tools/ first; undone after the test
    monkeypatch.setattr(devices, "split_cpu", lambda count: cpu_devices[:count])
    spec = importlib.util.spec_from_file_location("bench_throughput", os.path.join(REPO, "tools", "bench_throughput.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    code = bench.main(["--ks", "2", "--rounds", "1", "--examples", "96", "--precision", "float32", "mixed_bfloat16",
                       "--conv-forms", "auto", "per-learner"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    assert keras.mixed_precision.global_policy().name == "float32"   # the tool leaves the policy as it found it
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.out.splitlines()
            if line.startswith("| 2 |")]
    from crossbow_tf.engine import conv_forms
    auto = {p: conv_forms.choose(dtype, "CPU")[0] for p, dtype in (("float32", "float32"),
                                                                   ("mixed_bfloat16", "bfloat16"))}
    assert [(r[0], r[-2], r[-1]) for r in rows[:4]] == [
        ("2", "float32", auto["float32"]), ("2", "float32", "per-learner"),
        ("2", "mixed_bfloat16", auto["mixed_bfloat16"]), ("2", "mixed_bfloat16", "per-learner")]
    assert [(r[0], r[-1]) for r in rows[4:]] == [("2", "mixed_bfloat16 over float32 (auto)"),
                                                 ("2", "mixed_bfloat16 over float32 (per-learner)")]
    assert f"# CPU: {conv_forms.cpu_summary()}; oneDNN on in this process" in out.out
    assert all(float(c) > 0 for r in rows for c in r[2:5])
