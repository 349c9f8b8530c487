"""The registry in crossbow_tf.algorithms is the list of rules: use_sma takes every name in it, and a
rule added in a test (its class and its registration, nothing else) is accepted by the
configuration, use_sma and the harness."""
import dataclasses

import keras
import numpy as np
import pytest

from crossbow_tf.algorithms import ALGORITHMS, Rule, register, unregister
from crossbow_tf.errors import ConfigError
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.keras import get_training, use_sma
from test_engine_reference import LOSS, small_mlp, toy_data


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_use_sma_takes_every_registry_name(name, cpu_devices):
    x, y = toy_data()
    model = small_mlp()
    before = [v.numpy() for v in model.trainable_variables]
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS)
    use_sma(model, CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2), algorithm=name)
    assert isinstance(get_training(model).engine.algorithm, ALGORITHMS[name])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after = [v.numpy() for v in model.trainable_variables]
    assert max(np.abs(a - b).max() for a, b in zip(after, before, strict=True)) > 1e-3


# --- a rule added in a test: its class and its registration are all it takes --------------------

@dataclasses.dataclass(frozen=True)
class PullToMean(Rule):
    """Pull to the mean: each learner steps, then z moves to the learners' mean (test rule)."""
    momentum: float = 0.0
    weight_decay: float = 0.0
    sync_period: int = 1
    num_learners: int | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    name = "pull_to_mean"
    title = "pull to the mean"

    def __post_init__(self):   # the rule's own checks: the configuration constructs the rule to run them
        if self.sync_period < 1:
            raise ValueError(f"PullToMean: sync_period must be at least 1, got {self.sync_period!r}")

    def for_learners(self, num_learners):
        bound = dataclasses.replace(self)
        object.__setattr__(bound, "num_learners", num_learners)
        return bound

    def learner_step(self, w, v, g, lr):
        v = -lr * g if self.momentum == 0 else self.momentum * v - lr * (g + self.weight_decay * w)
        return w + v, (v if self.momentum else None)

    def local(self, w, v, g, z, lr, share=None):
        w, v = self.learner_step(w, v, g, lr)
        return w, v, (w - z) / self.num_learners

    def correct(self, w, stepped, z, share=None):
        return stepped, (stepped - z) / self.num_learners

    def central(self, z, u, total, lr):
        return z + total, u


@pytest.fixture
def pull_to_mean():
    register(PullToMean)
    try:
        yield PullToMean
    finally:
        unregister(PullToMean.name)


def test_a_rule_added_in_a_test_is_accepted_by_config_use_sma_and_the_harness(pull_to_mean, cpu_devices):
    from baselines import AVERAGING_METHODS, LEARNER_METHODS, METHOD_WORDS, METHODS
    from crossbow_tf import config as config_lib
    from crossbow_tf.compare.spec import parse_compare, run_config
    name = pull_to_mean.name
    # The configuration: its name, its parameters (sync_period is a key it shares), its checks.
    cfg = config_lib.from_dict({"algorithm": {"name": name, "sync_period": 2}})
    assert config_lib.make_rule(cfg.algorithm) == PullToMean(momentum=0.9, sync_period=2)   # the config's momentum
    assert name in config_lib.rule_keys()["sync_period"]
    with pytest.raises(ConfigError, match=f"algorithm.central_step: applies to sma, not to {name}"):
        config_lib.from_dict({"algorithm": {"name": name, "central_step": 1.0}})
    with pytest.raises(ConfigError, match=f"algorithm.allow_unstable: applies to sma and easgd .*not to {name}"):
        config_lib.from_dict({"algorithm": {"name": name, "allow_unstable": True}})
    with pytest.raises(ConfigError, match="algorithm.sync_period: must be at least 1"):
        config_lib.from_dict({"algorithm": {"name": name, "sync_period": 0}})
    # The harness: a method of its name, run by crossbow_tf.run with its algorithm.name.
    assert METHODS[name].module == "crossbow_tf.run" and METHODS[name].algorithm == name
    assert name in LEARNER_METHODS and name in AVERAGING_METHODS and METHOD_WORDS[name] == "pull to the mean"
    spec = parse_compare({"methods": {"sma": {}, name: {}}}, {"epochs": 1, "target_accuracy": 0.9})
    assert [e.method for e in spec.entries] == ["sma", name]
    full, _ = run_config({}, {}, name, {"algorithm.sync_period": 3}, seed=0, target=0.9, epochs=1, where="t")
    assert full["algorithm"]["name"] == name and full["algorithm"]["sync_period"] == 3
    # use_sma: by name, with the compiled SGD's momentum, and it trains.
    x, y = toy_data()
    model = small_mlp()
    before = [v.numpy() for v in model.trainable_variables]
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss=LOSS)
    use_sma(model, CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2), algorithm=name)
    rule = get_training(model).engine.algorithm
    assert isinstance(rule, PullToMean) and rule.momentum == 0.5 and rule.num_learners == 2
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after = [v.numpy() for v in model.trainable_variables]
    assert len(after) == len(before) == 4
    assert max(np.abs(a - b).max() for a, b in zip(after, before, strict=True)) > 1e-3


def test_an_unregistered_rule_is_refused_everywhere():
    """The registry decides: without its registration the test rule's name is unknown to all three."""
    from baselines import METHODS
    from crossbow_tf import config as config_lib
    assert PullToMean.name not in ALGORITHMS and PullToMean.name not in METHODS
    with pytest.raises(ConfigError, match="algorithm.name: unknown algorithm 'pull_to_mean'; choose sma, ssgd"):
        config_lib.from_dict({"algorithm": {"name": PullToMean.name}})
    model = small_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    with pytest.raises(ValueError, match="unknown algorithm 'pull_to_mean'"):
        use_sma(model, CrossbowStrategy(learners_per_device=1), algorithm=PullToMean.name)


def test_every_rule_states_the_contract():
    """Each registered rule is a frozen dataclass Rule whose parameters the configuration can set,
    and a rule with a central loop can be allowed past its bound."""
    from crossbow_tf.config import AlgorithmConfig
    keys = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    assert set(ALGORITHMS) == {"sma", "ssgd", "easgd", "localsgd"}
    for name, cls in ALGORITHMS.items():
        assert issubclass(cls, Rule) and cls.name == name and cls.title
        assert set(cls.config_keys()) <= keys, (name, set(cls.config_keys()) - keys)
        assert not cls.has_central_loop or "allow_unstable" in cls.config_keys()
        assert (cls.default_alpha(4) is None) == ("alpha" not in cls.config_keys()) or cls.gradient_at_center
    assert [n for n, c in ALGORITHMS.items() if c.has_central_loop] == ["sma", "easgd"]
    assert ALGORITHMS["sma"].default_alpha(8) == 1 / 8 and ALGORITHMS["easgd"].default_alpha(8) == 0.9 / 8
    assert [n for n, c in ALGORITHMS.items() if c().synchronises_every_iteration] == list(ALGORITHMS)
    assert not ALGORITHMS["localsgd"](period=1, local_after_epochs=1).synchronises_every_iteration


def test_register_refuses_what_is_not_a_rule():
    class NotARule:
        name = "x"
    with pytest.raises(TypeError, match="not a dataclass subclassing"):
        register(NotARule)

    @dataclasses.dataclass(frozen=True)
    class Impostor(PullToMean):
        name = "sma"
    with pytest.raises(ValueError, match="the name 'sma' is SMA's already"):
        register(Impostor)
