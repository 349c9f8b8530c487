"""The devices a run trains on and how they reduce (issue 30): every accepted cross-device
reduction gives the same run, the device count means the same k everywhere, and the choice is
stated. GPU machines are given to the device-choice logic as lists; nothing here runs on a GPU."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from crossbow_tf.algorithms import SMA
from crossbow_tf.data import from_arrays, load_embedded_mnist
from crossbow_tf.device_choice import choose_devices, describe_devices, reduction_problem, visible_gpu_ids
from crossbow_tf.distribute import CrossbowStrategy
from crossbow_tf.engine.core import Engine
from crossbow_tf.engine.schedule import StepSchedule
from crossbow_tf.engine.trainer import train
from crossbow_tf.errors import ConfigError
from crossbow_tf.results import RunResults

from forking import forked_runs  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("forked_runs")   # TensorFlow imported once (tests/forking.py)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def few_digits():
    (x, y), (xt, yt) = load_embedded_mnist()
    return from_arrays("mnist", (x[:192], y[:192]), (xt[:64], yt[:64]), num_classes=10)


def small_convnet():
    """A convolution and a dense layer (kernels and biases of four shapes): what a reduction sums is a
    list of variables, which this has as LeNet does at a fraction of LeNet's tracing and compiling."""
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 5, strides=2, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(10)])


def sma_run(data, devices, learners_per_device, reduction, build=small_convnet):
    """BUILD's model (a small convnet), SMA, 192 digits, 1 epoch of batch 16 per learner, seed 0: z at the end."""
    keras.utils.set_random_seed(0)
    model = build()
    strategy = CrossbowStrategy(devices=devices, learners_per_device=learners_per_device,
                                cross_device_reduction=reduction)
    engine = Engine(model, LOSS, SMA(), strategy)
    train(engine, data, 16, 1, StepSchedule(0.05), RunResults("t", env={}), seed=0, log=lambda *a: None)
    return engine.center_weights()


def assert_same_weights(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)


@pytest.mark.parametrize("num_devices", [3, 4])
def test_every_accepted_reduction_gives_the_run_of_one_device(few_digits, cpu_devices, num_devices):
    # The reference has no cross-device reduction at all: the same k learners on one device.
    reference = sma_run(few_digits, cpu_devices[:1], num_devices, "auto")
    keras.utils.set_random_seed(0)
    start = [w.numpy() for w in small_convnet().trainable_weights]
    assert max(np.abs(r - s).max() for r, s in zip(reference, start, strict=True)) > 1e-3   # it trained
    accepted = [r for r in ("auto", "one_device", "hierarchical_copy") if not reduction_problem(r, num_devices)]
    assert accepted == (["auto", "one_device"] if num_devices == 3 else ["auto", "one_device", "hierarchical_copy"])
    for reduction in accepted:
        assert_same_weights(sma_run(few_digits, cpu_devices[:num_devices], 1, reduction), reference)


def test_tensorflow_hierarchical_copy_drops_a_device_of_three(cpu_devices):
    # Why it is refused: TensorFlow's own implementation, given 1, 10 and 100, returns 11.
    from tensorflow.python.distribute import values as values_lib
    ops = tf.distribute.HierarchicalCopyAllReduce(num_packs=1)
    per_device = []
    for d, value in zip(cpu_devices[:3], (1.0, 10.0, 100.0), strict=True):
        with tf.device(d):
            per_device.append(tf.constant([value]))
    value = values_lib.PerReplica(per_device)
    total = ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(value, value)])[0]
    assert [float(v.numpy()[0]) for v in total.values] != [111.0] * 3


def test_hierarchical_copy_on_an_odd_device_count_is_refused_in_one_line(cpu_devices):
    with pytest.raises(ConfigError, match=r"^cross_device_reduction: hierarchical_copy needs an even number "
                                          r"of devices \(TensorFlow's implementation drops the last of 3\)") as e:
        CrossbowStrategy(devices=cpu_devices[:3], cross_device_reduction="hierarchical_copy")
    assert "\n" not in str(e.value)
    from baselines.tf_ssgd import make_strategy
    with pytest.raises(ConfigError, match="hierarchical_copy needs an even number"):
        make_strategy(cpu_devices[:3], "hierarchical_copy")
    assert reduction_problem("hierarchical_copy", 1) is None and reduction_problem("hierarchical_copy", 8) is None


# ---------------------------------------------------------------------------------------------
# One meaning for the device count.

GPU_LISTS = [[], ["/physical_device:GPU:0"], [f"/physical_device:GPU:{i}" for i in range(8)]]


@pytest.mark.parametrize("gpus", GPU_LISTS, ids=lambda g: f"{len(g)}gpu")
@pytest.mark.parametrize("logical_cpu", [None, 2])
def test_device_choice_uses_every_gpu_else_the_logical_cpu_split(gpus, logical_cpu):
    choice = choose_devices(gpus, logical_cpu)
    if gpus:
        assert (choice.device_type, choice.count, choice.logical_cpu) == ("GPU", len(gpus), None)
        assert (choice.note is None) == (logical_cpu is None)
        if logical_cpu:
            assert choice.note == (f"devices.logical_cpu: 2 applies to machines without GPUs; this one trains on "
                                   f"its {len(gpus)} visible GPU(s) (choose them with CUDA_VISIBLE_DEVICES)")
    else:
        assert (choice.device_type, choice.count, choice.logical_cpu, choice.note) == (
            "CPU", logical_cpu or 1, logical_cpu, None)


@pytest.mark.parametrize("gpus", GPU_LISTS, ids=lambda g: f"{len(g)}gpu")
def test_the_harness_plans_k_with_the_devices_the_trial_gets(gpus):
    from crossbow_tf.compare.plan import planned_shape
    exp = {"devices": {"logical_cpu": 2}, "learners_per_device": 4, "batch_size": 16}
    devices = len(gpus) or 2
    assert planned_shape("sma", exp, gpus) == (devices * 4, devices * 64)
    assert planned_shape("tf_ssgd", exp, gpus) == (devices, devices * 16)
    assert planned_shape("sma", dict(exp, learners_per_device="auto"), gpus) == (None, None)


def test_visible_gpus_follow_cuda_visible_devices_and_ask_tensorflow_without_nvidia_smi(monkeypatch):
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) == [] == visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "-1"})
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]   # CUDA stops at an invalid id
    from crossbow_tf import device_choice
    from crossbow_tf.compare import trials
    monkeypatch.setattr(device_choice.shutil, "which", lambda name: None)
    monkeypatch.setattr(device_choice, "_tensorflow_gpu_count", lambda: 2)   # a GPU machine without nvidia-smi
    assert visible_gpu_ids({}) == ["0", "1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    slots = trials.make_slots(2)
    assert [s.env for s in slots] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]


@pytest.fixture(scope="module")
def tiny_trial(tmp_path_factory):
    from crossbow_tf.compare.spec import run_config
    folder = tmp_path_factory.mktemp("trial")
    rng = np.random.default_rng(0)
    np.savez(folder / "tiny.npz", x_train=rng.random((64, 28, 28, 1), dtype=np.float32),
             y_train=rng.integers(0, 10, 64), x_test=rng.random((32, 28, 28, 1), dtype=np.float32),
             y_test=rng.integers(0, 10, 32))
    experiment = dict(name="tiny", model="lenet", data={"name": "npz", "path": str(folder / "tiny.npz")},
                      devices={"logical_cpu": 2}, learners_per_device=1, batch_size=8, eval_batch_size=32,
                      learning_rate={"base": 0.05})
    exp, options = run_config(experiment, {}, "sma", {}, seed=0, target=0.99, epochs=1, where="test")
    return folder, exp, options


def test_the_harness_refuses_a_trial_given_more_devices_than_planned(tiny_trial):
    import os

    from crossbow_tf.compare import runner as runner_lib
    from crossbow_tf.compare.trials import Slot
    folder, exp, options = tiny_trial
    out = folder / "report"
    runner_lib.prepare_out_dir(str(out))
    runner = runner_lib.Runner(str(out), 2, out=open(os.devnull, "w"))
    # As planned: no GPU here (conftest empties CUDA_VISIBLE_DEVICES), 2 logical CPUs, k = 2.
    planned = runner.run("sma", exp, options, "sma", "planned", "planned", 0, 0.99, 300)
    assert planned.error is None and planned.summary is not None
    # The start line names the devices' type, that they are logical, and the reduction.
    assert "on 2 x CPU (logical), one_device" in (out / "runs" / "sma" / "planned.log").read_text()
    # Planned for the one GPU its slot names; on this machine the trial finds none and trains on
    # the 2 logical CPU devices, twice the learners planned, as a trial given 8 GPUs where 1 was meant.
    more = runner.run("sma", exp, options, "sma", "more", "more", 0, 0.99, 300,
                      slot=Slot(0, {"CUDA_VISIBLE_DEVICES": "0"}))
    assert more.summary is None
    assert more.error == "trained with k=2, global batch 16 on 2 device(s), planned k=1, global batch 8: refused"


def test_start_line_names_the_device_type_models_and_reduction():
    gpus = [f"/device:GPU:{i}" for i in range(8)]
    assert describe_devices("GPU", gpus, ["NVIDIA A100-SXM4-80GB"] * 8, "NCCL") == "8 x GPU (NVIDIA A100-SXM4-80GB), NCCL"
    assert describe_devices("GPU", gpus[:2], ["A", "B"]) == "2 x GPU (A, B)"
    assert describe_devices("CPU", ["/device:CPU:0", "/device:CPU:1"], (), "one_device", logical=True) == \
        "2 x CPU (logical), one_device"
    assert describe_devices("CPU", ["/device:CPU:0"]) == "1 x CPU"


# ---------------------------------------------------------------------------------------------
# The engine on several devices.

def small_engine(devices, m=1, **kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
    return Engine(model, LOSS, SMA(), CrossbowStrategy(devices=devices, learners_per_device=m), **kwargs)


def toy_batch(rows, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 6)).astype(np.float32), rng.integers(0, 3, rows).astype(np.int32)


def test_each_device_receives_its_own_slice_of_the_batch(cpu_devices):
    engine = small_engine(cpu_devices[:2], m=3)
    x, y = toy_batch(24)
    graph = engine._step.get_concrete_function(tf.constant(x), tf.constant(y), tf.ones([24]), tf.constant(0.1),
                                               None).graph
    split = [op for op in graph.get_operations() if op.type == "Unpack" and op.inputs[0].shape[:2] == (2, 3)]
    assert len(split) == 3 and all("CPU:0" in op.device for op in split)   # x, y and mask, cut on the host
    # No op on the second device reads the whole batch, as rows (24) or cut into devices (2 x 3 x 4).
    whole = [tuple(t.shape) for op in graph.get_operations() if op.device.endswith("CPU:1") for t in op.inputs
             if t.shape.rank and (t.shape[0] == 24 or t.shape[:2] == (2, 3))]
    assert any(op.device.endswith("CPU:1") for op in graph.get_operations()) and whole == []


def test_jit_compile_is_refused_with_nccl(cpu_devices, monkeypatch):
    strategy = CrossbowStrategy(devices=cpu_devices[:2])
    monkeypatch.setattr(strategy, "reduction_name", "nccl")   # as on 2 distinct GPUs
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    with pytest.raises(ConfigError, match=r"^jit_compile: the NCCL all-reduce has no XLA kernel"):
        Engine(model, LOSS, SMA(), strategy, jit_compile=True)


def test_xla_failing_on_the_first_step_falls_back_to_the_same_update_without_xla(cpu_devices, capsys):
    x, y = toy_batch(8)
    reference = small_engine(cpu_devices[:2], jit_update=False)
    engine = small_engine(cpu_devices[:2], jit_update=True)

    def no_ptxas(*args):
        raise tf.errors.InternalError(None, None, "XLA compilation requires ptxas: Couldn't find ptxas")
    engine._local_update = no_ptxas   # what a GPU without CUDA's ptxas raises at the first launch
    for i in range(3):
        for e in (reference, engine):
            e.train_step(x, y, None, 0.1)
    assert capsys.readouterr().err.count("note: XLA failed on the first step") == 1
    assert (engine.jit_update, engine.jit_compile) == (False, False)
    assert_same_weights(engine.center_weights(), reference.center_weights())
    other = small_engine(cpu_devices[:2], jit_update=True)

    def not_xla(*args):
        raise tf.errors.InvalidArgumentError(None, None, "labels out of range")
    other._local_update = not_xla
    with pytest.raises(tf.errors.InvalidArgumentError, match="labels out of range"):
        other.train_step(x, y, None, 0.1)


def test_a_checkpoint_of_another_device_count_is_refused(cpu_devices, tmp_path):
    from crossbow_tf.engine.checkpoint import Checkpoints, Progress
    from crossbow_tf.errors import CheckpointError
    x, y = toy_batch(8)
    engine = small_engine(cpu_devices[:2])
    engine.train_step(x, y, None, 0.1)
    path = Checkpoints(str(tmp_path), engine).save(Progress(iteration=1), RunResults("t", env={}))
    same = Checkpoints(str(tmp_path), small_engine(cpu_devices[:2]))
    assert same.restore(path, RunResults("t", env={})).iteration == 1
    fewer = Checkpoints(str(tmp_path), small_engine(cpu_devices[:1]))
    message = (f"{path}: written by a run on 2 device(s), this one has 1: resume on 2 device(s) "
               "(devices.logical_cpu, or the GPUs in CUDA_VISIBLE_DEVICES)")
    with pytest.raises(CheckpointError) as e:
        fewer.restore(path, RunResults("t", env={}))
    assert str(e.value) == message
    with pytest.raises(CheckpointError) as e:
        fewer.restore_newest(RunResults("t", env={}), log=lambda *a: None)
    assert str(e.value) == message


# ---------------------------------------------------------------------------------------------
# The auto-tuner and cuDNN's forms of "out of memory".

CUDNN_ERRORS = [tf.errors.NotFoundError(None, None, "No algorithm worked!  Error messages: Profiling failure on "
                                                    "CUDNN engine 1: RESOURCE_EXHAUSTED: Out of memory"),
                tf.errors.UnknownError(None, None, "Failed to get convolution algorithm. This is probably because "
                                                   "cuDNN failed to initialize")]


@pytest.mark.parametrize("error", CUDNN_ERRORS, ids=["no_algorithm_worked", "failed_to_get_algorithm"])
def test_cudnn_out_of_memory_is_does_not_fit_for_the_tuner(error, cpu_devices, monkeypatch):
    from crossbow_tf.engine import autotune, core

    def trial(m):   # a GPU whose convolutions find no algorithm that fits from 3 learners on
        if m >= 3:
            raise error
        return 100.0 * m
    result = autotune.choose_learners(trial, threshold=0.1, max_learners=4)
    assert (result.chosen, result.curve, result.stopped) == (2, {1: 100.0, 2: 200.0, 3: None},
                                                             "m=3 does not fit in memory")
    # The real measurement turns it into DoesNotFit, as it does ResourceExhaustedError.
    monkeypatch.setattr(core, "Engine", lambda *args, **kwargs: (_ for _ in ()).throw(error))
    x, y = toy_batch(64)
    data = from_arrays("toy", (x, y), (x, y), num_classes=3)
    with pytest.raises(autotune.DoesNotFit, match="^3 learners per device: "):
        autotune.measure_throughput(lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)]), LOSS,
                                    SMA(), cpu_devices[:1], data.train, 4, 3)
    # The same exception types with other messages are real errors, not a full device.
    other = type(error)(None, None, "a file is missing")
    assert autotune.is_out_of_memory(error) and not autotune.is_out_of_memory(other)
    with pytest.raises(type(error), match="a file is missing"):
        autotune.choose_learners(lambda m: (_ for _ in ()).throw(other) if m == 2 else 100.0)
