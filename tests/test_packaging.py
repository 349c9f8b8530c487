"""A regular (non-editable) install works from outside the checkout: the default experiment and the
embedded data set are package data, and the harness's commands run a user's comparison from their
own folder. (.ci/run also installs the wheel into a fresh environment.)"""
import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGED = os.path.join(REPO, "crossbow_tf", "configs", "lenet_mnist_embedded.yaml")


def test_packaged_default_experiment_is_the_user_facing_copy():
    with open(PACKAGED, "rb") as packaged, open(os.path.join(REPO, "configs", "lenet_mnist_embedded.yaml"), "rb") as copy:
        assert packaged.read() == copy.read(), "edit both copies (configs/ is what users read and copy)"
    from crossbow_tf.run import DEFAULT_CONFIG
    assert os.path.samefile(DEFAULT_CONFIG, PACKAGED)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder, environment) of the wheel installed there with --no-deps (its dependencies are
    this environment's), so that runs import the installed copy, not this checkout."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"   # built from a copy: setuptools writes build/ next to its input
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), source / name)
    for package in ("crossbow_tf", "baselines"):
        shutil.copytree(os.path.join(REPO, package), source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = os.listdir(tmp_path / "dist")
    names = zipfile.ZipFile(tmp_path / "dist" / wheel).namelist()
    assert "crossbow_tf/configs/lenet_mnist_embedded.yaml" in names
    assert "crossbow_tf/data/embedded/mnist5k-images-idx3-ubyte.gz" in names
    assert {"crossbow_tf/compare/__main__.py", "crossbow_tf/compare/runner.py",
            "crossbow_tf/reproduce.py"} <= set(names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    str(tmp_path / "dist" / wheel)], check=True, capture_output=True, timeout=300)
    return site, dict(os.environ, PYTHONPATH=str(site))   # the installed copy, not this checkout


def test_wheel_install_checks_the_default_command_outside_the_checkout(installed, tmp_path):
    site, env = installed
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = subprocess.run([sys.executable, "-c", "import crossbow_tf; print(crossbow_tf.__file__)"],
                           capture_output=True, text=True, env=env, cwd=str(outside), check=True)
    assert where.stdout.strip().startswith(str(site))
    check = subprocess.run([sys.executable, "-m", "crossbow_tf.run", "--check"], capture_output=True, text=True,
                           env=env, cwd=str(outside), timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert f"{site}/crossbow_tf/configs/lenet_mnist_embedded.yaml: valid" in check.stdout
    assert os.listdir(outside) == []


USER_MODEL = """
import keras


def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_classes, activation="softmax")])
"""

USER_CONFIG = """
name: installed-user
model: nets/tiny.py:build
data: {name: npz, path: arrays.npz}
devices: {logical_cpu: 1}
learners_per_device: 2
batch_size: 16
learning_rate: {base: 0.05}
epochs: 1
target_accuracy: 0.5
compare:
  budget: 1
  seeds: [0]
  methods:
    sma: {}
    tf_ssgd: {fixed: {batch_size: 32}}
"""


def test_installed_entry_points_compare_a_users_model_from_their_own_folder(installed, tmp_path):
    """crossbow-compare from the wheel, in a folder outside the checkout, on the user's model file
    and .npz: both methods run (one trial, one epoch each), with report, runs and TensorBoard."""
    site, env = installed
    for script in ("crossbow-compare", "crossbow-sweep", "crossbow-reproduce", "crossbow-doctor"):
        helped = subprocess.run([str(site / "bin" / script), "--help"], capture_output=True, text=True, env=env,
                                timeout=120)
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: {script} "), helped.stderr[-2000:]
    for module in ("crossbow_tf.compare", "crossbow_tf.compare.sweep", "crossbow_tf.reproduce"):
        helped = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env,
                                timeout=120)
        assert helped.returncode == 0 and "--config" in helped.stdout, (module, helped.stderr[-2000:])
    folder = tmp_path / "mine"
    (folder / "nets").mkdir(parents=True)
    (folder / "nets" / "tiny.py").write_text(USER_MODEL)
    (folder / "compare.yaml").write_text(USER_CONFIG)
    rng = np.random.default_rng(0)

    def split(n):   # learnable: the class is the brighter row of two
        y = rng.integers(0, 2, n)
        x = rng.integers(0, 60, (n, 8, 8)).astype(np.uint8)
        x[np.arange(n), y * 4] = 250
        return x, y
    (x_train, y_train), (x_test, y_test) = split(256), split(64)
    np.savez(folder / "arrays.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    proc = subprocess.run([str(site / "bin" / "crossbow-compare"), "--config", "compare.yaml", "--out", "OUT"],
                          capture_output=True, text=True, env=env, cwd=str(folder), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = folder / "OUT"
    report = (out / "report.md").read_text()
    assert "| sma |" in report and "| tf_ssgd |" in report and "- command: `crossbow-compare --config" in report
    for method in ("sma", "tf_ssgd"):
        with open(out / "runs" / method / "t00_s0.json") as f:
            results = json.load(f)
        assert results["method"] == method and len(results["evaluations"]) == 1
        with open(out / "runs" / method / "t00_s0.log") as f:
            assert f"-m {'crossbow_tf.run' if method == 'sma' else 'baselines.tf_ssgd'} " in f.readline()
        assert list((out / "tensorboard" / method / "t00_s0").glob("events.out.tfevents.*"))


def test_readme_offline_loader_is_reachable_from_the_package():
    """The README's Keras section: crossbow_tf.data.load_embedded_mnist() after ``import crossbow_tf``."""
    code = ("import crossbow_tf; (x, y), (xt, yt) = crossbow_tf.data.load_embedded_mnist(); "
            "print(x.shape, x.dtype, y.dtype, xt.shape)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["(4000,", "28,", "28,", "1)", "float32", "int32", "(1000,", "28,", "28,", "1)"]
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        assert "crossbow_tf.data.load_embedded_mnist()" in f.read()


def test_the_checkouts_old_commands_run_the_packaged_harness():
    """tools/compare.py, tools/sweep.py and tools/reproduce.py (named by older docs and reports) are
    the package's commands, and the harness's process stays free of TensorFlow."""
    for name in ("compare", "sweep", "reproduce"):
        helped = subprocess.run([sys.executable, os.path.join(REPO, "tools", f"{name}.py"), "--help"],
                                capture_output=True, text=True, timeout=120, cwd="/")
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: crossbow-{name} "), helped.stderr
    code = ("import sys; import crossbow_tf.compare.cli, crossbow_tf.compare.sweep, crossbow_tf.compare.reproduce; "
            "assert 'tensorflow' not in sys.modules and 'matplotlib' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
