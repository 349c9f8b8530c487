"""The harness plans each trial with the GPUs its slot will get (crossbow_tf.compare.plan.trial_gpus):
with --parallel and --gpus-per-trial on a GPU machine, k and the global batch of the plan are those
every slot trains (the runner refuses a trial whose k differs, tests/test_devices.py). The GPU machine
is given as a list of ids; nothing here runs on a GPU."""
import pytest

from crossbow_tf.compare import trials
from crossbow_tf.compare.plan import planned_shape, trial_gpus

EXPERIMENT = {"devices": {"logical_cpu": 2}, "learners_per_device": 4, "batch_size": 16}


@pytest.fixture
def eight_gpus(monkeypatch):
    monkeypatch.setattr(trials, "visible_gpus", lambda: [str(i) for i in range(8)])


@pytest.mark.parametrize("parallel, gpus_per_trial, devices", [(2, 4, 4), (4, None, 2), (3, 2, 2), (1, 2, 2)])
def test_every_slot_trains_the_k_that_was_planned(eight_gpus, parallel, gpus_per_trial, devices):
    planned = planned_shape("sma", EXPERIMENT, trial_gpus(parallel, gpus_per_trial))
    assert planned == (devices * 4, devices * 64)
    slots = trials.make_slots(parallel, gpus_per_trial)
    assert len(slots) == parallel
    for slot in slots:
        assert planned_shape("sma", EXPERIMENT, trials.slot_gpus(slot)) == planned
    # Planned with every GPU of the machine instead, k would be 8 x 4 on every slot: refused.
    assert planned_shape("sma", EXPERIMENT, [str(i) for i in range(8)]) != planned


def test_one_slot_plans_with_the_gpus_of_this_process(eight_gpus):
    assert trial_gpus(1) is None
    assert planned_shape("tf_ssgd", EXPERIMENT, trial_gpus(1)) == planned_shape("tf_ssgd", EXPERIMENT)


def test_without_gpus_slots_plan_the_logical_cpu_devices(monkeypatch):
    monkeypatch.setattr(trials, "visible_gpus", lambda: [])
    assert trial_gpus(2) == []                       # each slot's CUDA_VISIBLE_DEVICES is empty
    assert planned_shape("sma", EXPERIMENT, trial_gpus(2)) == (8, 128)
