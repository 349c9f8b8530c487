"""Which devices a run trains on, decided in one place and without TensorFlow.

The experiment (crossbow_tf.experiment), the stock baseline (baselines/tf_ssgd), CrossbowStrategy
and the harness's planning (crossbow_tf.compare.plan) all ask ``choose_devices``, so that one
config means the same k everywhere: every visible GPU when there is one, else ``logical_cpu``
logical CPU devices (1 when not given). ``logical_cpu`` splits the CPU only on a machine without
GPUs; given on a GPU machine it is ignored, and the choice carries one line saying so.

The harness asks before any TensorFlow starts (its trials run in their own processes), so this
module imports nothing of TensorFlow, and neither the engine nor the baselines' rules.
"""
import dataclasses
import functools
import os
import shutil
import subprocess
import sys

REDUCTIONS = ("auto", "nccl", "one_device", "hierarchical_copy")


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    device_type: str            # "GPU" or "CPU"
    count: int                  # the devices the run trains on (D)
    logical_cpu: int = None     # the logical CPU devices to split the CPU into (None: no split)
    note: str = None            # one line to print: logical_cpu given where it does not apply


def choose_devices(gpus, logical_cpu=None):
    """The devices of a run on a machine whose visible physical GPUS are given (a list of names, or
    their number), for the config's LOGICAL_CPU (None or a positive integer)."""
    count = gpus if isinstance(gpus, int) else len(gpus)
    if count:
        note = None
        if logical_cpu:
            note = (f"devices.logical_cpu: {logical_cpu} applies to machines without GPUs; this one trains on "
                    f"its {count} visible GPU(s) (choose them with CUDA_VISIBLE_DEVICES)")
        return DeviceChoice("GPU", count, None, note)
    return DeviceChoice("CPU", logical_cpu or 1, logical_cpu or None)


def reduction_problem(reduction, num_devices):
    """Why REDUCTION cannot sum NUM_DEVICES devices correctly, or None.

    TensorFlow's HierarchicalCopyAllReduce (cross_device_utils.aggregate_gradients_using_hierarchical_copy)
    sums two halves of D // 2 devices each, written for the DGX-1's 2 x 4 GPUs: with an odd D the
    last device's values are left out of the total every device receives, with no error."""
    if reduction == "hierarchical_copy" and num_devices > 1 and num_devices % 2:
        return (f"cross_device_reduction: hierarchical_copy needs an even number of devices (TensorFlow's "
                f"implementation drops the last of {num_devices}); use one_device or nccl, or "
                f"{num_devices - 1} or {num_devices + 1} devices")
    return None


def describe_devices(device_type, names, descriptions=(), reduction=None, logical=False):
    """The start line's device part: "2 x CPU (logical), one_device", "8 x GPU (A100-SXM4-80GB), nccl".

    DESCRIPTIONS: the devices' model names where known (GPUs); LOGICAL: CPU devices split from one."""
    kinds = sorted(set(d for d in descriptions if d))
    detail = ", ".join(kinds) if kinds else ("logical" if logical and len(names) > 1 else "")
    text = f"{len(names)} x {device_type}" + (f" ({detail})" if detail else "")
    return text + (f", {reduction}" if reduction else "")


# ---------------------------------------------------------------------------------------------
# The GPUs a process may use, without importing TensorFlow in this one.


def visible_gpu_ids(environ=None, ask_tensorflow=True):
    """The GPU ids this process may use (strings, as CUDA_VISIBLE_DEVICES takes them).

    CUDA_VISIBLE_DEVICES when set (empty or -1: none); else nvidia-smi's list; else, where
    nvidia-smi is not on PATH (a container with the driver's libraries only), the GPUs TensorFlow
    itself finds, asked in a child process so that this one does not load TensorFlow."""
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        ids = [g.strip() for g in value.split(",") if g.strip()]
        # CUDA stops at the first invalid id ("-1" is the usual way to hide every GPU).
        return ids[:next((i for i, g in enumerate(ids) if g.startswith("-")), len(ids))]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
            return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
        except (OSError, subprocess.SubprocessError):
            pass
    return [str(i) for i in range(_tensorflow_gpu_count())] if ask_tensorflow else []


@functools.lru_cache(maxsize=1)
def _tensorflow_gpu_count():
    code = ("import os; os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3'); import tensorflow as tf; "
            "print(len(tf.config.list_physical_devices('GPU')))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


# ---------------------------------------------------------------------------------------------
# In the training process (TensorFlow loads here, on first call): the choice applied.


def physical_gpus():
    """The physical GPUs TensorFlow sees (call before TensorFlow runs anything)."""
    import tensorflow as tf
    return tf.config.list_physical_devices("GPU")


def apply_choice(choice, split_cpu):
    """The logical device names CHOICE trains on; SPLIT_CPU(n) splits the CPU (and may start a cluster)
    when the choice asks for logical CPU devices."""
    import tensorflow as tf
    if choice.logical_cpu:
        split_cpu(choice.logical_cpu)
    names = [d.name for d in tf.config.list_logical_devices(choice.device_type)]
    # Without a split, one CPU device: the CPU may have been split for other uses in this process.
    return names if choice.device_type == "GPU" or choice.logical_cpu else names[:1]


def device_line(names, reduction=None):
    """The start line's device part for NAMES (this process's devices): the device type, the GPUs'
    model names (from TensorFlow's device details) and whether CPU devices are logical ones."""
    import tensorflow as tf
    device_type = "GPU" if names and all("GPU" in n.upper() for n in names) else "CPU"
    descriptions = []
    if device_type == "GPU":
        for gpu in tf.config.list_physical_devices("GPU"):
            try:
                descriptions.append(tf.config.experimental.get_device_details(gpu).get("device_name"))
            except (ValueError, RuntimeError):
                pass
    logical = device_type == "CPU" and len(tf.config.list_logical_devices("CPU")) > 1
    return describe_devices(device_type, names, descriptions, reduction, logical=logical)
