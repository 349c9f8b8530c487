"""crossbow_tf.policy: the decisions config, engine and Keras path share, made without TensorFlow."""
import subprocess
import sys

from crossbow_tf import policy
from crossbow_tf.algorithms import SMA, ElasticAveragingSGD, LocalSGD, SynchronousSGD


def test_policy_and_config_decide_without_tensorflow():
    code = ("import sys\n"
            "from crossbow_tf import config, policy\n"
            "c = config.from_dict({'optimizer': {'name': 'adam'}, 'algorithm': {'name': 'easgd'}})\n"
            "assert config.noise_matching_on(c)\n"
            "assert policy.precision_refused('mixed_float16', 2, config.make_rule(c.algorithm)) is None\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_noise_matching_applies_exactly_to_adaptive_learners_of_rules_that_synchronise_every_iteration():
    rules = [SMA(), ElasticAveragingSGD(), LocalSGD(), SynchronousSGD(), SMA(sync_period=2),
             ElasticAveragingSGD(sync_period=3), LocalSGD(period=4), LocalSGD(local_after_epochs=1)]
    applies = [policy.noise_matching_excluded(True, rule) is None for rule in rules]
    assert applies == [True, True, True, False, False, False, False, False]
    assert all(policy.noise_matching_excluded(False, rule) == policy.NOISE_MATCHING_LINEAR for rule in rules)
    assert policy.noise_matching_excluded(True, SynchronousSGD()) == policy.NOISE_MATCHING_AT_CENTER
    assert policy.noise_matching_excluded(True, LocalSGD(period=4)) == policy.NOISE_MATCHING_PERIODIC
    assert [policy.noise_matching_on(s, True, SMA()) for s in ("auto", True, False)] == [True, True, False]
    assert [policy.noise_matching_on(s, False, SMA()) for s in ("auto", True, False)] == [False, True, False]


def test_the_optimizer_lists_are_the_signature_tables_and_the_engines():
    from crossbow_tf.engine import optimizers
    from crossbow_tf.optimizer_args import OPTIMIZER_ARGUMENTS
    assert policy.OPTIMIZER_NAMES == tuple(OPTIMIZER_ARGUMENTS) and len(policy.OPTIMIZER_NAMES) == 10
    assert [cls.__name__ for cls in optimizers.ELEMENTWISE] == list(policy.ELEMENTWISE_CLASS_NAMES)
    assert set(optimizers.NOT_ELEMENTWISE) == {"Lamb", "Adafactor", "Muon", "LossScaleOptimizer"}
    assert not set(policy.REFUSED_OPTIMIZERS) & set(policy.OPTIMIZER_NAMES)


def test_precision_and_divergence():
    periodic = [SMA(sync_period=2), ElasticAveragingSGD(sync_period=3), LocalSGD(period=4),
                LocalSGD(local_after_epochs=1)]
    assert all(policy.precision_refused("mixed_float16", 1, rule) is None for rule in periodic)
    assert [policy.precision_refused(p, 3, periodic[0]) is None for p in ("float32", "mixed_bfloat16", "mixed_float16")
            ] == [True, True, False]
    assert all(policy.precision_refused("mixed_float16", 3, rule) == policy.MIXED_FLOAT16_WORKERS for rule in periodic)
    assert all(policy.precision_refused("mixed_float16", 3, rule) is None
               for rule in (SMA(), ElasticAveragingSGD(), LocalSGD(), SynchronousSGD()))
    assert policy.divergence_refused("rollback", None) == policy.ROLLBACK_NEEDS_CHECKPOINTS
    assert policy.divergence_refused("rollback", "ckpt") is None and policy.divergence_refused("stop", None) is None
