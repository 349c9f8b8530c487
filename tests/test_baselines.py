"""The baselines: registry, stock TensorFlow S-SGD without crossbow engine code, same data order and
schedule as crossbow's runs, and clear errors."""
import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from baselines import BASELINES, METHODS
from crossbow_tf.results import EVALUATION_KEYS, format_problems

from forking import PYTHON, forked_runs  # noqa: F401  (forked_runs: a fixture)

pytestmark = pytest.mark.usefixtures("forked_runs")   # TensorFlow imported once (tests/forking.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED_CROSSBOW = ("crossbow_tf.config", "crossbow_tf.data", "crossbow_tf.models", "crossbow_tf.results",
                    "crossbow_tf.errors", "crossbow_tf.cli", "crossbow_tf.files",   # cli, files: argument and output helpers
                    "crossbow_tf.tensorboard",   # --tensorboard: tf.summary of the evaluations
                    "crossbow_tf.device_choice",   # the devices a run trains on, as the engine's runs choose them
                    "crossbow_tf.training_hooks",   # the table of a model's own logic, as both sides read it
                "crossbow_tf.algorithms.contract")   # the rules' registry: the engine methods' names
# The rule registry and the rules' classes, which the configuration constructs to validate the
# algorithm: section. Pure arithmetic, no TensorFlow and no engine (test_the_rule_registry_is_pure):
# the stock baseline loads them with its configuration and never calls them.
RULE_REGISTRY = ("crossbow_tf.algorithms", "crossbow_tf.algorithms.contract", "crossbow_tf.algorithms.rules")
ENGINE_PARTS = ("crossbow_tf.engine", "crossbow_tf.distribute", "crossbow_tf.algorithms", "crossbow_tf.keras",
                "crossbow_tf.experiment")


def test_registry_names_runnable_modules():
    assert set(BASELINES) == {"tf_ssgd", "crossbow_ssgd", "easgd", "localsgd"}
    assert set(METHODS) == set(BASELINES) | {"sma"}
    for m in METHODS.values():
        assert importlib.util.find_spec(m.module) is not None, m.module
    assert not METHODS["tf_ssgd"].engine and all(METHODS[n].engine for n in ("sma", "crossbow_ssgd", "easgd", "localsgd"))


def _imports(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):   # "from crossbow_tf import config" imports crossbow_tf.config
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_tf_ssgd_source_imports_no_crossbow_engine_code():
    # tf_ssgd and everything of baselines/ it imports (the package and its command-line helper).
    for name in ("tf_ssgd.py", "_cli.py", "__init__.py"):
        for module in _imports(os.path.join(REPO, "baselines", name)):
            if module.startswith("crossbow_tf"):
                assert module.startswith(ALLOWED_CROSSBOW), f"baselines/{name} imports {module}"


def test_the_rule_registry_is_pure():
    """What the stock baseline loads of crossbow_tf.algorithms imports nothing but the standard
    library and crossbow's TensorFlow-free arithmetic: no TensorFlow, Keras, NumPy or engine."""
    pure = ("crossbow_tf.algorithms", "crossbow_tf.stability")
    for module in RULE_REGISTRY:
        path = module.replace(".", os.sep) + (os.sep + "__init__.py" if module == "crossbow_tf.algorithms" else ".py")
        imported = list(_imports(os.path.join(REPO, path)))
        assert imported, path
        for name in imported:
            if name.startswith("crossbow_tf"):
                assert name.startswith(pure), f"{path} imports {name}"
            else:
                assert name.split(".")[0] in ("dataclasses", "math", "numbers", "typing"), f"{path} imports {name}"


def write(path, doc):
    with open(path, "w") as f:
        yaml.safe_dump(doc, f)
    return str(path)


def experiment(**changes):
    doc = dict(name="t", model="lenet", data={"name": "mnist_embedded"}, batch_size=32,
               learning_rate={"base": 0.05}, epochs=1, target_accuracy=0.5, seed=3)
    doc.update(changes)
    return doc


def test_tf_ssgd_mirrored_run_has_no_engine_code_in_its_process(tmp_path):
    """A real run over 2 logical CPU devices: MirroredStrategy, Keras's own train step, the stock SGD,
    and not one module of crossbow's engine, strategy or algorithms loaded in the process."""
    cfg = write(tmp_path / "c.yaml", dict(experiment(devices={"logical_cpu": 2}), tf_ssgd={"input": "per_epoch"}))
    results = tmp_path / "r.json"
    proc = subprocess.run([PYTHON, "-m", "baselines.tf_ssgd", "--config", cfg, "--results", str(results)],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "MirroredStrategy over 2 devices" in proc.stdout
    assert "epoch   1/1  test accuracy" in proc.stdout          # the per-epoch line crossbow_tf.run prints
    d = json.loads(results.read_text())
    assert format_problems(d) == []
    [e] = d["evaluations"]
    assert all(k in e for k in EVALUATION_KEYS)
    assert e["examples"] == 4000 and e["iteration"] == 63          # ceil(4000 / (32 x 2)) steps, none padded
    assert e["wall_time"] > 0 and e["epoch_start_time"] >= 0 and e["accuracy"] > 0.5
    assert d["method"] == "tf_ssgd" and d["strategy"] == "MirroredStrategy"
    assert d["num_learners"] == 2 and d["global_batch"] == 64 and len(d["devices"]) == 2
    assert d["train_step"].startswith("keras.") and d["optimizer"] == "keras.src.optimizers.sgd.SGD"
    loaded = d["crossbow_modules"]
    assert "crossbow_tf.data" in loaded and "crossbow_tf.models" in loaded   # the list is real
    assert not [m for m in loaded if m.startswith(ENGINE_PARTS) and m not in RULE_REGISTRY], loaded
    assert "crossbow_tf.algorithms.rules" in loaded   # the exemption is the registry, loaded with the config
    assert d["trace_time"] >= 0 and d["total_time"] >= e["wall_time"]


def test_tf_ssgd_epochs_follow_crossbow_data_order():
    import keras

    from baselines.tf_ssgd import epoch_batches, training_dataset
    from crossbow_tf.data import load_dataset
    from crossbow_tf.data.pipeline import train_batches
    data = load_dataset("mnist_embedded")
    seed, batch = 5, 96
    keras.utils.set_random_seed(seed)   # as both runners do before building their data sets

    def engine_order(epoch):
        return np.concatenate([y.numpy()[m.numpy() > 0]
                               for _, y, m in train_batches(data.train, batch, epoch, seed=seed)])
    expected = {e: engine_order(e) for e in (1, 2, 3)}
    assert not np.array_equal(expected[1], expected[2])            # epochs really differ
    sizes = [int(y.shape[0]) for _, y in epoch_batches(data, batch, 1, seed)]
    assert sizes == [batch] * 41 + [4000 - 41 * batch]             # a short last batch, no padding
    ds, epoch_var, steps = training_dataset(data, batch, 3, seed, "per_epoch")
    assert steps is None and int(ds.cardinality()) == 42
    for epoch in (2, 1, 3):                                         # what the callback sets at epoch begin
        epoch_var.assign(epoch - 1)
        got = np.concatenate([y.numpy() for _, y in ds])
        np.testing.assert_array_equal(got, expected[epoch])
    ds, epoch_var, steps = training_dataset(data, batch, 3, seed, "repeat")
    assert epoch_var is None and steps == 42
    np.testing.assert_array_equal(np.concatenate([y.numpy() for _, y in ds]),
                                  np.concatenate([expected[e] for e in (1, 2, 3)]))


def test_learning_rate_schedule_matches_crossbow_and_goyal():
    from baselines._cli import parse_tf_ssgd_options
    from baselines.tf_ssgd import make_schedule
    from crossbow_tf.config import from_dict
    from crossbow_tf.engine.schedule import StepSchedule
    cfg = from_dict(dict(batch_size=32, learning_rate={"base": 0.1, "drops_at_epochs": [2, 3], "drop_factor": 0.5,
                                                       "warmup_epochs": 1.0}))
    per_epoch = 10
    plain, scale = make_schedule(cfg, parse_tf_ssgd_options({}), 32, per_epoch)
    crossbow = StepSchedule.from_epochs(0.1, [2, 3], 0.5, 1.0, per_epoch)
    assert scale == 1.0
    for t in range(40):
        assert plain.value(t) == pytest.approx(crossbow(t))
        assert float(plain(t)) == pytest.approx(crossbow(t), rel=1e-6)   # the tensor the optimizer uses
    # Linear scaling: by default warm-up means what it means in the engine, a ramp from ~0 to the peak.
    scaled, scale = make_schedule(cfg, parse_tf_ssgd_options({"lr_scaling": "linear", "reference_batch": 32}),
                                  128, per_epoch)
    crossbow_scaled = StepSchedule.from_epochs(0.4, [2, 3], 0.5, 1.0, per_epoch)
    assert scale == 4.0
    for t in range(40):
        assert scaled.value(t) == pytest.approx(crossbow_scaled(t))
    # Goyal et al.'s gradual warm-up (warmup_from: unscaled): x4, ramping from the base rate.
    goyal, scale = make_schedule(cfg, parse_tf_ssgd_options({"lr_scaling": "linear", "reference_batch": 32,
                                                             "warmup_from": "unscaled"}), 128, per_epoch)
    assert scale == 4.0
    assert goyal.value(0) == pytest.approx(0.1 + 0.3 / per_epoch)
    assert goyal.value(per_epoch - 1) == pytest.approx(0.4) and goyal.value(per_epoch) == pytest.approx(0.4)
    assert goyal.value(2 * per_epoch) == pytest.approx(0.2) and float(goyal(35)) == pytest.approx(0.1)


@pytest.mark.parametrize("module", ["tf_ssgd", "crossbow_ssgd", "easgd"])
def test_baseline_errors_are_one_line_and_write_nothing(tmp_path, capsys, module):
    main = importlib.import_module(f"baselines.{module}").main
    results = tmp_path / "r.json"
    bad = write(tmp_path / "bad.yaml", experiment(batch_size=0))
    assert main(["--config", bad, "--results", str(results)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"python -m baselines.{module}: error:") and "batch_size" in err
    assert len(err.splitlines()) == 1 and not results.exists()
    results.write_text("keep")
    good = write(tmp_path / "good.yaml", experiment())
    assert main(["--config", good, "--results", str(results)]) == 2
    assert "results file exists" in capsys.readouterr().err and results.read_text() == "keep"


def test_tf_ssgd_option_errors(tmp_path, capsys):
    from baselines.tf_ssgd import main
    for section, message in (({"input": "stream"}, "tf_ssgd.input"), ({"lr_scaling": "sqrt"}, "tf_ssgd.lr_scaling"),
                             ({"reference_batch": 0}, "tf_ssgd.reference_batch"), ({"speed": 1}, "unknown key")):
        cfg = write(tmp_path / "c.yaml", dict(experiment(), tf_ssgd=section))
        assert main(["--config", cfg]) == 2
        assert message in capsys.readouterr().err
    cfg = write(tmp_path / "c.yaml", dict(experiment(), tf_ssgd=["not", "a", "mapping"]))
    assert main(["--config", cfg]) == 2
    assert "tf_ssgd: expected a mapping" in capsys.readouterr().err

