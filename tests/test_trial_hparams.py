"""A trial's TensorBoard hparams hold what applies to its method."""
from crossbow_tf.compare.runner import trial_hparams

EXPERIMENT = {"model": "lenet", "batch_size": 16, "learners_per_device": 4, "epochs": 2,
              "algorithm": {"name": "sma", "alpha": 0.1}, "learning_rate": {"base": 0.05}}


def test_tf_ssgd_hparams_lack_learners_and_the_averaging_rule():
    stock = trial_hparams("tf_ssgd", EXPERIMENT, {"lr_scaling": "none"}, "tf_ssgd", "t00", 0)
    assert "learners_per_device" not in stock and not [k for k in stock if k.startswith("algorithm.")]
    assert stock["tf_ssgd.lr_scaling"] == "none" and stock["learning_rate.base"] == 0.05 and stock["batch_size"] == 16
    sma = trial_hparams("sma", EXPERIMENT, None, "sma", "t00", 0)
    assert sma["learners_per_device"] == 4 and sma["algorithm.name"] == "sma" and sma["algorithm.alpha"] == 0.1
