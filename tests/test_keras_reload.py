"""A model saved after SMA training reloads in plain Keras (a fresh process without crossbow_tf)
without any warning: the .keras file through load_model, a weights file (save_weights,
ModelCheckpoint) into a freshly compiled model."""
import json
import os
import subprocess
import sys

import keras
import numpy as np

from crossbow_tf import CrossbowStrategy
from crossbow_tf.keras import use_sma

RELOAD = r"""
import json, logging, sys, warnings
import numpy as np, keras
records = []
logging.getLogger().addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r.getMessage())})())
def make():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded = keras.models.load_model(sys.argv[1])
    fresh = make()
    fresh.load_weights(sys.argv[2])
    checkpointed = make()
    checkpointed.load_weights(sys.argv[3])
print(json.dumps({"warnings": [str(w.message) for w in caught], "logs": records,
                  "crossbow_imported": any(m.startswith("crossbow_tf") for m in sys.modules),
                  "weights": [[w.tolist() for w in m.get_weights()] for m in (loaded, fresh, checkpointed)],
                  "iterations": [int(m.optimizer.iterations) for m in (loaded, fresh, checkpointed)]}))
"""


def test_sma_trained_model_reloads_in_plain_keras_without_warnings(cpu_devices, tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    use_sma(model, CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 8)).astype("float32"), rng.integers(0, 3, 256)
    checkpoint = str(tmp_path / "epoch.weights.h5")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(checkpoint, save_weights_only=True)])
    model.save(str(tmp_path / "m.keras"))
    model.save_weights(str(tmp_path / "m.weights.h5"))
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(tmp_path / "m.keras"), str(tmp_path / "m.weights.h5"),
                           checkpoint], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["crossbow_imported"]
    assert out["warnings"] == [] and "Skipping variable loading" not in proc.stderr, out["warnings"]
    assert not any("optimizer" in line for line in out["logs"]), out["logs"]
    z = model.get_weights()
    for weights in out["weights"]:
        for a, b in zip(weights, z):
            np.testing.assert_array_equal(np.array(a, dtype=b.dtype), b)
    assert out["iterations"] == [16, 16, 16]   # 2 epochs of 256 / (k*b = 32)
