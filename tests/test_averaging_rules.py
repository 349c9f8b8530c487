"""The averaging family beyond Crossbow (issue 17): decoupled central step, synchronisation periods,
local SGD with an outer optimizer, post-local SGD and the central loop's stability guard, each
against the NumPy transcription of its equations (numpy_reference.py)."""
import math
import signal

import keras
import numpy as np
import pytest

from crossbow_tf.algorithms import SMA, ElasticAveragingSGD, LocalSGD, central_loop_bound, largest_stable_alpha
from crossbow_tf.data import from_arrays
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.checkpoint import Checkpoints
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.schedule import StepSchedule
from crossbow_tf.engine.trainer import train
from crossbow_tf.errors import TrainingInterrupted
from crossbow_tf.results import RunResults
from numpy_reference import run_reference
from test_checkpoint import _problem
from test_engine_reference import B, CLASSES, LOSS, N, assert_engine_matches, small_mlp, toy_data

RATE = 0.1


_RUNS = {}


def run_engine(algorithm, devices, m, iterations_wanted, drops=(), jit_update=True):
    """JIT_UPDATE: as test_engine_reference.run_engine's (each rule setting under XLA at XLA_PLACEMENT).
    A run asked for again (the rules are frozen dataclasses, equal when their settings are) is the
    module's first one: its engine is only read afterwards, and each engine costs its tracing."""
    key = (algorithm, tuple(map(str, devices)), m, iterations_wanted, tuple(drops), jit_update)
    if key not in _RUNS:
        _RUNS[key] = _run_engine(algorithm, devices, m, iterations_wanted, drops, jit_update)
    return _RUNS[key]


def _run_engine(algorithm, devices, m, iterations_wanted, drops, jit_update):
    x, y = toy_data()
    model = small_mlp()
    params0 = [v.numpy() for v in model.trainable_variables]
    engine = Engine(model, LOSS, algorithm, CrossbowStrategy(devices=devices, learners_per_device=m),
                    jit_update=jit_update)
    k = engine.num_learners
    per_epoch = math.ceil(N / (k * B))
    epochs = math.ceil(iterations_wanted / per_epoch)
    data = from_arrays("toy", (x, y), (x, y), num_classes=CLASSES)
    train(engine, data, B, epochs, StepSchedule(RATE, list(drops), 0.1), RunResults("t", env={}),
          shuffle=False, log=lambda *a: None, learner_diagnostics=False)
    return engine, params0, x, y, k, epochs * per_epoch, per_epoch


def assert_matches(engine, z_ref, w_ref, params0):
    assert_engine_matches(engine, z_ref, w_ref, params0, atol=2e-5)


PLACEMENTS = [(1, 2), (2, 2), (4, 1)]
XLA_PLACEMENT = (1, 2)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"D{p[0]}xm{p[1]}")
@pytest.mark.parametrize("period", [1, 3])
def test_decoupled_central_step_matches_numpy(placement, period, cpu_devices):
    """Delta = beta * mean(s_j - z) with beta = 2.0, not Crossbow's sum of corrections (k*alpha = 0.8
    or 1.6 here); the bound at alpha 0.4 and mu_z 0.5 is 2.4."""
    D, m = placement
    rule = SMA(alpha=0.4, central_step=2.0, momentum=0.9, central_momentum=0.5, weight_decay=0.01,
               sync_period=period)
    engine, params0, x, y, k, iterations, _ = run_engine(rule, cpu_devices[:D], m, 8, drops=[4],
                                                         jit_update=placement == XLA_PLACEMENT)
    z_ref, w_ref = run_reference("sma", params0, x, y, k, B, iterations, RATE, [4], 0.1, mu=0.9, mu_z=0.5,
                                 wd=0.01, alpha=0.4, central_step=2.0, period=period)
    assert_matches(engine, z_ref, w_ref, params0)
    # And it is not Crossbow's coupling, which the reference computes with central_step None.
    z_coupled, _ = run_reference("sma", params0, x, y, k, B, iterations, RATE, [4], 0.1, mu=0.9, mu_z=0.5,
                                 wd=0.01, alpha=0.4, period=period)
    assert max(np.abs(a - b).max() for a, b in zip(engine.center_weights(), z_coupled)) > 1e-3


@pytest.mark.parametrize("algorithm", ["sma", "easgd"])
@pytest.mark.parametrize("period", [2, 3])
@pytest.mark.parametrize("placement", [(1, 2), (4, 1)], ids=lambda p: f"D{p[0]}xm{p[1]}")
def test_sync_period_matches_numpy(algorithm, period, placement, cpu_devices):
    D, m = placement
    if algorithm == "sma":
        rule = SMA(momentum=0.9, central_momentum=0.9, sync_period=period)
        kwargs = dict(mu=0.9, mu_z=0.9)
    else:
        rule = ElasticAveragingSGD(momentum=0.5, sync_period=period)
        kwargs = dict(mu=0.5)
    engine, params0, x, y, k, iterations, _ = run_engine(rule, cpu_devices[:D], m, 9,
                                                         jit_update=placement == XLA_PLACEMENT)
    z_ref, w_ref = run_reference(algorithm, params0, x, y, k, B, iterations, RATE, period=period, **kwargs)
    assert_matches(engine, z_ref, w_ref, params0)
    z_every, _ = run_reference(algorithm, params0, x, y, k, B, iterations, RATE, **kwargs)
    assert max(np.abs(a - b).max() for a, b in zip(engine.center_weights(), z_every)) > 1e-4


OUTER = {"local_sgd": dict(outer_learning_rate=1.0, outer_momentum=0.0, nesterov=False),
         "diloco": dict(outer_learning_rate=0.7, outer_momentum=0.9, nesterov=True),
         "heavy_ball": dict(outer_learning_rate=0.8, outer_momentum=0.6, nesterov=False)}


@pytest.mark.parametrize("outer", sorted(OUTER))
@pytest.mark.parametrize("period", [1, 3])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"D{p[0]}xm{p[1]}")
def test_local_sgd_matches_numpy(outer, period, placement, cpu_devices):
    D, m = placement
    o = OUTER[outer]
    rule = LocalSGD(period=period, momentum=0.9, weight_decay=0.01, **o)
    engine, params0, x, y, k, iterations, _ = run_engine(rule, cpu_devices[:D], m, 9,
                                                         jit_update=placement == XLA_PLACEMENT)
    z_ref, w_ref = run_reference("localsgd", params0, x, y, k, B, iterations, RATE, mu=0.9, wd=0.01, period=period,
                                 outer_lr=o["outer_learning_rate"], outer_mu=o["outer_momentum"], nesterov=o["nesterov"])
    assert_matches(engine, z_ref, w_ref, params0)


def test_local_sgd_with_period_1_is_synchronous_sgd_with_momentum_on_the_mean_gradient(cpu_devices):
    """At H = 1 with outer rate 1 and no outer momentum, z moves by the learners' mean velocity, which
    follows momentum on the mean gradient: S-SGD. (k = 2 learners of 4 divide the 40 examples, so every
    learner's share of the mean gradient is 1/k, as S-SGD weighs full batches.)"""
    # The run of test_local_sgd_matches_numpy[D1xm2-1-local_sgd] (10 iterations), shared.
    engine, params0, x, y, k, iterations, _ = run_engine(LocalSGD(period=1, momentum=0.9, weight_decay=0.01),
                                                         cpu_devices[:1], 2, 9)
    assert N % (k * B) == 0 and iterations == 10
    z_ssgd, _ = run_reference("ssgd", params0, x, y, k, B, iterations, RATE, mu=0.9, wd=0.01)
    assert_engine_matches(engine, z_ssgd, [z_ssgd] * k, params0, atol=2e-5)   # every learner restarted from z
    for learner in engine.learner_weights():
        for a, b in zip(learner, engine.center_weights(), strict=True):
            np.testing.assert_array_equal(a, b)


def test_post_local_sgd_synchronises_every_iteration_for_its_first_epochs(cpu_devices):
    rule = LocalSGD(period=3, momentum=0.9, local_after_epochs=1)
    engine, params0, x, y, k, iterations, per_epoch = run_engine(rule, cpu_devices[:2], 1, 12)
    assert per_epoch == 5   # then every third: iterations 5, 8, 11
    assert [rule.synchronises(t, per_epoch) for t in range(per_epoch + 4)] == [True] * 6 + [False, False, True]
    z_ref, w_ref = run_reference("localsgd", params0, x, y, k, B, iterations, RATE, mu=0.9,
                                 synchronised=lambda t: t < per_epoch or (t + 1) % 3 == 0)
    assert_matches(engine, z_ref, w_ref, params0)


# --- the compiled steps: no collective where nothing synchronises -----------------------------------

def _ops(function, *args):
    graph = function.get_concrete_function(*args).graph
    ops = [op.type for op in graph.get_operations()]
    for f in graph._functions.values():
        ops += [node.op for node in f.cached_definition.node_def]
    return ops


def test_a_local_step_moves_neither_z_nor_u_and_reads_no_other_device(cpu_devices):
    """Between synchronisations z and u stay bit for bit, and the compiled local step has no update
    of z, no cross-device reduction and no copy of a learner's weights to another device."""
    x, y = toy_data()
    engine = Engine(small_mlp(), LOSS, SMA(sync_period=4), CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=2))
    z0 = [v.numpy() for v in engine.center[1]]
    learners0 = engine.learner_weights()
    for t in range(3):
        engine.train_step(x[:16], y[:16], None, 0.1, iteration=t)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(z0, engine.center[1]))
    assert all(not v.numpy().any() for v in engine.center_velocity[0])
    assert any(not np.array_equal(a, b) for a, b in zip(learners0[0], engine.learner_weights()[0]))
    engine.train_step(x[:16], y[:16], None, 0.1, iteration=3)     # (3 + 1) % 4 == 0: synchronises
    assert any(not np.array_equal(a, v.numpy()) for a, v in zip(z0, engine.center[1]))
    args = (x[:16], y[:16], np.ones(16, np.float32), np.float32(0.1))
    local_ops = _ops(engine._local_step, *args)
    assert not any("Collective" in op or "Nccl" in op for op in local_ops)
    # Nothing but each device's scalar loss leaves its device: the graph reads z nowhere.
    graph = engine._local_step.get_concrete_function(*args).graph
    center_handles = {id(v.handle) for d in engine.center for v in d}
    captured = [t for t in graph.captures if id(t[0]) in center_handles]
    assert captured == []


def test_synchronising_and_local_iterations_follow_the_period_across_calls(cpu_devices):
    x, y = toy_data()
    engine = Engine(small_mlp(), LOSS, SMA(sync_period=3), CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2))
    moved = []
    for t in range(7):
        before = engine.center_weights()
        engine.train_step(x[:8], y[:8], None, 0.1)                 # the engine's own count
        moved.append(any(not np.array_equal(a, b) for a, b in zip(before, engine.center_weights())))
    assert moved == [False, False, True, False, False, True, False]
    assert engine.iteration == 7


# --- checkpoints between two synchronisations -------------------------------------------------------

class _StopAfter:
    """Stands in for StopSignals: a SIGTERM 'arrives' before iteration AT starts."""

    def __init__(self, at):
        self.at, self.reads, self.deferred = at, 0, False

    @property
    def received(self):
        self.reads += 1
        return signal.SIGTERM if self.reads > self.at else None


def _dropout_engine(devices, rule):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(3)])
    return Engine(model, LOSS, rule, CrossbowStrategy(devices=devices, learners_per_device=2))


def _everything(engine):
    return ([v.numpy() for v in engine.center[0] + engine.center_velocity[0]] +
            [v.numpy() for d in range(len(engine.weights)) for v in engine.weights[d] + engine.velocities[d]
             + engine.states[d]])


@pytest.mark.parametrize("rule", [SMA(alpha=0.2, central_step=1.5, sync_period=4),
                                  LocalSGD(period=4, outer_learning_rate=0.7, outer_momentum=0.9, nesterov=True)],
                         ids=["sma_decoupled_H4", "diloco_H4"])
def test_a_checkpoint_between_two_synchronisations_resumes_bit_identically(rule, cpu_devices, tmp_path):
    """Stopped after 6 iterations (synchronisations at iterations 3 and 7, so the learners have taken
    two local steps since), resumed from that checkpoint in a fresh engine: every variable ends
    equal, bit for bit."""
    data, schedule = _problem(), StepSchedule(0.1)   # 256 training examples: 8 iterations per epoch
    kwargs = dict(seed=0, log=lambda line: None, learner_diagnostics=False)
    reference = _dropout_engine(cpu_devices[:2], rule)
    train(reference, data, 8, 2, schedule, RunResults("r", {}, env={}), **kwargs)

    stopped = _dropout_engine(cpu_devices[:2], rule)
    checkpoints = Checkpoints(str(tmp_path / "c"), stopped)
    with pytest.raises(TrainingInterrupted) as e:
        train(stopped, data, 8, 2, schedule, RunResults("s", {}, env={}), checkpoints=checkpoints,
              stop_signals=_StopAfter(6), **kwargs)
    assert e.value.iteration == 6
    assert any(not np.array_equal(a, b) for a, b in zip(stopped.learner_weights()[0], stopped.center_weights()))

    resumed = _dropout_engine(cpu_devices[:2], rule)
    checkpoints = Checkpoints(str(tmp_path / "c"), resumed)
    results = RunResults("s", {}, env={})
    _, progress = checkpoints.restore_newest(results, log=lambda line: None)
    assert progress.iteration == 6
    train(resumed, data, 8, 2, schedule, results, checkpoints=checkpoints, progress=progress, **kwargs)
    for a, b in zip(_everything(resumed), _everything(reference), strict=True):
        assert a.tobytes() == b.tobytes()


# --- the stability guard --------------------------------------------------------------------------

def _spectral_radius(alpha, beta, mu):
    """Of the central loop's map (e, u) -> ((1 - alpha - beta) e - mu u, mu u + beta e)."""
    return max(abs(np.linalg.eigvals(np.array([[1 - alpha - beta, -mu], [beta, mu]]))))


@pytest.mark.parametrize("alpha, mu", [(0.0, 0.9), (0.1, 0.9), (0.3, 0.5), (0.05, 0.0)])
def test_the_bound_is_where_the_central_loop_stops_contracting(alpha, mu):
    bound = central_loop_bound(alpha, mu)
    assert _spectral_radius(alpha, bound * 0.999, mu) < 1 < _spectral_radius(alpha, bound * 1.001, mu)
    assert bound == pytest.approx((1 + mu) * (2 - alpha))


def test_the_study_runs_fall_where_the_bound_says():
    """The four runs at the edge in the reproduction study (k, alpha, trained?)."""
    for k, alpha, trained in [(128, 0.028, True), (32, 0.1, True), (32, 0.115, False), (128, 0.1, False)]:
        assert (k * alpha < central_loop_bound(alpha, 0.9)) == trained
    assert largest_stable_alpha(32, 0.9) == pytest.approx(0.112, abs=5e-4)
    assert largest_stable_alpha(128, 0.9) == pytest.approx(0.029, abs=5e-4)


def test_the_guard_refuses_at_and_past_the_bound_and_names_it():
    k = 32
    edge = largest_stable_alpha(k, 0.9)
    SMA(alpha=edge * 0.999).for_learners(k)                      # just below: accepted
    with pytest.raises(ValueError, match=r"SMA: the central loop is unstable: its central step k\*alpha = "
                                         r"32\*0\.115 = 3\.68 is at or past the bound \(1 \+ mu_z\)\(2 - alpha\) = "
                                         r"3\.581 .*largest stable alpha for k=32 is just below 0\.1121"):
        SMA(alpha=0.115).for_learners(k)
    with pytest.raises(ValueError, match="unstable"):
        SMA(alpha=edge).for_learners(k)                          # at the bound (within rounding): refused
    beta_edge = central_loop_bound(0.3, 0.9)
    SMA(alpha=0.3, central_step=beta_edge * 0.999).for_learners(k)
    with pytest.raises(ValueError, match=r"central step beta = 3\.23 is at or past.*largest stable central_step "
                                         r"for alpha 0\.3 is just below 3\.23"):
        SMA(alpha=0.3, central_step=beta_edge).for_learners(k)
    with pytest.raises(ValueError, match=r"EASGD: .*no central momentum"):
        ElasticAveragingSGD(alpha=0.1).for_learners(k)
    assert SMA(alpha=0.115, allow_unstable=True).for_learners(k).alpha == 0.115
    with pytest.raises(ValueError, match="unstable"):
        Engine(small_mlp(), LOSS, SMA(alpha=0.7), CrossbowStrategy(devices=["/CPU:0"], learners_per_device=4))


@pytest.mark.parametrize("rule, message", [
    (lambda: SMA(central_step=0.0), "SMA: central_step must be a finite number > 0 or None"),
    (lambda: SMA(sync_period=0), "SMA: sync_period must be at least 1"),
    (lambda: SMA(sync_period=2.5), "SMA: sync_period must be an integer"),
    (lambda: SMA(allow_unstable="yes"), "SMA: allow_unstable must be True or False"),
    (lambda: LocalSGD(period=0), "LocalSGD: period must be at least 1"),
    (lambda: LocalSGD(outer_learning_rate=0.0), "LocalSGD: outer_learning_rate must be a finite number > 0"),
    (lambda: LocalSGD(outer_momentum=1.0), r"LocalSGD: outer_momentum must be in \[0, 1\)"),
    (lambda: LocalSGD(local_after_epochs=-1), "LocalSGD: local_after_epochs must not be negative"),
])
def test_bad_rule_parameters_are_named(rule, message):
    with pytest.raises((TypeError, ValueError), match=message):
        rule()


# --- the Keras path: a rule instance, its period counted in Keras's iterations ------------------------

@pytest.mark.parametrize("rule, reference", [
    (SMA(alpha=0.3, central_step=2.0, sync_period=3), dict(algorithm="sma", mu_z=0.9, alpha=0.3, central_step=2.0,
                                                          period=3)),
    (LocalSGD(period=2, outer_learning_rate=0.7, outer_momentum=0.9, nesterov=True),
     dict(algorithm="localsgd", period=2, outer_lr=0.7, outer_mu=0.9, nesterov=True)),
], ids=["sma_decoupled_H3", "diloco_H2"])
def test_use_sma_takes_a_rule_and_fit_follows_its_period(rule, reference, cpu_devices):
    """fit over 2 epochs of 5 steps (the global batch 8 = 2 learners x 4): the period runs on across
    epochs, as Keras counts iterations, and z matches the NumPy transcription."""
    from crossbow_tf.keras import use_sma
    x, y = toy_data()
    model = small_mlp()
    params0 = [v.numpy() for v in model.trainable_variables]
    model.compile(optimizer=keras.optimizers.SGD(RATE, momentum=0.9), loss=LOSS)
    use_sma(model, CrossbowStrategy(devices=cpu_devices[:2], learners_per_device=1), algorithm=rule)
    model.fit(x, y, batch_size=2 * B, epochs=2, shuffle=False, verbose=0)
    z_ref, _ = run_reference(params0=params0, x=x, y=y, k=2, b=B, iterations=10, base_lr=RATE, mu=0.9, **reference)
    z = [v.numpy() for v in model.trainable_variables]
    assert len(z) == len(z_ref) == len(params0) > 0
    for got, want in zip(z, z_ref, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert max(np.abs(a - b).max() for a, b in zip(z, params0, strict=True)) > 1e-2


def test_use_sma_refuses_a_rule_that_contradicts_the_compiled_optimizer(cpu_devices):
    from crossbow_tf.keras import use_sma
    model = small_mlp()
    model.compile(optimizer=keras.optimizers.SGD(RATE, momentum=0.5), loss=LOSS)
    strategy = CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=2)
    with pytest.raises(ValueError, match=r"SMA\(momentum=0.8\) conflicts with the compiled optimizer's momentum=0.5"):
        use_sma(model, strategy, algorithm=SMA(momentum=0.8))
    with pytest.raises(ValueError, match=r"LocalSGD\(local_after_epochs=...\) is not supported by fit"):
        use_sma(model, strategy, algorithm=LocalSGD(local_after_epochs=1))
    with pytest.raises(ValueError, match="the central loop is unstable"):
        use_sma(model, strategy, algorithm=SMA(alpha=1.0))   # 2 x 1.0 >= 1.9 x 1.0
    with pytest.raises(ValueError, match="set them in the rule"):
        use_sma(model, strategy, algorithm=SMA(), alpha=0.1)


# --- the command line ---------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, message", [
    ({"name": "sma", "alpha": 0.1}, r"algorithm: the central loop is unstable: its central step k\*alpha = 128\*0.1 = "
                                    r"12.8 is at or past the bound \(1 \+ mu_z\)\(2 - alpha\) = 3.61 .*just below 0.02925"),
    ({"name": "sma", "alpha": 0.3, "central_step": 3.3}, r"central step beta = 3.3 is at or past the bound"),
    ({"name": "easgd", "alpha": 0.02}, r"the central loop is unstable: .*128\*0.02 = 2.56 .*no central momentum"),
    ({"name": "sma", "period": 4}, r"algorithm.period: applies to localsgd, not to sma"),
    ({"name": "localsgd", "central_step": 1.0}, r"algorithm.central_step: applies to sma, not to localsgd"),
    ({"name": "ssgd", "sync_period": 2}, r"algorithm.sync_period: applies to sma and easgd, not to ssgd"),
    ({"name": "localsgd", "allow_unstable": True}, r"algorithm.allow_unstable: applies to sma and easgd"),
    ({"name": "sma", "sync_period": 0}, r"algorithm.sync_period: must be at least 1"),
    ({"name": "localsgd", "outer_momentum": 1.0}, r"algorithm.outer_momentum: must be in \[0, 1\)"),
])
def test_the_command_line_refuses_with_one_line_and_exit_2(algorithm, message, tmp_path, capsys):
    import yaml
    from crossbow_tf.run import main
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(devices={"logical_cpu": 2}, learners_per_device=64, batch_size=8,
                                        algorithm=algorithm)))
    assert main(["--config", str(path), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("crossbow_tf: error: ")
    assert __import__("re").search(message, err), err


def test_allow_unstable_lets_the_command_line_check_pass(tmp_path, capsys):
    import yaml
    from crossbow_tf.run import main
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(devices={"logical_cpu": 2}, learners_per_device=64, batch_size=8,
                                        algorithm={"name": "sma", "alpha": 0.1, "allow_unstable": True})))
    assert main(["--config", str(path), "--check"]) == 0
