"""A user's own model (model: module:function or path/to/file.py:function) and arrays (data: {name:
npz, path: FILE.npz}): what they build and load, against direct calls and NumPy; every bad case is
one line and exit code 2."""
import json
import os
import re
import runpy
import shutil
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from baselines import crossbow_ssgd, tf_ssgd
from crossbow_tf import config as config_lib
from crossbow_tf.data import DATASETS, load_dataset, load_embedded_mnist, npz
from crossbow_tf.data.pipeline import eval_batches
from crossbow_tf.errors import ConfigError, DataError
from crossbow_tf.models import MODELS, build_model, resolve_model
from crossbow_tf.run import main as run_main
from crossbow_tf.user_model import locate_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_MODULE = '''
import keras

NOT_A_FUNCTION = 3


def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(16, activation="relu"), keras.layers.Dense(num_classes)])


def returns_a_list(input_shape, num_classes):
    return [input_shape, num_classes]


def takes_nothing():
    return None
class Doubled(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return 2.0 * super().compute_loss(x, y, y_pred, sample_weight, training)
def own_loss(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return Doubled(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
def its_twin(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
class ShiftedLabels(keras.Model):
    """Its own train_step teaches the next class: a model trained by it is wrong on nearly every example."""
    def train_step(self, data):
        x, y = data
        return super().train_step((x, (y + 1) % 10))
def own_step(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return ShiftedLabels(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
class OwnEvaluation(keras.Model):
    def test_step(self, data):
        return {"accuracy": 7.0, "loss": 7.0}
def own_evaluation(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return OwnEvaluation(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
class OwnFit(keras.Model):
    def fit(self, *args, **kwargs):
        return super().fit(*args, **kwargs)
def own_fit(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return OwnFit(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
'''

USER_FILE = '''
import keras


class Tiny(keras.Model):
    """Subclassed, without an Input: built by crossbow for the data's shape."""

    def __init__(self, num_classes):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.out = keras.layers.Dense(num_classes)

    def call(self, x):
        return self.out(self.flatten(x))


def build(input_shape, num_classes):
    return Tiny(num_classes)
'''


def digits_uint8():
    """The embedded digits as Keras's mnist.load_data() gives them: uint8 (N, 28, 28), integer labels."""
    (x, y), (xt, yt) = load_embedded_mnist()
    to_uint8 = lambda a: np.rint(a[..., 0] * 255).astype(np.uint8)   # noqa: E731 (exact: they were uint8 / 255)
    return dict(x_train=to_uint8(x), y_train=y.astype(np.uint8), x_test=to_uint8(xt), y_test=yt.astype(np.uint8))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A user's folder: a model module, a model file in a subfolder, the digits as an .npz."""
    root = tmp_path_factory.mktemp("user")
    (root / "user_models.py").write_text(USER_MODULE)
    (root / "nets").mkdir()
    (root / "nets" / "tiny.py").write_text(USER_FILE)
    (root / "nets" / "broken.py").write_text("def build(input_shape, num_classes:\n")
    (root / "breaks_on_import.py").write_text("import keras\nraise RuntimeError('no GPU found')\n\n\n"
                                              "def build(input_shape, num_classes):\n    return None\n")
    (root / "needs_a_package.py").write_text("import a_package_not_installed\n")
    np.savez(root / "digits.npz", **digits_uint8())
    return root


@pytest.fixture
def in_folder(folder, monkeypatch):
    monkeypatch.chdir(folder)
    return folder


def write_config(path, **changes):
    doc = dict(name="user", model="user_models:build", data={"name": "npz", "path": "digits.npz"},
               batch_size=32, learning_rate={"base": 0.05}, epochs=1, seed=3)
    doc.update(changes)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def one_error_line(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def weights_of(model):
    return [w.numpy() for w in model.weights]


# --- a user's model -----------------------------------------------------------------------------

@pytest.mark.parametrize("spec, function_name", [("user_models:build", "build"), ("nets/tiny.py:build", "build")])
def test_a_users_model_is_the_model_their_function_builds(in_folder, spec, function_name):
    path_before = list(sys.path)
    factory = resolve_model(spec)
    assert sys.path == path_before   # the current folder is searched, not left on the path
    keras.utils.set_random_seed(7)
    built = build_model(spec, (28, 28, 1), 10)
    keras.utils.set_random_seed(7)
    direct = factory((28, 28, 1), 10)
    direct(np.zeros((1, 28, 28, 1), np.float32))
    assert built.built and isinstance(built, keras.Model)
    assert [w.shape for w in built.weights] == [w.shape for w in direct.weights]
    for a, b in zip(weights_of(built), weights_of(direct)):   # the same seed gives the same weights
        np.testing.assert_array_equal(a, b)
    x = np.random.default_rng(0).random((3, 28, 28, 1), dtype=np.float32)
    assert built(x).shape == (3, 10)


def test_a_users_model_trains_through_the_engine_and_the_stock_baseline(in_folder, capsys):
    """crossbow_tf.run and tf_ssgd train the file's subclassed model on the .npz for one epoch."""
    results = {}
    for name, main in (("sma", run_main), ("tf_ssgd", tf_ssgd.main)):
        cfg = write_config(in_folder / f"{name}.yaml", model="nets/tiny.py:build", learners_per_device=2,
                           target_accuracy=0.5)
        out = in_folder / f"{name}.json"
        assert main(["--config", cfg, "--results", str(out), "--force"]) == 0, capsys.readouterr().err
        results[name] = json.loads(out.read_text())
    for name, r in results.items():
        [e] = r["evaluations"]
        assert e["examples"] == 4000 and e["test_examples"] == 1000
        assert e["accuracy"] > 0.5, name   # a linear model of the digits learns in one epoch
    assert results["sma"]["num_learners"] == 2 and results["sma"]["config"]["model"] == "nets/tiny.py:build"


@pytest.mark.parametrize("spec, message", [
    ("no_such_module:build", "model: no_such_module:build: no module 'no_such_module' in the current folder"),
    ("breaks_on_import:build", "module breaks_on_import does not import (RuntimeError: no GPU found)"),
    ("needs_a_package:build", "module needs_a_package does not import (ModuleNotFoundError: No module named "
                              "'a_package_not_installed')"),
    ("nets/broken.py:build", "nets/broken.py does not import (SyntaxError:"),
    ("nets/absent.py:build", "file nets/absent.py not found"),
    ("user_models:missing", "user_models has no 'missing'"),
    ("user_models:NOT_A_FUNCTION", "NOT_A_FUNCTION is an int, not a function"),
    ("user_models:returns_a_list", "user_models:returns_a_list((28, 28, 1), 10) returned list, not a Keras model"),
    ("user_models:takes_nothing", "user_models:takes_nothing((28, 28, 1), 10) failed (TypeError:"),
    ("lenett", "model: unknown model 'lenett'"),
    ("user_models:", "expected module:function or path/to/file.py:function"),
    # Issue 44: its own fit would be run by tf_ssgd's Keras and dropped by the engine's learners.
    ("user_models:own_fit", "user_models:own_fit((28, 28, 1), 10) returned a OwnFit, which overrides "
                            "fit: crossbow_tf.run and the harness run the learners' step themselves and would drop "
                            "that logic"),
])
def test_a_bad_model_is_one_line_and_exit_2_before_training(in_folder, capsys, spec, message):
    cfg = write_config(in_folder / "bad.yaml", model=spec)
    results = in_folder / "never.json"
    for argv in (["--config", cfg, "--check"], ["--config", cfg, "--results", str(results)]):
        assert run_main(argv) == 2
        err = one_error_line(capsys)
        assert message in err, err
    assert not results.exists()


@pytest.mark.parametrize("main", [tf_ssgd.main, crossbow_ssgd.main], ids=["tf_ssgd", "crossbow_ssgd"])
def test_the_baselines_refuse_a_bad_model_alike(in_folder, capsys, main):
    for spec, message in (("no_such_module:build", "no module 'no_such_module'"),
                          ("user_models:returns_a_list", "returned list, not a Keras model"),
                          ("user_models:own_fit", "returned a OwnFit, which overrides fit")):
        cfg = write_config(in_folder / "bad.yaml", model=spec)
        assert main(["--config", cfg, "--results", str(in_folder / "never.json")]) == 2
        assert message in one_error_line(capsys)
    assert not (in_folder / "never.json").exists()


def _load_compare():
    from crossbow_tf.compare import cli
    return cli


def test_the_harness_locates_a_users_model_without_running_it(in_folder):
    for spec in ("user_models:build", "nets/tiny.py:build", "nets/tiny.py:Tiny"):
        locate_model(spec)
    locate_model("breaks_on_import:build")   # found in the source; importing it would raise
    for spec, message in (("no_such_module:build", "no module 'no_such_module' in the current folder"),
                          ("nets/absent.py:build", "file nets/absent.py not found"),
                          ("nets/broken.py:build", "nets/broken.py does not import (SyntaxError:"),
                          ("user_models:missing", "user_models has no 'missing'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            locate_model(spec)


@pytest.mark.parametrize("changes, message", [
    (dict(model="user_models:missing"), "model: user_models:missing: user_models has no 'missing'"),
    (dict(model="nets/absent.py:build"), "file nets/absent.py not found"),
    (dict(data={"name": "npz", "path": "absent.npz"}), "data.path: absent.npz not found"),
])
def test_compare_refuses_a_missing_model_or_file_before_any_run(in_folder, capsys, changes, message):
    compare = _load_compare()
    cfg = write_config(in_folder / "compare.yaml", compare={
        "methods": {"sma": {}, "tf_ssgd": {}}, "budget": 1, "seeds": [0], "epochs": 1, "target": 0.5}, **changes)
    out = in_folder / "report"
    assert compare.main(["--config", cfg, "--out", str(out)]) == 2
    err = one_error_line(capsys)
    assert err.startswith("compare: error:") and message in err, err
    assert not out.exists()


def test_config_knows_the_built_in_names():
    assert set(config_lib.MODEL_NAMES) == set(MODELS)
    assert set(config_lib.DATA_SET_NAMES) == set(DATASETS)
    assert set(config_lib.FILE_DATA_SETS) < set(DATASETS)


# --- a user's arrays -----------------------------------------------------------------------------

def examples(split, map_fn):
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in eval_batches(split, 512, map_fn)])
    return np.concatenate(xs), np.concatenate(ys)


def test_uint8_greyscale_images_are_scaled_and_given_a_channel(folder):
    arrays = digits_uint8()
    data = load_dataset("npz", path=str(folder / "digits.npz"))
    assert data.input_shape == (28, 28, 1) and data.num_classes == 10
    assert (data.train.size, data.test.size) == (4000, 1000)
    for split, key in ((data.train, "train"), (data.test, "test")):
        x, y = examples(split, data.eval_map)
        assert x.dtype == np.float32 and y.dtype == np.int32
        np.testing.assert_array_equal(x, (arrays[f"x_{key}"].astype(np.float32) / 255.0)[..., None])
        np.testing.assert_array_equal(y, arrays[f"y_{key}"])
    # The same values as the embedded data set, which mnist.py scales the same way.
    (x_embedded, _), _ = load_embedded_mnist()
    np.testing.assert_array_equal(examples(data.train, data.train_map)[0], x_embedded)


@pytest.fixture(scope="module")
def float_arrays():
    rng = np.random.default_rng(1)
    return dict(x_train=rng.normal(size=(60, 6, 5, 3)).astype(np.float32), y_train=rng.integers(0, 4, 60),
                x_test=rng.normal(size=(20, 6, 5, 3)).astype(np.float32),
                y_test=rng.integers(0, 4, (20, 1)))   # (N, 1), as CIFAR's load_data gives


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed], ids=["stored", "compressed"])
def test_float_images_are_taken_as_they_are(tmp_path, float_arrays, save):
    path = tmp_path / "floats.npz"
    save(path, **float_arrays)
    data = load_dataset("npz", path=str(path))
    assert data.input_shape == (6, 5, 3) and data.num_classes == 4
    x, y = examples(data.test, data.eval_map)
    np.testing.assert_array_equal(x, float_arrays["x_test"])
    np.testing.assert_array_equal(y, float_arrays["y_test"][:, 0])
    mapped = npz.read_npz(str(path))
    assert all(isinstance(a, np.memmap) == (save is np.savez) for a in mapped.values())


def test_stored_members_are_memory_mapped_not_read(folder):
    arrays = npz.read_npz(str(folder / "digits.npz"))
    for key, expected in digits_uint8().items():
        assert isinstance(arrays[key], np.memmap) and arrays[key].filename == str(folder / "digits.npz")
        np.testing.assert_array_equal(arrays[key], expected)


def test_a_file_too_large_for_memory_is_read_from_the_map(folder, monkeypatch):
    """Beyond IN_MEMORY_BYTES the pipeline holds row numbers and reads each example from the mapped
    file: the same examples, for the training and the test split, through either map."""
    in_memory = load_dataset("npz", path=str(folder / "digits.npz"))
    monkeypatch.setattr(npz, "IN_MEMORY_BYTES", 0)
    mapped = load_dataset("npz", path=str(folder / "digits.npz"))
    assert mapped.train.dataset.element_spec[0].dtype == tf.int64   # rows, not images
    for split in ("train", "test"):
        for map_name in ("train_map", "eval_map"):
            a = examples(getattr(in_memory, split), getattr(in_memory, map_name))
            b = examples(getattr(mapped, split), getattr(mapped, map_name))
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])


def _bad(change):
    def make(arrays):
        arrays = dict(arrays)
        change(arrays)
        return arrays
    return make


def _with_nan(x):
    x = x.copy()
    x[41, 2, 3, 1] = np.nan
    return x


BAD_ARRAYS = [
    ("wrong_key", _bad(lambda a: a.update(x_val=a.pop("x_test"))), "no x_test (the file holds x_train, x_val, y_test, y_train)"),
    ("lengths", _bad(lambda a: a.update(y_train=a["y_train"][:-1])), "x_train holds 60 examples but y_train 59 labels"),
    ("label_high", _bad(lambda a: a.update(y_test=np.full((20, 1), 4))), "y_test holds label 4, out of range 0..3"),
    ("label_negative", _bad(lambda a: a.update(y_train=np.where(np.arange(60) == 5, -1, a["y_train"]))),
     "y_train holds label -1, out of range 0..3"),
    ("nan", _bad(lambda a: a.update(x_train=_with_nan(a["x_train"]))), "x_train is not finite (NaN or infinity) in example 41"),
    ("empty", _bad(lambda a: a.update(x_test=a["x_test"][:0], y_test=a["y_test"][:0])),
     "the test split is empty"),
    ("float_labels", _bad(lambda a: a.update(y_train=a["y_train"].astype(np.float32))),
     "y_train must hold integer class labels, got float32"),
    ("int_images", _bad(lambda a: a.update(x_train=a["x_train"].astype(np.int64), x_test=a["x_test"].astype(np.int64))),
     "x_train must be uint8 images or floats, got int64"),
    ("shapes", _bad(lambda a: a.update(x_test=a["x_test"][:, :4])), "x_train's examples are of shape (6, 5, 3), x_test's"),
    ("one_class", _bad(lambda a: a.update(y_train=np.zeros(60, np.int64), y_test=np.zeros(20, np.int64))),
     "only class 0"),
]


@pytest.mark.parametrize("name, change, message", BAD_ARRAYS, ids=[b[0] for b in BAD_ARRAYS])
def test_a_bad_npz_is_one_line_and_exit_2(tmp_path, capsys, float_arrays, name, change, message):
    path = tmp_path / f"{name}.npz"
    np.savez(path, **change(float_arrays))
    with pytest.raises(DataError, match=None) as raised:
        load_dataset("npz", path=str(path))
    assert message in str(raised.value) and str(path) in str(raised.value)
    cfg = write_config(tmp_path / "bad.yaml", model="lenet", data={"name": "npz", "path": str(path)})
    assert run_main(["--config", cfg, "--check"]) == 2
    err = one_error_line(capsys)
    assert message in err and str(path) in err


def test_files_that_are_not_npz_arrays(tmp_path):
    text = tmp_path / "notes.npz"
    text.write_text("not a zip file")
    with pytest.raises(DataError, match="notes.npz: not an .npz file"):
        load_dataset("npz", path=str(text))
    with pytest.raises(DataError, match="absent.npz: file not found"):
        load_dataset("npz", path=str(tmp_path / "absent.npz"))
    pickled = tmp_path / "objects.npz"
    np.savez(pickled, x_train=np.array([{"a": 1}] * 3, dtype=object), y_train=np.arange(3), x_test=np.zeros((1, 2)),
             y_test=np.zeros(1, int))
    with pytest.raises(DataError, match="x_train cannot be read .*object array"):
        load_dataset("npz", path=str(pickled))
    truncated = tmp_path / "truncated.npz"
    np.savez(truncated, **digits_uint8())
    with zipfile.ZipFile(truncated) as z:
        end = z.getinfo("x_test.npy").header_offset + 2000
    with open(truncated, "r+b") as f:
        f.truncate(end)
    with pytest.raises(DataError, match="truncated.npz"):
        load_dataset("npz", path=str(truncated))


@pytest.mark.parametrize("data, message", [
    ({"name": "npz"}, "data.path: the npz data set needs the path of its file"),
    ({"name": "npz", "path": "a.npz", "data_dir": "/data"}, "data.data_dir: the npz data set reads data.path"),
    ({"name": "mnist_embedded", "path": "a.npz"}, "data.path: applies to the npz data set only"),
    ({"name": "npy"}, "data.name: unknown data set 'npy'"),
])
def test_npz_settings_are_checked_before_tensorflow_starts(data, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.from_dict({"data": data})


def test_the_example_folder_plans_its_comparison(tmp_path, monkeypatch, capsys):
    """examples/user_model as a user would run it from a copy: make_npz.py writes the arrays the
    config names and compare plans both methods on the folder's model."""
    folder = tmp_path / "user_model"
    shutil.copytree(os.path.join(REPO, "examples", "user_model"), folder)
    monkeypatch.chdir(folder)
    runpy.run_path("make_npz.py")
    data = load_dataset("npz", path="digits.npz")
    assert data.input_shape == (28, 28, 1) and (data.train.size, data.test.size) == (4000, 1000)
    capsys.readouterr()
    assert _load_compare().main(["--config", "compare.yaml", "--dry-run"]) == 0
    planned = capsys.readouterr().out
    assert "sma (sma) t00" in planned and "tf_ssgd (tf_ssgd) t00" in planned
    assert build_model("my_models:build", data.input_shape, data.num_classes).output_shape == (None, 10)


@pytest.mark.parametrize("main", [run_main, tf_ssgd.main, crossbow_ssgd.main], ids=["sma", "tf_ssgd", "crossbow_ssgd"])
def test_a_users_compute_loss_and_train_step_are_the_objective_on_every_side(in_folder, capsys, main):
    # Issue 44: the engine's methods run the overrides per learner, tf_ssgd's Keras fit as Keras does.
    # Against the twin (the same layers and seed, no override): Doubled's compute_loss trains to other
    # weights; ShiftedLabels' own train_step teaches the next class, so that its model is wrong on nearly
    # every test example while the twin learns the digits.
    evaluations = {}
    for name in ("own_loss", "own_step", "its_twin"):
        cfg = write_config(in_folder / f"{name}.yaml", model=f"user_models:{name}", learners_per_device=2,
                           batch_size=64)
        results = in_folder / f"{name}-{main.__module__}.json"
        assert main(["--config", cfg, "--results", str(results)]) == 0, capsys.readouterr().err
        evaluations[name] = json.loads(results.read_text())["evaluations"][-1]
        assert np.isfinite(evaluations[name]["loss"])
    assert evaluations["own_loss"]["loss"] != pytest.approx(evaluations["its_twin"]["loss"], rel=1e-4)
    assert evaluations["its_twin"]["accuracy"] > 0.6 and evaluations["own_step"]["accuracy"] < 0.2, evaluations


@pytest.mark.parametrize("main", [run_main, tf_ssgd.main], ids=["sma", "tf_ssgd"])
def test_the_harness_measures_a_model_with_its_own_test_step_from_its_outputs_on_every_side(in_folder, capsys, main):
    # OwnEvaluation's test_step says 7.0; the recorded accuracy is the share of test digits its outputs get right.
    cfg = write_config(in_folder / "evaluation.yaml", model="user_models:own_evaluation", batch_size=64)
    results = in_folder / f"evaluation-{main.__module__}.json"
    assert main(["--config", cfg, "--results", str(results)]) == 0, capsys.readouterr().err
    last = json.loads(results.read_text())["evaluations"][-1]
    assert 0.5 < last["accuracy"] <= 1.0 and last["loss"] != 7.0, last


def test_auto_tuning_takes_a_users_compute_loss_and_train_step(in_folder, capsys):
    # The tuner's throw-away engines run the model's own compute_loss and train_step, as the run's engine.
    for spec in ("user_models:own_loss", "user_models:own_step"):
        cfg = write_config(in_folder / "tuned.yaml", model=spec, learners_per_device="auto",
                           autotune=dict(max_learners_per_device=2, warmup_iterations=1, measure_iterations=2))
        results = in_folder / f"tuned-{spec.split(':')[1]}.json"
        assert run_main(["--config", cfg, "--results", str(results)]) == 0, capsys.readouterr().err
        record = json.loads(results.read_text())
        assert record["autotune"]["chosen"] in (1, 2) and record["evaluations"], record


def test_an_own_train_step_under_loss_scaling_is_refused_before_training(in_folder, capsys):
    cfg = write_config(in_folder / "scaled.yaml", model="user_models:own_step", precision="mixed_float16")
    for argv in (["--config", cfg, "--check"], ["--config", cfg, "--results", str(in_folder / "never.json")]):
        assert run_main(argv) == 2
        assert ("precision: mixed_float16: ShiftedLabels has a train_step of its own, whose loss the engine cannot "
                "scale") in one_error_line(capsys)
    assert not (in_folder / "never.json").exists()


