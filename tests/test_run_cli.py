"""`python -m crossbow_tf.run`: the default experiment and its handling of bad input."""
import json
import os
import subprocess
import sys

import pytest

from crossbow_tf import config as config_lib
from crossbow_tf.errors import ConfigError
from crossbow_tf.run import DEFAULT_CONFIG, main

from forking import PYTHON, forked_runs  # noqa: F401  (forked_runs: a fixture)

pytestmark = pytest.mark.usefixtures("forked_runs")   # TensorFlow imported once (tests/forking.py)


def run_cli(*args, timeout=600):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([PYTHON, "-m", "crossbow_tf.run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_default_command_reaches_its_target(tmp_path):
    results_path = tmp_path / "run.json"
    proc = run_cli("--results", str(results_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "time to 96.00% test accuracy" in proc.stdout
    assert "images/s" in proc.stdout
    results = json.loads(results_path.read_text())
    assert results["method"] == "sma"
    tuned = results["autotune"]   # learners_per_device: auto measures m = 1, 2, ... before training
    assert tuned["chosen"] >= 1 and results["num_learners"] == 2 * tuned["chosen"]
    assert all(tuned["curve"][str(m)] > 0 for m in range(1, tuned["chosen"] + 1))
    assert f"auto-tuned learners per device: chose m={tuned['chosen']}" in proc.stdout
    assert len(results["devices"]) == 2
    assert results["evaluations"][-1]["accuracy"] >= 0.96
    walls = [e["wall_time"] for e in results["evaluations"]]
    assert walls == sorted(walls)


def test_default_config_file_is_valid():
    cfg = config_lib.load_config(DEFAULT_CONFIG)
    assert cfg.model == "lenet" and cfg.data.name == "mnist_embedded" and cfg.target_accuracy == 0.96
    assert cfg.devices.logical_cpu > 1 and cfg.learners_per_device == "auto"


@pytest.mark.parametrize("text, message", [
    ("model: lenet\nbogus: 1\n", "bogus: unknown key"),
    ("batch_size: sixteen\n", "batch_size: expected an integer"),
    ("algorithm: {name: adam}\n", "algorithm.name: unknown algorithm 'adam'"),
    ("learning_rate: {base: -1}\n", "learning_rate.base: must be positive"),
    ("model: [unclosed\n", "not valid YAML"),
    ("- a list\n", "expected a mapping"),
])
def test_bad_config_gets_one_clear_line_and_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(path) in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_missing_config_file(capsys):
    assert main(["--config", "/nonexistent/x.yaml"]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_existing_results_file_is_not_overwritten(tmp_path, capsys):
    results = tmp_path / "keep.json"
    results.write_text("precious")
    assert main(["--results", str(results)]) == 2
    assert "exists" in capsys.readouterr().err
    assert results.read_text() == "precious"


def test_bad_override_names_the_command_line(capsys):
    assert main(["--learners-per-device", "0"]) == 2
    assert "command line: learners_per_device" in capsys.readouterr().err


def test_unknown_model_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        from crossbow_tf.models import build_model
        build_model("nope", (28, 28, 1), 10)


@pytest.mark.parametrize("section, reader", [("compare", "crossbow-compare"), ("sweep", "crossbow-sweep"),
                                             ("tf_ssgd", "baselines.tf_ssgd")])
def test_run_rejects_the_sections_of_other_tools(tmp_path, section, reader):
    """A run would silently not use them: it says which tool reads the section (the tools and the
    baselines split them off and accept the same file)."""
    path = tmp_path / "with_tools.yaml"
    path.write_text(f"model: lenet\n{section}: {{}}\n")
    with pytest.raises(ConfigError, match=f"{section}: this section is read by .*{reader}"):
        config_lib.load_config(str(path))
    path.write_text("model: lenet\ncompares: {}\n")
    with pytest.raises(ConfigError, match="compares: unknown key"):
        config_lib.load_config(str(path))


def test_learners_option_is_validated(tmp_path):
    path = tmp_path / "learners.yaml"
    path.write_text("learners: fast\n")
    with pytest.raises(ConfigError, match="learners: unknown 'fast'"):
        config_lib.load_config(str(path))
