"""A regular (non-editable) install works from outside the checkout: the default experiment and the
embedded data set are package data. (.ci/run also installs the wheel into a fresh environment.)"""
import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGED = os.path.join(REPO, "crossbow_tf", "configs", "lenet_mnist_embedded.yaml")


def test_packaged_default_experiment_is_the_user_facing_copy():
    with open(PACKAGED, "rb") as packaged, open(os.path.join(REPO, "configs", "lenet_mnist_embedded.yaml"), "rb") as copy:
        assert packaged.read() == copy.read(), "edit both copies (configs/ is what users read and copy)"
    from crossbow_tf.run import DEFAULT_CONFIG
    assert os.path.samefile(DEFAULT_CONFIG, PACKAGED)


def test_wheel_install_checks_the_default_command_outside_the_checkout(tmp_path):
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
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    str(tmp_path / "dist" / wheel)], check=True, capture_output=True, timeout=300)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))   # the installed copy, not this checkout
    where = subprocess.run([sys.executable, "-c", "import crossbow_tf; print(crossbow_tf.__file__)"],
                           capture_output=True, text=True, env=env, cwd=str(outside), check=True)
    assert where.stdout.strip().startswith(str(site))
    check = subprocess.run([sys.executable, "-m", "crossbow_tf.run", "--check"], capture_output=True, text=True,
                           env=env, cwd=str(outside), timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    assert f"{site}/crossbow_tf/configs/lenet_mnist_embedded.yaml: valid" in check.stdout
    assert os.listdir(outside) == []


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
