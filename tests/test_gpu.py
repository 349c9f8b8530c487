"""On a machine with GPUs (opt-in: ``pytest -m gpu``; tests/conftest.py deselects these otherwise and
keeps the GPUs visible when they are asked for): crossbow-doctor passes on the GPUs, and SMA on two
GPUs trains what the same learners train on one. Without the GPUs they need these tests fail, saying
so: they never skip, and nothing else in the suite stands in for them."""
import keras
import pytest
import tensorflow as tf

from crossbow_tf import doctor
from crossbow_tf.models import build_model
from tests.test_devices import few_digits, sma_run  # noqa: F401  (few_digits: a fixture used here)
from tests.test_doctor import run_doctor, verdict_lines

pytestmark = pytest.mark.gpu


def visible_gpus(needed=1):
    names = [d.name for d in tf.config.list_logical_devices("GPU")]
    assert len(names) >= needed, (f"pytest -m gpu needs {needed} GPU(s); TensorFlow sees {len(names)} here "
                                  "(python -m crossbow_tf.doctor says why)")
    return names


def test_the_doctor_passes_on_the_gpus():
    count = len(visible_gpus())
    result = run_doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = verdict_lines(result.stdout)
    assert list(lines) == list(doctor.CHECKS)
    status = {check: line[len(check):].split()[0].rstrip(":") for check, line in lines.items()}
    assert f"{count} x GPU" in lines["gpu"] and f"{count} x GPU" in lines["devices"]
    assert all(status[c] == doctor.OK for c in ("tensorflow", "gpu", "devices", "xla", "conv-forms", "float32"))
    # Where XLA's search found them (XLA may also compile without ptxas, through the driver).
    assert "ptxas: " in lines["xla"] and "libdevice: " in lines["xla"]
    assert lines["conv-forms"].endswith("device(s), cuDNN)")
    assert status["nccl"] == (doctor.OK if count >= 2 else doctor.SKIPPED)
    assert status["all-reduce"] == (doctor.OK if count >= 2 else doctor.SKIPPED)
    # The mixed policies run where the GPUs have the hardware for them, and are skipped with the reason.
    for policy in ("mixed_float16", "mixed_bfloat16"):
        assert status[policy] == doctor.OK or "needs compute capability" in lines[policy], lines[policy]


@pytest.fixture
def float32_matmuls():
    """Convolutions and matmuls in float32, not TensorFloat-32 (TensorFlow's default on Ampere and
    later, 10-bit mantissa): the two runs below take different cuDNN algorithms (one grouped
    convolution against two plain ones), and must agree to float32 rounding."""
    tf.config.experimental.enable_tensor_float_32_execution(False)
    yield
    tf.config.experimental.enable_tensor_float_32_execution(True)


def lenet():
    """The paper's LeNet: on GPUs its two convolutions of 2 learners run as grouped convolutions."""
    return build_model("lenet", (28, 28, 1), 10)


def test_sma_on_two_gpus_equals_one_gpu_with_the_same_learners(few_digits, float32_matmuls):  # noqa: F811
    gpus = visible_gpus(2)
    one = sma_run(few_digits, gpus[:1], 2, "auto", build=lenet)   # 2 learners on one GPU: no cross-device reduction
    two = sma_run(few_digits, gpus[:2], 1, "auto", build=lenet)   # 1 learner on each of 2 GPUs: NCCL
    keras.utils.set_random_seed(0)                                # the runs' start, as sma_run builds it
    start = [w.numpy() for w in lenet().trainable_weights]
    assert len(one) == len(two) == len(start)
    scale = max(abs(w).max() for w in one)
    # One grouped convolution of 2 learners against two plain ones, and NCCL's sum against none: the
    # runs differ by float32 rounding only, grown over the epoch's 6 iterations, far below what trained.
    apart = max(abs(a - b).max() for a, b in zip(one, two, strict=True))
    assert apart <= 1e-4 * scale, apart
    assert max(abs(a - s).max() for a, s in zip(one, start, strict=True)) > 1e-2
