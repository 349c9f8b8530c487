"""The README/docs example (examples/keras_example.py) reaches 96% and saves a plain Keras model.

It runs in its own process because it splits the CPU into 2 logical devices, and this test session
already fixed TensorFlow's devices (tests/conftest.py).
"""
import json
import os
import subprocess

import keras
import pytest

from crossbow_tf.data.embedded import load_embedded_mnist

from forking import PYTHON, forked_runs  # noqa: F401  (forked_runs: a fixture)

pytestmark = pytest.mark.usefixtures("forked_runs")   # TensorFlow imported once (tests/forking.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_keras_example_reaches_target_and_reloads_with_plain_keras(tmp_path):
    out = str(tmp_path / "cnn.keras")
    run = subprocess.run([PYTHON, os.path.join(ROOT, "examples", "keras_example.py"), "--out", out],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["test_accuracy"] >= 0.96
    assert result["reloaded_test_accuracy"] == pytest.approx(result["test_accuracy"], abs=1e-6)
    assert "Epoch 12/12" in run.stdout                     # Keras's own progress output
    # Reloaded here too: no crossbow code runs for the saved model.
    _, (x_test, y_test) = load_embedded_mnist()
    model = keras.models.load_model(out)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert accuracy == pytest.approx(result["test_accuracy"], abs=1e-6)
