"""RecomputeBatchNorm: z evaluated with BatchNorm statistics recomputed on training batches."""
import keras
import numpy as np
import pytest

from crossbow_tf import CrossbowStrategy
from crossbow_tf.engine.diagnostics import recompute_batchnorm
from crossbow_tf.keras import RecomputeBatchNorm, get_training, use_sma


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 8)) * 3 + 1).astype("float32")
    y = (x[:, 0] > 1).astype("int32")
    return x, y


def _bn_model(seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, use_bias=False),
                              keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class SeesStatistics(keras.callbacks.Callback):
    """Records the first BatchNorm's moving mean at each validation's first batch (after recompute)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_test_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.seen.append(self.model.layers[1].moving_mean.numpy().copy())


def test_validation_and_the_fitted_model_use_recomputed_statistics(cpu_devices):
    x, y = _data()
    model = use_sma(_bn_model(), CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    recompute = RecomputeBatchNorm(x, batches=2, batch_size=64)
    seen = SeesStatistics()
    model.fit(x, y, batch_size=64, epochs=2, validation_data=(x[:64], y[:64]), callbacks=[recompute, seen],
              verbose=0)
    assert recompute.recomputed == 3 and len(seen.seen) == 2          # 2 validations + the end of fit
    engine = get_training(model).engine
    averaged = engine.center_states[0][0].numpy()                       # z's mean of the learners' statistics
    fitted = model.layers[1].moving_mean.numpy()
    assert not np.allclose(fitted, averaged)
    # The model now holds what recomputing on the same batches gives for z's weights.
    reference = _bn_model()
    reference.set_weights(model.get_weights())
    recompute_batchnorm(reference, iter(recompute._inputs))
    np.testing.assert_allclose(fitted, reference.layers[1].moving_mean.numpy(), rtol=1e-5, atol=1e-6)


def test_bad_arguments_name_the_parameter():
    x, _ = _data(16)
    with pytest.raises(ValueError, match="batches must be a positive integer"):
        RecomputeBatchNorm(x, batches=0)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        RecomputeBatchNorm(x, batch_size="64")
