"""python -m crossbow_tf.doctor (crossbow-doctor): the first command to run on a new machine.

It lists the devices TensorFlow sees and, where no GPU is visible, why; then it checks what a run
needs, each on every device a run would train on: XLA (on GPUs: ptxas and libdevice), NCCL, the
cross-device reductions, the fused path's grouped convolution, whether local multi-worker trials can
run in a private network namespace, and one tiny fused SMA step of the project's engine in each
precision. One verdict line per check: "ok", "skipped: why" or "FAILED: why,
and what to do". Exit code 0 when nothing failed, 1 when a check failed, 2 on bad arguments.
docs/gpu.md says what each verdict means.
"""
import argparse
import dataclasses
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time

from crossbow_tf import cli

OK, SKIPPED, FAILED = "ok", "skipped", "FAILED"
DEFAULT_LOGICAL_CPU = 2
LEARNERS_PER_DEVICE = 2
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
# The lowest compute capability on which each policy has the hardware it is meant for (float16 Tensor
# Cores from Volta, bfloat16 from Ampere); below it Keras's mixed precision runs slowly, if at all.
MIN_COMPUTE_CAPABILITY = {"mixed_float16": (7, 0), "mixed_bfloat16": (8, 0)}


@dataclasses.dataclass(frozen=True)
class Verdict:
    status: str     # OK, SKIPPED or FAILED
    detail: str = ""

    def line(self, check):
        """"CHECK   ok (detail)", "CHECK   skipped: why" or "CHECK   FAILED: why; what to do"."""
        if not self.detail:
            return f"{check:<15} {self.status}"
        return f"{check:<15} {self.status} ({self.detail})" if self.status == OK else \
            f"{check:<15} {self.status}: {self.detail}"


# ---------------------------------------------------------------------------------------------
# Why no GPU: a pure function of the facts, gathered separately.

@dataclasses.dataclass(frozen=True)
class GpuFacts:
    tensorflow_gpus: tuple = ()         # "name (compute capability x.y)" of each GPU TensorFlow sees
    cuda_visible_devices: str = None    # the variable's value; None: not set
    cpu_wheel: bool = False             # the tensorflow-cpu distribution is installed
    built_with_cuda: bool = True        # tf.test.is_built_with_cuda()
    nvidia_smi_gpus: tuple = None       # the GPUs nvidia-smi lists; None: nvidia-smi is not on PATH
    cuda_version: str = None            # TensorFlow's build info
    cudnn_version: str = None


def gpu_verdict(facts):
    """Verdict on the GPUs: ok with the GPUs TensorFlow sees; else why it sees none, FAILED where the
    machine has GPUs that TensorFlow cannot use, skipped where there are none (or they are hidden)."""
    build = f"CUDA {facts.cuda_version}, cuDNN {facts.cudnn_version}" if facts.built_with_cuda else ""
    smi, visible = facts.nvidia_smi_gpus, facts.cuda_visible_devices
    if facts.tensorflow_gpus:
        detail = f"{len(facts.tensorflow_gpus)} x GPU: {', '.join(facts.tensorflow_gpus)}"
        if smi and visible is None and len(smi) > len(facts.tensorflow_gpus):
            detail += (f"; nvidia-smi lists {len(smi)}: TensorFlow ignores GPUs below its minimum compute "
                       "capability (--verbose shows which)")
        return Verdict(OK, detail + (f"; TensorFlow built with {build}" if build else ""))
    ids = [g.strip() for g in (visible or "").split(",") if g.strip()]
    hidden = visible is not None and not [g for g in ids if not g.startswith("-")]
    if hidden:
        return Verdict(SKIPPED, f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
                       + (f" (nvidia-smi lists {len(smi)}); unset it, or name the GPUs to use" if smi else ""))
    if not smi:
        where = "nvidia-smi is not on PATH" if smi is None else "nvidia-smi lists none"
        wheel = ("; the CPU build tensorflow-cpu is installed" if facts.cpu_wheel else
                 "; this TensorFlow has no CUDA support" if not facts.built_with_cuda else "")
        return Verdict(SKIPPED, f"no GPU on this machine ({where}, TensorFlow sees none){wheel}; "
                       "training runs on the CPU")
    missing = [g for g in ids if g.isdigit() and int(g) >= len(smi)]
    if missing:
        return Verdict(FAILED, f"CUDA_VISIBLE_DEVICES={visible!r} names GPU {missing[0]}, but nvidia-smi lists "
                       f"{len(smi)} (ids 0-{len(smi) - 1}), and CUDA stops at the first id it cannot use: name "
                       "existing GPUs")
    machine = f"nvidia-smi lists {len(smi)} GPU(s) ({smi[0]}{', ...' if len(smi) > 1 else ''}) but TensorFlow sees none"
    if facts.cpu_wheel:
        return Verdict(FAILED, f"{machine}: the CPU build tensorflow-cpu is installed; "
                       "pip uninstall tensorflow-cpu, then pip install 'crossbow_tf[gpu]'")
    if not facts.built_with_cuda:
        return Verdict(FAILED, f"{machine}: this TensorFlow was built without CUDA; pip install 'crossbow_tf[gpu]' "
                       "(tensorflow[and-cuda]) in a fresh environment")
    return Verdict(FAILED, f"{machine}: its CUDA libraries did not load (TensorFlow built with {build}); "
                   "pip install 'tensorflow[and-cuda]' for the matching CUDA and cuDNN wheels, check the driver "
                   "with nvidia-smi, and rerun with --verbose to see which library TensorFlow could not open")


def _nvidia_smi_gpus():
    """nvidia-smi -L's GPU lines; None when nvidia-smi is not on PATH (or does not answer)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return tuple(line.split("(UUID")[0].strip() for line in out.splitlines() if line.startswith("GPU "))


def _installed(distribution):
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def gpu_details(gpu):
    """(model name, compute capability (major, minor) or None) of a physical GPU, from TensorFlow."""
    import tensorflow as tf
    try:
        details = tf.config.experimental.get_device_details(gpu)
    except (ValueError, RuntimeError):
        details = {}
    return details.get("device_name", gpu.name), details.get("compute_capability")


def gather_gpu_facts():
    import tensorflow as tf
    names = []
    for gpu in tf.config.list_physical_devices("GPU"):
        name, capability = gpu_details(gpu)
        names.append(f"{name} (compute capability {capability[0]}.{capability[1]})" if capability else name)
    info = tf.sysconfig.get_build_info()
    return GpuFacts(tuple(names), os.environ.get("CUDA_VISIBLE_DEVICES"), _installed("tensorflow-cpu"),
                    tf.test.is_built_with_cuda(), _nvidia_smi_gpus(), info.get("cuda_version"),
                    info.get("cudnn_version"))


# ---------------------------------------------------------------------------------------------
# Where XLA looks for ptxas and libdevice on a GPU (as TensorFlow 2.21's XLA searches: the
# --xla_gpu_cuda_data_dir of XLA_FLAGS first, then for ptxas the PATH, then its candidate CUDA roots
# (tsl::CandidateCudaRoots: /usr/local/cuda, /opt/cuda, the nvidia/cuda_nvcc (CUDA 13: nvidia/cu13)
# wheel beside tensorflow, the libdevice copy inside the tensorflow package, a conda prefix).

def cuda_data_dir(xla_flags):
    """The --xla_gpu_cuda_data_dir given in XLA_FLAGS, or None."""
    found = re.findall(r"--xla_gpu_cuda_data_dir=(\S+)", xla_flags or "")
    return found[-1] if found else None


def cuda_roots(data_dir, tensorflow_dir, cuda_version):
    wheel = "cu13" if str(cuda_version or "").startswith("13") else "cuda_nvcc"
    roots = [data_dir] if data_dir else []
    roots += ["/usr/local/cuda", "/opt/cuda", os.path.join(tensorflow_dir, "..", "nvidia", wheel),
              os.path.join(tensorflow_dir, "..", "..", "nvidia", wheel), os.path.join(tensorflow_dir, "cuda"),
              os.path.join(tensorflow_dir, "..", "..", "..", "..")]
    return [os.path.normpath(r) for r in roots]


def find_cuda_tools(data_dir, roots, path):
    """(ptxas, libdevice): the paths XLA would use, each None where none is found."""
    candidates = ([os.path.join(data_dir, "bin", "ptxas")] if data_dir else []) + \
        [os.path.join(p, "ptxas") for p in (path or "").split(os.pathsep) if p] + \
        [os.path.join(r, "bin", "ptxas") for r in roots]
    ptxas = next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)
    libdevice = next((os.path.join(r, "nvvm", "libdevice", "libdevice.10.bc") for r in roots
                      if os.path.isfile(os.path.join(r, "nvvm", "libdevice", "libdevice.10.bc"))), None)
    return ptxas, libdevice


def _xla_tools_line():
    import tensorflow as tf
    data_dir = cuda_data_dir(os.environ.get("XLA_FLAGS"))
    roots = cuda_roots(data_dir, os.path.dirname(tf.__file__), tf.sysconfig.get_build_info().get("cuda_version"))
    ptxas, libdevice = find_cuda_tools(data_dir, roots, os.environ.get("PATH"))
    return f"ptxas: {ptxas or 'not found'}, libdevice: {libdevice or 'not found'}", (ptxas, libdevice)


# ---------------------------------------------------------------------------------------------
# The checks. Each takes the context (the devices a run trains on) and returns a Verdict; an
# exception it raises is a FAILED verdict naming it.

@dataclasses.dataclass
class Context:
    devices: list           # logical device names a run would train on
    device_type: str        # "GPU" or "CPU"
    capabilities: list      # compute capability of each GPU (None where unknown); [] on CPU
    gpu: Verdict = None


def check_tensorflow(ctx):
    import keras
    import tensorflow as tf
    wheel = "tensorflow-cpu" if _installed("tensorflow-cpu") else "tensorflow"
    info = tf.sysconfig.get_build_info()
    build = (f"CUDA {info.get('cuda_version')}, cuDNN {info.get('cudnn_version')}" if tf.test.is_built_with_cuda()
             else "a CPU build")
    return Verdict(OK, f"TensorFlow {tf.__version__} from {wheel}, {build}; Keras {keras.__version__}")


def check_gpu(ctx):
    return ctx.gpu


def check_devices(ctx):
    from crossbow_tf.device_choice import device_line
    what = device_line(ctx.devices)   # as a run's start line names them
    rule = ("every visible GPU, as a run" if ctx.device_type == "GPU" else
            "no GPU: the CPU split by --logical-cpu, as a run by devices.logical_cpu")
    return Verdict(OK, f"{what}: {', '.join(ctx.devices)}; {rule}")


def _each_device(ctx, run):
    """RUN(device) on every device; the first failure as (device, message), else None."""
    for device in ctx.devices:
        try:
            problem = run(device)
        except Exception as e:   # noqa: BLE001  (any error of TensorFlow's is the verdict)
            problem = _first_line(e)
        if problem:
            return device, problem
    return None


def _first_line(error):
    # TensorFlow prefixes an op's error with the graph node it ran in: noise for the reader here.
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(error)).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def check_xla(ctx):
    import numpy as np
    import tensorflow as tf
    tools, (ptxas, libdevice) = _xla_tools_line() if ctx.device_type == "GPU" else ("", (None, None))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)

    def compile_on(device):
        with tf.device(device):
            got = tf.function(lambda t: tf.tanh(t) * 2.0 + tf.reduce_sum(t), jit_compile=True)(tf.constant(x)).numpy()
        want = np.tanh(x) * 2.0 + x.sum()
        return None if np.allclose(got, want, rtol=1e-5) else f"wrong result on {device}"
    failure = _each_device(ctx, compile_on)
    if failure is None:
        where = f"; {tools}" if tools else "; ptxas and libdevice are needed on GPUs only"
        return Verdict(OK, f"a jit_compile function compiled and ran on {len(ctx.devices)} device(s){where}")
    device, problem = failure
    advice = ""
    if ctx.device_type == "GPU" and (not ptxas or not libdevice or re.search("ptxas|libdevice", problem, re.I)):
        advice = ("set XLA_FLAGS=--xla_gpu_cuda_data_dir=/path/to/cuda (the folder with bin/ptxas and "
                  "nvvm/libdevice/libdevice.10.bc), or pip install nvidia-cuda-nvcc-cu12; ")
    return Verdict(FAILED, f"XLA on {device}: {problem}{'; ' + tools if tools else ''}; {advice}until then "
                   "runs fall back to the update without XLA (one line at the first step); jit_update: false "
                   "skips the attempt")


def _sum_check(cross_device_ops, devices):
    """Sums a distinct power of two per device with CROSS_DEVICE_OPS (exact in float32 up to 24 devices,
    and a device left out shows in the total): None if every device receives the exact total, else
    what it received."""
    import numpy as np
    import tensorflow as tf

    from crossbow_tf.distribute.reduce import all_reduce_sum
    values = [2.0 ** d for d in range(len(devices))]

    @tf.function(autograph=False)
    def reduce():
        per_device = []
        for device, value in zip(devices, values, strict=True):
            with tf.device(device):
                per_device.append([tf.fill([4], tf.constant(value, tf.float32))])
        return [tensors[0] for tensors in all_reduce_sum(cross_device_ops, per_device)]
    got = [r.numpy() for r in reduce()]
    want = np.full([4], sum(values), np.float32)
    wrong = [f"{d}: {g[0]:g}" for d, g in zip(devices, got, strict=True) if not np.array_equal(g, want)]
    if wrong or len(got) != len(devices):
        return f"expected {want[0]:g} on every device, got {', '.join(wrong)}"
    return None


def check_nccl(ctx):
    from crossbow_tf.distribute.devices import gpus_are_distinct_physical
    from crossbow_tf.distribute.reduce import cross_device_ops_for
    if ctx.device_type != "GPU" or len(ctx.devices) < 2:
        have = f"{len(ctx.devices)} GPU" if ctx.device_type == "GPU" else f"no GPU ({len(ctx.devices)} CPU devices)"
        return Verdict(SKIPPED, f"needs 2 GPUs, this machine has {have}; NCCL has no CPU kernel")
    if not gpus_are_distinct_physical(ctx.devices):
        return Verdict(SKIPPED, "the GPUs are split into logical devices, which NCCL refuses (two ranks on one "
                       "GPU): runs reduce with one_device")
    _, ops = cross_device_ops_for(ctx.devices, "nccl")
    try:
        problem = _sum_check(ops, ctx.devices)
    except Exception as e:   # noqa: BLE001
        problem = _first_line(e)
    if problem:
        return Verdict(FAILED, f"NCCL all-reduce over {len(ctx.devices)} GPUs: {problem}; check that the "
                       "nvidia-nccl wheel matches TensorFlow's CUDA (pip install 'tensorflow[and-cuda]'), or "
                       "set devices.cross_device_reduction: one_device")
    return Verdict(OK, f"NCCL all-reduce over {len(ctx.devices)} GPUs gave the exact sum on each")


def check_all_reduce(ctx):
    from crossbow_tf.device_choice import reduction_problem
    from crossbow_tf.distribute.reduce import cross_device_ops_for
    if len(ctx.devices) < 2:
        return Verdict(SKIPPED, "one device: nothing crosses devices")
    auto, _ = cross_device_ops_for(ctx.devices, "auto")
    done, refused = [], []
    for reduction in ("one_device", "hierarchical_copy"):
        if reduction_problem(reduction, len(ctx.devices)):
            refused.append(reduction)
            continue
        name, ops = cross_device_ops_for(ctx.devices, reduction)
        try:
            problem = _sum_check(ops, ctx.devices)
        except Exception as e:   # noqa: BLE001
            problem = _first_line(e)
        if problem:
            return Verdict(FAILED, f"{name} over {len(ctx.devices)} devices: {problem}; report it with this "
                           "output, and set devices.cross_device_reduction to another reduction")
        done.append(name)
    note = f"; {', '.join(refused)} refused on {len(ctx.devices)} devices (odd count)" if refused else ""
    return Verdict(OK, f"{' and '.join(done)} gave the exact sum on each of {len(ctx.devices)} devices{note}; "
                   f"runs use {auto} by default")


# The compute dtypes of PRECISIONS, and how far a form may be from float64 per learner in each (relative to
# the largest value): bfloat16 keeps 8 significand bits, float16 11; cuDNN may convolve float32 in TF32.
CONV_DTYPES = {"float32": 1e-2, "bfloat16": 5e-2, "float16": 1e-2}


def _conv_form_apart(device, form, dtype):
    """The largest relative difference of FORM's output and both gradients in DTYPE on DEVICE from one
    float64 convolution per learner (TensorFlow's own kernel, an independent computation)."""
    import numpy as np
    import tensorflow as tf

    from crossbow_tf.engine import conv_forms
    m, c, o = LEARNERS_PER_DEVICE, 3, 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 6, m * c))
    kernel = rng.normal(size=(3, 3, c, m * o))

    def results(form, dtype):
        with tf.device(device):
            xt, kt = tf.constant(x, dtype), tf.constant(kernel, dtype)
            with tf.GradientTape() as tape:
                tape.watch([xt, kt])
                y = conv_forms.convolve(form, xt, kt, m, 1, "SAME", 1)
                loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
            return [np.asarray(tf.cast(t, tf.float64)) for t in [y] + tape.gradient(loss, [xt, kt])]
    want = results(conv_forms.PER_LEARNER, tf.float64)
    return max(np.abs(g - w).max() / np.abs(w).max() for g, w in zip(results(form, dtype), want, strict=True))


def _conv_form_problem(device, form, dtype):
    apart = _conv_form_apart(device, form, dtype)
    return f"{apart:.1e} from float64 per learner" if apart > CONV_DTYPES[dtype] else None


def check_conv_forms(ctx):
    """The form the fused learners' convolutions take here in each policy's compute dtype (probed as the
    engine probes), its output and gradients against one float64 convolution per learner."""
    from crossbow_tf.engine import conv_forms
    chosen = []
    for dtype in CONV_DTYPES:
        try:
            form, _ = conv_forms.choose(dtype, ctx.device_type)
        except conv_forms.NoConvolutionForm as e:
            if dtype == "float32":
                return Verdict(FAILED, f"{e}; report it with this output")
            chosen.append(f"{dtype} none, so convolutional models refuse its policy ({e})")
            continue
        failure = _each_device(ctx, lambda device: _conv_form_problem(device, form, dtype))
        if failure:
            return Verdict(FAILED, f"the {form} form in {dtype} on {failure[0]}: {failure[1]}; report it with this "
                           f"output, and set {conv_forms.FORM_VARIABLE} to another form")
        grouped_not = conv_forms.why_not(ctx.device_type, dtype, conv_forms.GROUPED)
        chosen.append(f"{dtype} {form}" + (f" (grouped does not: {grouped_not})" if grouped_not else ""))
    kernels = "cuDNN" if ctx.device_type == "GPU" else \
        f"oneDNN {'on' if conv_forms.onednn_enabled() else 'off'}, {conv_forms.cpu_summary()}"
    return Verdict(OK, f"{'; '.join(chosen)}; each against float64 per learner on {len(ctx.devices)} device(s), "
                   f"{kernels}")


def _tiny_model():
    import keras
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(3)(x)
    # The last layer in float32, as Keras's mixed-precision guide recommends.
    return keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(x))


def precision_step(policy, devices, jit_update):
    """Two fused SMA steps of a tiny conv model under POLICY on DEVICES (m learners each), through
    the project's engine: None when the loss is finite, z moved and every device holds the same z
    after the step's all-reduce; else what went wrong."""
    import keras
    import numpy as np

    from crossbow_tf.algorithms import SMA
    from crossbow_tf.distribute import CrossbowStrategy
    from crossbow_tf.engine.core import Engine
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = _tiny_model()
    finally:
        keras.mixed_precision.set_global_policy(previous)
    strategy = CrossbowStrategy(devices=devices, learners_per_device=LEARNERS_PER_DEVICE)
    engine = Engine(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), SMA(), strategy,
                    learners="fused", jit_update=jit_update, loss_scale=policy == "mixed_float16",
                    # A scale that leaves a tiny model's float16 gradients finite at the first step.
                    initial_scale=2.0 ** 8)
    start = engine.center_weights()
    rng = np.random.default_rng(0)
    rows = engine.num_learners * 4
    # Two steps: SMA moves z by the learners' distance from it, which the first step creates.
    for _ in range(2):
        loss, _ = engine.train_step(rng.normal(size=(rows, 8, 8, 3)).astype(np.float32),
                                    rng.integers(0, 3, rows).astype(np.int32), None, 0.1)
    if not np.isfinite(float(loss)):
        return f"the loss is {float(loss)}"
    centers = [[z.numpy() for z in engine.center[d]] for d in range(len(devices))]
    if max(np.abs(a - b).max() for a, b in zip(centers[0], start, strict=True)) == 0:
        return "z did not move"
    apart = [devices[d] for d in range(1, len(devices))
             if not all(np.array_equal(a, b) for a, b in zip(centers[0], centers[d], strict=True))]
    return f"z differs between {devices[0]} and {', '.join(apart)} after the all-reduce" if apart else None


def check_precision(policy):
    def check(ctx):
        from crossbow_tf.engine import conv_forms
        low = [c for c in ctx.capabilities if c and tuple(c) < MIN_COMPUTE_CAPABILITY.get(policy, (0, 0))]
        if low:
            need = MIN_COMPUTE_CAPABILITY[policy]
            return Verdict(SKIPPED, f"{policy} needs compute capability {need[0]}.{need[1]} for its speed; these "
                           f"GPUs have {low[0][0]}.{low[0][1]}: train in float32")
        try:
            # oneDNN says, as an error line, that float16 falls back to Eigen on CPUs without AVX-512:
            # expected here, and the verdict is the check's.
            with cli._filtered_stderr(lambda line: "oneDNN supports DT_HALF only" in line):
                problem = precision_step(policy, ctx.devices, jit_update=ctx.device_type == "GPU")
        except conv_forms.NoConvolutionForm as e:
            return Verdict(SKIPPED, f"convolutional models refuse {policy} here: {e}")
        except Exception as e:   # noqa: BLE001
            problem = _first_line(e)
        if problem:
            return Verdict(FAILED, f"fused SMA steps under {policy}: {problem}; run float32 (precision: float32) "
                           "and report this output")
        learners = len(ctx.devices) * LEARNERS_PER_DEVICE
        return Verdict(OK, f"two fused SMA steps of {learners} learners on {len(ctx.devices)} device(s), "
                       "z the same on each")
    return check


def check_workers(ctx):
    """Whether the harness's local multi-worker trials can run in a private network namespace here
    (docs/multiworker.md#security), tried as they would run; and what this shell's TF_CONFIG exposes."""
    import contextlib
    import json

    from crossbow_tf.compare import netns
    from crossbow_tf.distribute.exposure import SECURITY_DOC, is_loopback, split_address
    with contextlib.ExitStack() as stack:
        try:
            net, detail = netns.private_or_exposed(stack)
        except netns.ExposureRefused as e:
            return Verdict(FAILED, f"every local multi-worker trial would be refused: {e}")
        if net is not None:
            # A worker enters it and listens on every interface, as TensorFlow's server does.
            listener = "import socket; socket.create_server(('0.0.0.0', 0))"
            try:
                done = subprocess.run(net.prefix(0) + [sys.executable, "-c", listener], capture_output=True,
                                      text=True, timeout=60)
                error = None if done.returncode == 0 else _first_line(done.stderr or "no output")
            except (OSError, subprocess.TimeoutExpired) as e:
                error = _first_line(e)
            if error is not None:
                return Verdict(FAILED, f"a worker could not start in {net.name(0)} ({error}): local multi-worker "
                                       "trials would fail there; report this output")
            how = "as root, with ip netns" if isinstance(net, netns.PrivateLoopback) else "in a user namespace"
            detail = f"local multi-worker trials run in a private network namespace with only loopback ({how})"
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
    except (ValueError, AttributeError):
        cluster = {}
    addresses = [a for tasks in cluster.values() if isinstance(tasks, list) for a in tasks if isinstance(a, str)]
    others = sorted({host for host, _ in map(split_address, addresses) if not is_loopback(host)})
    if others:
        ports = sorted({split_address(a)[1] for a in addresses})
        detail += (f"; this shell's TF_CONFIG names other hosts ({', '.join(others)}): each worker's server accepts "
                    f"unauthenticated connections on its port ({', '.join(ports)}) of every interface; limit those "
                    f"ports to the peers ({SECURITY_DOC})")
    return Verdict(OK, detail)


CHECKS = {
    "tensorflow": check_tensorflow,
    "gpu": check_gpu,
    "devices": check_devices,
    "xla": check_xla,
    "nccl": check_nccl,
    "all-reduce": check_all_reduce,
    "conv-forms": check_conv_forms,
    "workers": check_workers,
    **{policy: check_precision(policy) for policy in PRECISIONS},
}


# ---------------------------------------------------------------------------------------------

def parse_args(argv):
    from crossbow_tf.config import MAX_LOGICAL_CPU_DEVICES

    def logical_cpu(text):
        if not re.fullmatch(r"\d+", text.strip()) or not 1 <= int(text) <= MAX_LOGICAL_CPU_DEVICES:
            raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_LOGICAL_CPU_DEVICES}], got {text!r}")
        return int(text)

    p = cli.OneLineParser(prog="crossbow-doctor", description=__doc__.splitlines()[0])
    p.add_argument("--logical-cpu", type=logical_cpu, default=None, metavar="N",
                   help="on a machine without GPUs, split the CPU into N logical devices "
                        f"(default {DEFAULT_LOGICAL_CPU})")
    p.add_argument("--only", nargs="+", metavar="CHECK", choices=list(CHECKS),
                   help=f"run only these checks ({', '.join(CHECKS)})")
    cli.add_verbose_flag(p)
    return p.parse_args(argv)


def make_context(logical_cpu):
    """The devices a run would train on (crossbow_tf.device_choice) and the GPUs' facts; the CPU is
    split into logical devices before TensorFlow runs anything."""
    from crossbow_tf.device_choice import apply_choice, choose_devices, physical_gpus
    from crossbow_tf.distribute.devices import split_cpu
    gpus = physical_gpus()
    gpu = gpu_verdict(gather_gpu_facts())
    choice = choose_devices(gpus, logical_cpu if logical_cpu or gpus else DEFAULT_LOGICAL_CPU)
    if choice.note:
        print(f"note: {choice.note.replace('devices.logical_cpu', '--logical-cpu')}", flush=True)
    devices = apply_choice(choice, split_cpu)
    capabilities = [gpu_details(g)[1] for g in gpus] if choice.device_type == "GPU" else []
    return Context(devices, choice.device_type, capabilities, gpu)


def run_checks(ctx, names, out=print):
    """Runs the checks NAMES, printing one verdict line each; returns the verdicts by name."""
    verdicts = {}
    for name in names:
        try:
            verdict = CHECKS[name](ctx)
        except Exception as e:   # noqa: BLE001  (a check that breaks is a failed check, not a traceback)
            verdict = Verdict(FAILED, f"the check itself failed: {_first_line(e)}; report this output")
        verdicts[name] = verdict
        out(verdict.line(name), flush=True)
    return verdicts


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cli.quiet_tensorflow(args.verbose)
    start = time.perf_counter()
    try:
        cli.import_tensorflow(args.verbose)
    except Exception as e:   # noqa: BLE001  (a broken install is the first thing a doctor must name)
        print(Verdict(FAILED, f"TensorFlow does not import: {_first_line(e)}; reinstall in a fresh environment: "
                      "pip install 'crossbow_tf[gpu]' (or [cpu] on a machine without GPUs)").line("tensorflow"))
        return 1
    from crossbow_tf.errors import CrossbowError
    try:
        ctx = make_context(args.logical_cpu)
    except CrossbowError as e:
        print(f"crossbow-doctor: error: {e}", file=sys.stderr)
        return 2
    verdicts = run_checks(ctx, args.only or list(CHECKS))
    failed = [n for n, v in verdicts.items() if v.status == FAILED]
    skipped = [n for n, v in verdicts.items() if v.status == SKIPPED]
    summary = f"{len(failed)} FAILED ({', '.join(failed)})" if failed else "nothing failed"
    print(f"crossbow-doctor: {len(verdicts)} check(s), {summary}, {len(skipped)} skipped "
          f"({time.perf_counter() - start:.0f} s); docs/gpu.md says what each verdict means")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
