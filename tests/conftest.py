"""Test session set-up: the CPU is split into 4 logical devices before TensorFlow starts.

TensorFlow fixes its device list once per process, so every test shares these 4 devices and picks
the subset it needs (see `cpu_devices`).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Before TensorFlow loads: no GPU, so that the suite runs the same on a GPU machine (its processes
# inherit it too). `pytest -m gpu` (tests/test_gpu.py) keeps the GPUs.
import sys  # noqa: E402


def _gpu_tests_asked(argv):
    """Whether ARGV selects the gpu marker (-m gpu, -m "gpu and not slow", -mgpu)."""
    for i, arg in enumerate(argv):
        expression = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:] if arg.startswith("-m") else ""
        if "gpu" in expression.replace("not gpu", ""):
            return True
    return False


GPU_TESTS = _gpu_tests_asked(sys.argv[1:])
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
else:
    # This process starts TensorFlow on every GPU (the CPU split below); without growth it would hold
    # their memory while the doctor's process, started by a gpu test, needs it.
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")

import pytest  # noqa: E402

from crossbow_tf.distribute.devices import split_cpu  # noqa: E402

NUM_TEST_DEVICES = 4
DEVICES = split_cpu(NUM_TEST_DEVICES)


# The files that take longest (wall seconds in one test process, from `tools/suite_cpu.py`'s
# profile), longest first. `--dist loadfile` hands each free test process the next file in
# collection order, so these run first and no process is left with a long one at the end while
# the others idle. xdist's own order (by number of tests) would put the few-test ones last.
LONGEST_FIRST = ("test_multiworker.py", "test_learner_optimizers.py", "test_keras_io_examples.py",
                 "test_checkpoint.py", "test_averaging_rules.py", "test_paper_configs.py", "test_fused.py",
                 "test_run_cli.py", "test_harness.py", "test_multiworker_trials.py", "test_mixed_precision.py",
                 "test_engine_reference.py", "test_fused_layers.py", "test_devices.py", "test_reproduce.py",
                 "test_loss_scaling.py", "test_packaging.py", "test_fused_checkpoint.py", "test_distributed_study.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist's reorder by number of tests: off
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu need a GPU machine: deselected (reported as such) unless -m selects them. The
    files of LONGEST_FIRST first, in its order; the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if GPU_TESTS:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture(autouse=True)
def float32_policy_after():
    """Keras's global policy is float32 again after each test: a run under mixed precision sets it for its
    process, as a Keras user does, and the next test in this process must not inherit it."""
    yield
    keras = sys.modules.get("keras")   # a test that never imported Keras changed nothing
    if keras is not None and keras.mixed_precision.global_policy().name != "float32":
        keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def cpu_devices():
    """The 4 logical CPU devices of the test session."""
    return list(DEVICES)


# With CROSSBOW_TEST_CPU_TIMES=FILE, every test appends "node id <TAB> CPU seconds <TAB> wall seconds"
# to FILE: the CPU of this process, of the subprocesses it waited for and of the processes the fork
# server reaped meanwhile (tests/forking.py), which a busy machine barely changes (tools/suite_cpu.py
# sums it per file; how the suite's time was cut: README).
CPU_TIMES = os.environ.get("CROSSBOW_TEST_CPU_TIMES")


def _cpu_seconds():
    import resource
    from forking import ForkServer
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + ForkServer.children_cpu()


if CPU_TIMES:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import time
        cpu, wall = _cpu_seconds(), time.monotonic()
        yield
        with open(CPU_TIMES, "a", encoding="utf-8") as f:
            f.write(f"{item.nodeid}\t{_cpu_seconds() - cpu:.2f}\t{time.monotonic() - wall:.2f}\n")
