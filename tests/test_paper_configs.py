"""The four paper set-ups run end to end through `python -m crossbow_tf.run` on tiny generated data
in each real on-disk format.

Each test runs a copy of the paper's config with only the cost knobs shrunk (learners, batch,
evaluation batch) for one epoch of a few iterations; model, data set, algorithm and schedule are
the paper's. Tests share one process whose CPU is already split into 4 logical devices
(conftest.py), so the runs use the configs' default (one device) or all 4.
"""
import json
import os

import numpy as np
import pytest
import yaml

from crossbow_tf import run
from crossbow_tf.config import load_config
from test_data_formats import (jpeg, random_images, write_cifar10, write_cifar100, write_imagenet,
                               write_mnist)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")

PAPER = {   # config: (model, data set, target accuracy)
    "lenet_mnist": ("lenet", "mnist", 0.99),
    "resnet32_cifar10": ("resnet32", "cifar10", 0.80),
    "vgg16_cifar100": ("vgg16", "cifar100", 0.69),
    "resnet50_imagenet": ("resnet50", "imagenet", 0.53),
}


def make_data(kind, directory, rng):
    """Writes a tiny data set of KIND in its real format; returns (data dir, train size)."""
    if kind == "mnist":
        write_mnist(directory, (random_images(rng, 24, (28, 28)), rng.integers(0, 10, 24)),
                    (random_images(rng, 8, (28, 28)), rng.integers(0, 10, 8)), compress=True)
        return directory, 24
    if kind == "cifar10":
        write_cifar10(os.path.join(directory, "cifar-10-batches-bin"),
                      [(random_images(rng, 2), rng.integers(0, 10, 2)) for _ in range(5)],
                      (random_images(rng, 4), rng.integers(0, 10, 4)))
        return directory, 10
    if kind == "cifar100":
        write_cifar100(os.path.join(directory, "cifar-100-binary"),
                       (random_images(rng, 8), rng.integers(0, 20, 8), rng.integers(0, 100, 8)),
                       (random_images(rng, 4), rng.integers(0, 20, 4), rng.integers(0, 100, 4)))
        return directory, 8
    if kind == "imagenet":
        records = [(jpeg(random_images(rng, 1, (48, 64, 3))[0]), int(l) + 1)
                   for l in rng.integers(0, 1000, 4)]
        write_imagenet(directory, records[:2], records[2:], shards=(2, 1))
        return directory, 2
    raise AssertionError(kind)


def tiny_copy(name, tmp_path, **overrides):
    with open(os.path.join(CONFIGS, f"{name}.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg.update(overrides)
    path = tmp_path / f"{name}-tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_config_is_valid(name):
    cfg = load_config(os.path.join(CONFIGS, f"{name}.yaml"))
    model, data, target = PAPER[name]
    assert (cfg.model, cfg.data.name, cfg.target_accuracy) == (model, data, target)
    assert cfg.algorithm.name == "sma" and cfg.algorithm.alpha == 0.1
    assert cfg.algorithm.momentum == 0.9 and cfg.algorithm.central_momentum == 0.9
    assert cfg.devices.logical_cpu is None   # GPUs when present; the CPU split is a command-line choice


# (config, learners per device, batch per learner, extra command-line arguments)
RUNS = [
    ("lenet_mnist", 1, 4, ["--logical-cpu-devices", "4"]),   # k = 4 over the 4 test devices
    ("resnet32_cifar10", 2, 4, []),
    ("vgg16_cifar100", 2, 2, []),
    ("resnet50_imagenet", 1, 2, []),                          # one iteration of batch 2
]


@pytest.mark.parametrize("name,m,b,extra", RUNS, ids=[r[0] for r in RUNS])
def test_paper_setup_runs_on_real_format_data(tmp_path, capsys, name, m, b, extra):
    data_dir, train_size = make_data(PAPER[name][1], str(tmp_path / "data"), np.random.default_rng(0))
    config = tiny_copy(name, tmp_path, learners_per_device=m, batch_size=b, eval_batch_size=8)
    results = tmp_path / "results.json"
    code = run.main(["--config", config, "--data-dir", data_dir, "--epochs", "1",
                     "--results", str(results)] + extra)
    out = capsys.readouterr()
    assert code == 0, out.err
    saved = json.loads(results.read_text())
    (evaluation,) = saved["evaluations"]
    assert evaluation["epoch"] == 1 and evaluation["examples"] == train_size
    assert 0.0 <= evaluation["accuracy"] <= 1.0 and np.isfinite(evaluation["loss"])
    assert saved["config"]["model"] == PAPER[name][0]
    assert f"on {PAPER[name][1]} ({train_size} train" in out.out


@pytest.mark.parametrize("name", ["resnet32_cifar10", "resnet50_imagenet"])
def test_missing_data_dir_is_one_line_and_exit_2(tmp_path, capsys, name):
    missing = str(tmp_path / "no-such-dir")
    code = run.main(["--config", os.path.join(CONFIGS, f"{name}.yaml"), "--data-dir", missing])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and missing in err and "not found" in err


def test_bad_data_file_is_one_line_and_exit_2(tmp_path, capsys):
    data_dir, _ = make_data("cifar10", str(tmp_path / "data"), np.random.default_rng(1))
    bad = os.path.join(data_dir, "cifar-10-batches-bin", "data_batch_2.bin")
    with open(bad, "ab") as f:
        f.write(b"\x00" * 5)
    code = run.main(["--config", os.path.join(CONFIGS, "resnet32_cifar10.yaml"), "--data-dir", data_dir])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and bad in err
