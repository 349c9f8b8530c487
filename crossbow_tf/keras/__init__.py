"""model.fit integration: train a compiled Keras model with SMA, S-SGD or EASGD (see docs/keras.md)."""
from crossbow_tf.keras.batchnorm import RecomputeBatchNorm
from crossbow_tf.keras.sma import ALGORITHMS, CrossbowTraining, detach, get_training, use_sma

__all__ = ["ALGORITHMS", "CrossbowTraining", "RecomputeBatchNorm", "detach", "get_training", "use_sma"]
