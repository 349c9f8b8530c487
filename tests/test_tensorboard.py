"""--tensorboard DIR: the event files of crossbow_tf.run and tf_ssgd hold each epoch's scalars, equal
to the run's results file; the harness gives every run its own folder and its trial's hparams."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import yaml
from tensorboard.plugins.hparams import metadata as hparams_metadata

from baselines import tf_ssgd
from baselines._cli import parse_tf_ssgd_options
import crossbow_tf.compare as harness
from crossbow_tf.data import load_embedded_mnist
from crossbow_tf.run import main as run_main
from crossbow_tf.tensorboard import ACCURACY_BY_TIME_TAG, LEARNING_RATE_TAG, SCALARS

from forking import PYTHON, forked_runs  # noqa: F401  (forked_runs: a fixture)

pytestmark = pytest.mark.usefixtures("forked_runs")   # TensorFlow imported once (tests/forking.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_MODEL = '''
import keras


def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(num_classes)])
'''


def scalars(logdir):
    """{tag: {step: value}} of every scalar in the event files under LOGDIR."""
    out = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    out.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
    return out


def hparams_sessions(logdir):
    """[(group name, {name: value})] of the hparams session starts in LOGDIR's event files."""
    sessions = []
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == hparams_metadata.PLUGIN_NAME:
                    start = hparams_metadata.parse_session_start_info_plugin_data(
                        value.metadata.plugin_data.content)
                    values = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
                    sessions.append((start.group_name, values))
    return sessions


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    (root / "tiny_model.py").write_text(TINY_MODEL)
    (x, y), (xt, yt) = load_embedded_mnist()
    np.savez(root / "digits.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)   # float (N, H, W, C)
    return root


def write_config(path, **changes):
    doc = dict(name="tb", model="tiny_model:build", data={"name": "npz", "path": "digits.npz"}, batch_size=32,
               learners_per_device=2, learning_rate={"base": 0.05, "drops_at_epochs": [1], "drop_factor": 0.5},
               epochs=2, seed=1)
    doc.update(changes)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def check_events_match_results(logdir, results, learners):
    events = scalars(logdir)
    expected_tags = {tag for key, tag in SCALARS.items() if learners or not key.startswith("learner")}
    assert set(events) == expected_tags | {LEARNING_RATE_TAG, ACCURACY_BY_TIME_TAG}
    assert events[ACCURACY_BY_TIME_TAG] == pytest.approx(
        {round(e["wall_time"] * 1000): e["accuracy"] for e in results["evaluations"]}, rel=1e-6)
    for e in results["evaluations"]:
        for key, tag in SCALARS.items():
            if tag in events:
                assert events[tag][e["epoch"]] == pytest.approx(e[key], rel=1e-6), (tag, e["epoch"])
    # The rate of each epoch's last iteration: 0.05, halved by the drop after epoch 1.
    assert events[LEARNING_RATE_TAG] == pytest.approx({1: 0.05, 2: 0.025})


def test_crossbow_run_writes_every_epochs_scalars(folder, monkeypatch):
    monkeypatch.chdir(folder)
    cfg = write_config(folder / "sma.yaml")
    assert run_main(["--config", cfg, "--tensorboard", "tb/sma", "--results", "sma.json"]) == 0
    results = json.loads((folder / "sma.json").read_text())
    assert len(results["evaluations"]) == 2 and results["config"]["tensorboard"] == "tb/sma"
    check_events_match_results(folder / "tb" / "sma", results, learners=True)


def test_tf_ssgd_writes_the_same_scalars_but_the_learners(folder, monkeypatch):
    monkeypatch.chdir(folder)
    cfg = write_config(folder / "ssgd.yaml", tensorboard="tb/ssgd")   # the config key, as the flag
    assert tf_ssgd.main(["--config", cfg, "--results", "ssgd.json"]) == 0
    results = json.loads((folder / "ssgd.json").read_text())
    check_events_match_results(folder / "tb" / "ssgd", results, learners=False)


def test_a_tensorboard_folder_that_is_a_file_is_refused(folder, monkeypatch, capsys):
    monkeypatch.chdir(folder)
    (folder / "taken").write_text("")
    cfg = write_config(folder / "file.yaml")
    for main in (run_main, tf_ssgd.main):
        assert main(["--config", cfg, "--tensorboard", "taken"]) == 2
        err = capsys.readouterr().err.strip()
        assert "taken: the TensorBoard folder is a file" in err and len(err.splitlines()) == 1


def test_the_harness_gives_each_run_a_folder_and_its_hparams(folder, monkeypatch):
    """A real tf_ssgd process started by the harness from the user's folder imports the user's
    module, reads the relative .npz and writes its curves in OUT/tensorboard/ENTRY/TRIAL_sSEED,
    beside the trial's hparams (grouped by trial across seeds)."""
    monkeypatch.chdir(folder)
    out = folder / "report"
    harness.prepare_out_dir(str(out))
    runner = harness.Runner(str(out), 1, out=open(os.devnull, "w"), python=PYTHON)
    experiment = yaml.safe_load(open(write_config(folder / "run.yaml", epochs=1, learners_per_device=1)))
    record = runner.run("tf_ssgd", experiment, parse_tf_ssgd_options({}), "ssgd_entry", "t01_s4",
                        "t01 base=0.05", 4, 0.5, 300)
    assert record.summary is not None, record.error
    logdir = out / "tensorboard" / "ssgd_entry" / "t01_s4"
    events = scalars(logdir)
    with open(record.path) as f:
        [evaluation] = json.load(f)["evaluations"]
    assert events["test/accuracy"] == pytest.approx({1: evaluation["accuracy"]}, rel=1e-6)
    [(group, hparams)] = hparams_sessions(logdir)
    assert group == "ssgd_entry/t01"
    assert hparams["method"] == "tf_ssgd" and hparams["trial"] == "t01" and hparams["seed"] == 4
    assert hparams["model"] == "tiny_model:build" and hparams["learning_rate.base"] == 0.05
    assert hparams["tf_ssgd.lr_scaling"] == "none" and hparams["data.name"] == "npz"


def test_the_harness_writes_hparams_without_starting_tensorflow(tmp_path):
    """The harness process stays free of TensorFlow (its runs have their own): hparams go through
    TensorBoard's protocol buffers and event writer."""
    script = ("import sys; from crossbow_tf.tensorboard import write_hparams; "
              f"write_hparams({str(tmp_path)!r}, dict(method='sma', seed=0), 'sma/t00'); "
              "assert 'tensorflow' not in sys.modules, 'TensorFlow was imported'")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [(group, hparams)] = hparams_sessions(tmp_path)
    assert group == "sma/t00" and hparams == {"method": "sma", "seed": 0}


def test_check_refuses_a_tensorboard_that_does_not_import_as_the_run_would_fail(tmp_path):
    # A broken environment (issue 43, item 5): the package is there, but importing it fails. --check
    # imports what the run will import, and refuses with the reason, exit 2, before anything is written.
    broken = tmp_path / "site" / "tensorboard"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("cannot import name \'builder\' from '
                                        '\'google.protobuf.internal\'")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), REPO]), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-m", "crossbow_tf.run", "--check", "--tensorboard", str(tmp_path / "tb")],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "crossbow_tf: error: --tensorboard: the tensorboard package does not import (tensorboard: ImportError: cannot "
        "import name 'builder' from 'google.protobuf.internal'), and TensorFlow writes event files with it (pip "
        "install --force-reinstall tensorboard)"), proc.stderr
    assert not (tmp_path / "tb").exists()
    # With the real package the same check passes.
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-m", "crossbow_tf.run", "--check", "--tensorboard", str(tmp_path / "tb")],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
