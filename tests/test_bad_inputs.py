"""Every bad input gets one line naming the problem and exit code 2 (or, in the Python API, a
ValueError / TypeError naming the parameter), and no file changes.

The command-line cases call each command's main() in this process: they are refused before
TensorFlow starts any work, so no device split or training happens. A few end-to-end cases run the
real command in a subprocess. The test collects every case and what it gave as a Markdown table:
docs/bad_inputs.md's table must be that table (with CROSSBOW_TF_BAD_INPUTS_TABLE=1 the last test
rewrites it instead).
"""
import dataclasses
import hashlib
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from crossbow_tf.compare import cli as compare_tool  # noqa: E402
from crossbow_tf.compare import sweep as sweep_tool  # noqa: E402
from crossbow_tf.compare import reproduce as reproduce_tool  # noqa: E402
from baselines import crossbow_ssgd, easgd, tf_ssgd  # noqa: E402
from crossbow_tf import run as run_cli  # noqa: E402
from crossbow_tf.algorithms import SMA  # noqa: E402
from crossbow_tf.distribute import CrossbowStrategy  # noqa: E402
from crossbow_tf.engine.core import Engine  # noqa: E402
from crossbow_tf.keras import use_sma  # noqa: E402

with open(os.path.join(REPO, "configs", "lenet_mnist_cpu.yaml"), encoding="utf-8") as _f:
    HARNESS_YAML = _f.read()
with open(os.path.join(REPO, "configs", "lenet_fashion_mnist_cpu.yaml"), encoding="utf-8") as _f:
    STUDY_YAML = _f.read()   # crossbow-reproduce's study form (sweep.series)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@dataclasses.dataclass
class Case:
    name: str
    entry: str          # run | tf_ssgd | crossbow_ssgd | easgd | compare | sweep | api
    expect: object      # exit code 2, or the exception type of an API call
    message: str        # what the line must say
    args: tuple = ()    # command-line arguments ({dir} is the case's directory)
    files: dict = dataclasses.field(default_factory=dict)   # name -> text or bytes, written first
    call: object = None  # api: function(tmp_dir, devices) that must raise


def yaml_case(name, text, message, entry="run", args=(), files=None):
    return Case(name, entry, 2, message, ("--config", "{dir}/c.yaml") + tuple(args), dict(files or {}, **{"c.yaml": text}))


def harness(old, new):
    assert old in HARNESS_YAML
    return HARNESS_YAML.replace(old, new, 1)


def _sma_model(devices, **kw):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS)
    return use_sma(model, CrossbowStrategy(devices=devices[:2]), **kw)


OWN_FIT_MODEL = """
import keras
class OwnFit(keras.Model):
    def fit(self, *args, **kwargs):
        return super().fit(*args, **kwargs)
def build(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return OwnFit(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
"""

OWN_STEP_MODEL = """
import keras
class OwnStep(keras.Model):
    def train_step(self, data):
        return super().train_step(data)
def build(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    return OwnStep(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
"""


class OwnFit(keras.Model):
    def fit(self, *args, **kwargs):
        return super().fit(*args, **kwargs)


def _own_fit_model(devices):
    inputs = keras.Input((4,))
    model = OwnFit(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    return use_sma(model, CrossbowStrategy(devices=devices[:2]))


def _engine(devices, k=2):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    return Engine(model, LOSS, SMA(), CrossbowStrategy(devices=devices[:k]))


def _step(devices, rows=8, lr=0.1, mask=None):
    engine = _engine(devices)
    x, y = np.zeros((rows, 4)), np.zeros(rows, "int32")
    engine.train_step(x, y, np.ones(rows) if mask is None else mask, lr)


CASES = [
    # ---- crossbow_tf.run: the YAML file itself
    yaml_case("duplicate top-level key", "model: lenet\nmodel: vgg16\n", "duplicate key 'model' at line 2"),
    yaml_case("duplicate nested key", "algorithm: {name: sma, name: ssgd}\n", "duplicate key 'name'"),
    Case("non-UTF-8 file", "run", 2, "not a UTF-8 text file", ("--config", "{dir}/c.yaml"),
         {"c.yaml": b"model: lenet\n# caf\xe9 in Latin-1\n"}),
    yaml_case("YAML syntax error", "model: [unclosed\n", "not valid YAML"),
    yaml_case("top level is a list", "- model: lenet\n", "expected a mapping of settings"),
    Case("config file missing", "run", 2, "config file not found", ("--config", "{dir}/none.yaml")),
    yaml_case("unknown key", "model: lenet\nbogus: 1\n", "bogus: unknown key"),
    yaml_case("compare: section given to run", "model: lenet\ncompare: {seeds: [0]}\n",
              "compare: this section is read by crossbow-compare, not by crossbow_tf.run"),
    yaml_case("sweep: section given to run", "sweep: {}\n", "sweep: this section is read by crossbow-sweep"),
    yaml_case("tf_ssgd: section given to run", "tf_ssgd: {input: repeat}\n",
              "tf_ssgd: this section is read by python -m baselines.tf_ssgd"),
    # ---- types and finite numbers
    yaml_case("learning rate .nan", "learning_rate: {base: .nan}\n", "learning_rate.base: expected a finite number"),
    yaml_case("weight decay .inf", "algorithm: {weight_decay: .inf}\n",
              "algorithm.weight_decay: expected a finite number"),
    yaml_case("target accuracy -.inf", "target_accuracy: -.inf\n", "target_accuracy: expected a finite number"),
    yaml_case("alpha a string", "algorithm: {alpha: banana}\n", "algorithm.alpha: expected float or null, got 'banana'"),
    yaml_case("batch size a word", "batch_size: sixteen\n", "batch_size: expected an integer"),
    yaml_case("batch size not integral", "batch_size: 16.5\n", "batch_size: expected an integer, got 16.5"),
    yaml_case("devices given as a string", "devices: /device:CPU:0\n", "devices: expected a mapping"),
    yaml_case("stop_at_target a string", "stop_at_target: 'no'\n", "stop_at_target: expected true or false"),
    # ---- ranges and consistency
    yaml_case("alpha 0", "algorithm: {alpha: 0}\n", "alpha 0 never moves z"),
    yaml_case("alpha above 1", "algorithm: {alpha: 1.5}\n", "algorithm.alpha: must be in (0, 1]"),
    yaml_case("alpha negative", "algorithm: {alpha: -0.1}\n", "algorithm.alpha: must be in (0, 1]"),
    yaml_case("momentum 1", "algorithm: {momentum: 1}\n", "algorithm.momentum: must be in [0, 1)"),
    yaml_case("momentum negative", "algorithm: {momentum: -0.5}\n", "algorithm.momentum: must be in [0, 1)"),
    yaml_case("central momentum 1.0", "algorithm: {central_momentum: 1.0}\n",
              "algorithm.central_momentum: must be in [0, 1)"),
    yaml_case("unknown algorithm", "algorithm: {name: adam}\n", "algorithm.name: unknown algorithm 'adam'"),
    yaml_case("seed negative", "seed: -1\n", "seed: must be in [0, 4294967295]"),
    yaml_case("seed 2**32", "seed: 4294967296\n", "seed: must be in [0, 4294967295]"),
    yaml_case("epochs 0", "epochs: 0\n", "epochs: must be at least 1"),
    yaml_case("drop factor 0", "learning_rate: {drop_factor: 0}\n", "learning_rate.drop_factor: must be in (0, 1]"),
    yaml_case("drops not increasing", "learning_rate: {drops_at_epochs: [5, 2]}\n",
              "learning_rate.drops_at_epochs: must be positive and increasing"),
    yaml_case("learners option unknown", "learners: fast\n", "learners: unknown 'fast'"),
    yaml_case("logical CPU devices 0", "devices: {logical_cpu: 0}\n", "devices.logical_cpu: must be in [1, 64]"),
    yaml_case("logical CPU devices 1000", "devices: {logical_cpu: 1000}\n", "devices.logical_cpu: must be in [1, 64]"),
    yaml_case("learners per device 5000", "learners_per_device: 5000\n", "learners_per_device: at most 1024"),
    yaml_case("batch larger than the training set", "batch_size: 5000\n",
              "1 learner(s) x batch 5000 = 5000 examples per iteration, more than the 4000 training examples"),
    yaml_case("learners x batch larger than the training set",
              "devices: {logical_cpu: 2}\nlearners_per_device: 200\nbatch_size: 16\n",
              "400 learner(s) x batch 16 = 6400 examples per iteration"),
    yaml_case("autotune threshold as a percentage", "autotune: {threshold: 10}\n", "autotune.threshold: must be a fraction"),
    yaml_case("unknown cross-device reduction", "devices: {cross_device_reduction: fast}\n",
              "devices.cross_device_reduction: unknown 'fast'"),
    # ---- crossbow_tf.run: command line and output paths
    Case("--epochs not a number", "run", 2, "argument --epochs: invalid int value: 'abc'", ("--epochs", "abc")),
    Case("--seed negative", "run", 2, "command line: seed: must be in", ("--seed", "-5")),
    Case("--logical-cpu-devices 0", "run", 2, "command line: devices.logical_cpu", ("--logical-cpu-devices", "0")),
    Case("--learners-per-device banana", "run", 2, "command line: learners_per_device",
         ("--learners-per-device", "banana")),
    Case("unknown option", "run", 2, "unrecognized arguments: --learning-rate 0.1", ("--learning-rate", "0.1")),
    Case("--results exists without --force", "run", 2, "results file exists; choose a new name or pass --force",
         ("--results", "{dir}/r.json"), {"r.json": "precious"}),
    Case("--results is a directory", "run", 2, "is a directory; give the results file a file name",
         ("--results", "{dir}/sub", "--force"), {"sub/keep.txt": "x"}),
    Case("--results under a file", "run", 2, "is not a directory", ("--results", "{dir}/plain/r.json"),
         {"plain": "a file, not a directory"}),
    # ---- crossbow_tf.run --check: the data set and the model, before any device is made
    yaml_case("unknown data set (--check)", "data: {name: nope}\n", "unknown data set 'nope'", args=("--check",)),
    yaml_case("unknown model (--check)", "model: nope\n", "model: unknown model 'nope'", args=("--check",)),
    yaml_case("mnist without a data directory (--check)", "data: {name: mnist}\n", "needs --data-dir",
              args=("--check",)),
    yaml_case("mnist directory without its files (--check)", "data: {name: mnist, data_dir: '{dir}'}\n",
              "train-images-idx3-ubyte", args=("--check",)),
    yaml_case("optimizer argument Adam lacks", "optimizer: {name: adam, beta_3: 0.5}\n",
              "optimizer.beta_3: Adam takes no argument 'beta_3'"),
    yaml_case("optimizer argument Adam lacks (--check)", "optimizer: {name: adam, beta_3: 0.5}\n",
              "optimizer.beta_3: Adam takes no argument 'beta_3'", args=("--check",)),
    yaml_case("unknown precision", "precision: float8\n", "precision: unknown 'float8'; choose float32"),
    yaml_case("central_step negative", "algorithm: {name: sma, central_step: -1}\n",
              "algorithm.central_step: must be a finite number > 0 or null, got -1.0"),
    yaml_case("sync_period given to localsgd", "algorithm: {name: localsgd, sync_period: 2}\n",
              "algorithm.sync_period: applies to sma and easgd, not to localsgd"),
    yaml_case("noise_matching a word", "algorithm: {noise_matching: banana}\n",
              "algorithm.noise_matching: must be auto, true or false, got 'banana'"),
    yaml_case("tensorboard folder is a file", "tensorboard: '{dir}/taken'\n", "the TensorBoard folder is a file",
              files={"taken": "a file"}),
    Case("--tensorboard under a file", "run", 2, "is not a directory", ("--tensorboard", "{dir}/plain/tb"),
         {"plain": "a file, not a directory"}),
    yaml_case("npz file that is not one", "data: {name: npz, path: bad.npz}\n", "bad.npz: not an .npz file",
              files={"bad.npz": b"not a zip"}),
    yaml_case("npz file missing", "data: {name: npz, path: none.npz}\n", "none.npz: file not found"),
    yaml_case("model file: the name is not a function", "model: bad_models.py:NOT_A_FUNCTION\n",
              "NOT_A_FUNCTION is an int, not a function", files={"bad_models.py": "NOT_A_FUNCTION = 3\n"}),
    yaml_case("model file missing", "model: nofile.py:build\n", "model: nofile.py:build: file nofile.py not found"),
    yaml_case("model file: its class overrides fit", "model: own_fit.py:build\n",
              "returned a OwnFit, which overrides fit: crossbow_tf.run and the harness run the learners' step "
              "themselves and would drop that logic", files={"own_fit.py": OWN_FIT_MODEL}),
    yaml_case("model file: its own train_step under mixed_float16", "model: own_step.py:build\nprecision: mixed_float16\n",
              "precision: mixed_float16: OwnStep has a train_step of its own, whose loss the engine cannot scale",
              files={"own_step.py": OWN_STEP_MODEL}),
    yaml_case("model module missing", "model: no_such_module:build\n",
              "model: no_such_module:build: no module 'no_such_module'"),
    # ---- baselines
    yaml_case("tf_ssgd: unknown lr_scaling", "tf_ssgd: {lr_scaling: sqrt}\n", "tf_ssgd.lr_scaling: choose none or linear",
              entry="tf_ssgd"),
    yaml_case("tf_ssgd: batch larger than the training set", "batch_size: 4096\n",
              "1 replica(s) x batch 4096 = 4096 examples per iteration", entry="tf_ssgd"),
    yaml_case("tf_ssgd: duplicate key", "epochs: 1\nepochs: 2\n", "duplicate key 'epochs'", entry="tf_ssgd"),
    yaml_case("crossbow_ssgd: --batch-size 0", "model: lenet\n", "command line: batch_size: must be at least 1",
              entry="crossbow_ssgd", args=("--batch-size", "0")),
    yaml_case("crossbow_ssgd: --learning-rate nan", "model: lenet\n",
              "command line: learning_rate.base: expected a finite number", entry="crossbow_ssgd",
              args=("--learning-rate", "nan")),
    yaml_case("easgd: learners x batch larger than the training set", "learners_per_device: 64\nbatch_size: 128\n",
              "64 learner(s) x batch 128 = 8192 examples per iteration", entry="easgd"),
    yaml_case("easgd: --results exists", "model: lenet\n", "results file exists", entry="easgd",
              args=("--results", "{dir}/r.json"), files={"r.json": "precious"}),
    yaml_case("easgd: --epochs not a number", "model: lenet\n", "argument --epochs: invalid int value", entry="easgd",
              args=("--epochs", "1.5")),
    # ---- crossbow-compare and crossbow-sweep
    yaml_case("compare: budget 0", HARNESS_YAML, "compare.budget: expected a positive int", entry="compare",
              args=("--budget", "0", "--out", "{dir}/report")),
    yaml_case("compare: duplicate key", harness("  budget: 4\n", "  budget: 4\n  budget: 2\n"), "duplicate key 'budget'",
              entry="compare", args=("--out", "{dir}/report")),
    yaml_case("compare: no compare: section", "model: lenet\n", "no compare: section", entry="compare",
              args=("--out", "{dir}/report")),
    yaml_case("compare: .nan in a grid", harness("learning_rate.base: [0.02, 0.05]", "learning_rate.base: [.nan]"),
              "learning_rate.base: expected a finite number", entry="compare", args=("--out", "{dir}/report")),
    yaml_case("compare: seed 2**32", HARNESS_YAML, "seed: must be in [0, 4294967295]", entry="compare",
              args=("--seeds", "4294967296", "--out", "{dir}/report")),
    yaml_case("compare: --out is a file", HARNESS_YAML, "exists and is not a directory", entry="compare",
              args=("--out", "{dir}/taken"), files={"taken": "a file"}),
    yaml_case("compare: --budget not a number", HARNESS_YAML, "argument --budget: invalid int value", entry="compare",
              args=("--budget", "four")),
    yaml_case("compare: --storage bogus://nowhere", HARNESS_YAML, "--storage bogus://nowhere: not a storage URL",
              entry="compare", args=("--storage", "bogus://nowhere", "--out", "{dir}/report")),
    yaml_case("compare: --storage bogus://nowhere (--dry-run)", HARNESS_YAML,
              "--storage bogus://nowhere: not a storage URL", entry="compare",
              args=("--storage", "bogus://nowhere", "--out", "{dir}/report", "--dry-run")),
    yaml_case("compare: --storage in a missing folder", HARNESS_YAML,
              "--storage sqlite:///no/such/dir/s.db: the folder no/such/dir does not exist", entry="compare",
              args=("--storage", "sqlite:///no/such/dir/s.db", "--out", "{dir}/report")),
    yaml_case("compare: --parallel 0", HARNESS_YAML, "--parallel must be at least 1, got 0", entry="compare",
              args=("--parallel", "0", "--out", "{dir}/report")),
    yaml_case("sweep: --heartbeat 0", HARNESS_YAML, "--heartbeat must be at least 1, got 0", entry="sweep",
              args=("--heartbeat", "0", "--out", "{dir}/report")),
    yaml_case("compare: --hostfile missing", HARNESS_YAML, "--hostfile {dir}/hosts: No such file or directory",
              entry="compare", args=("--hostfile", "{dir}/hosts", "--out", "{dir}/report")),
    yaml_case("compare: --hostfile names no host", HARNESS_YAML, "--hostfile {dir}/hosts names no host",
              entry="compare", args=("--hostfile", "{dir}/hosts", "--out", "{dir}/report"),
              files={"hosts": "# no machine yet\n"}),
    yaml_case("sweep: --hosts with an empty name", HARNESS_YAML, "argument --hosts: 'node-a,,node-b' has an empty host name",
              entry="sweep", args=("--hosts", "node-a,,node-b", "--out", "{dir}/report")),
    yaml_case("compare: --hosts and --hostfile", HARNESS_YAML, "argument --hostfile: not allowed with argument --hosts",
              entry="compare", args=("--hosts", "node-a,node-b", "--hostfile", "{dir}/hosts", "--out", "{dir}/report"),
              files={"hosts": "node-a\n"}),
    yaml_case("sweep: --learners 0", HARNESS_YAML, "sweep.sma.learners: expected a non-empty list of integers >= 1",
              entry="sweep", args=("--learners", "0", "--out", "{dir}/report")),
    yaml_case("sweep: --seeds -1", HARNESS_YAML, "sweep.seeds: expected a non-empty list of integers >= 0",
              entry="sweep", args=("--seeds", "-1", "--out", "{dir}/report")),
    yaml_case("sweep: non-UTF-8 file", HARNESS_YAML.encode("utf-8") + b"# \xff\n", "not a UTF-8 text file",
              entry="sweep", args=("--out", "{dir}/report")),
    yaml_case("compare: --data-dir that is not there", harness("  name: mnist_embedded", "  name: mnist"),
              "{dir}/no-such-dir: data directory not found", entry="compare",
              args=("--data-dir", "{dir}/no-such-dir", "--out", "{dir}/report")),
    yaml_case("sweep: mnist without a data directory", harness("  name: mnist_embedded", "  name: mnist"),
              "data.data_dir: the mnist data set needs --data-dir", entry="sweep", args=("--out", "{dir}/report")),
    yaml_case("reproduce: --data-dir that is not there", STUDY_YAML, "{dir}/no-such-dir: data directory not found",
              entry="reproduce", args=("--data-dir", "{dir}/no-such-dir", "--out", "{dir}/report")),
    # ---- Python API: CrossbowStrategy
    Case("CrossbowStrategy(devices='/device:CPU:0')", "api", TypeError, "devices must be a list of device names, not a string",
         call=lambda tmp, d: CrossbowStrategy(devices="/device:CPU:0")),
    Case("CrossbowStrategy(devices=['/device:CPU:99']): a device no machine has", "api", ValueError,
         "devices: '/device:CPU:99' does not exist here", call=lambda tmp, d: CrossbowStrategy(devices=["/device:CPU:99"])),
    Case("CrossbowStrategy(devices=[a device twice])", "api", ValueError, "are the same device",
         call=lambda tmp, d: CrossbowStrategy(devices=[d[0], d[0].lower()])),
    Case("CrossbowStrategy(devices=[])", "api", ValueError, "devices: the list is empty",
         call=lambda tmp, d: CrossbowStrategy(devices=[])),
    Case("CrossbowStrategy(logical_cpu_devices=0)", "api", ValueError, "logical_cpu_devices must be in [1, 64], got 0",
         call=lambda tmp, d: CrossbowStrategy(logical_cpu_devices=0)),
    Case("CrossbowStrategy(logical_cpu_devices='2')", "api", TypeError, "logical_cpu_devices must be a positive integer",
         call=lambda tmp, d: CrossbowStrategy(logical_cpu_devices="2")),
    Case("CrossbowStrategy(devices=..., logical_cpu_devices=2)", "api", ValueError,
         "give devices or logical_cpu_devices, not both", call=lambda tmp, d: CrossbowStrategy(devices=d[:1], logical_cpu_devices=2)),
    Case("CrossbowStrategy(learners_per_device='banana')", "api", TypeError,
         "learners_per_device must be a positive integer, got 'banana'",
         call=lambda tmp, d: CrossbowStrategy(devices=d[:1], learners_per_device="banana")),
    Case("CrossbowStrategy(learners_per_device=0)", "api", ValueError, "learners_per_device must be a positive integer",
         call=lambda tmp, d: CrossbowStrategy(devices=d[:1], learners_per_device=0)),
    Case("CrossbowStrategy(cross_device_reduction='fast')", "api", ValueError, "cross_device_reduction must be one of",
         call=lambda tmp, d: CrossbowStrategy(devices=d[:2], cross_device_reduction="fast")),
    # ---- Python API: use_sma and the update rules
    Case("use_sma on a model whose class overrides fit", "api", ValueError,
         "OwnFit overrides fit, which use_sma cannot honour", call=lambda tmp, d: _own_fit_model(d)),
    Case("use_sma(alpha='banana')", "api", TypeError, "SMA: alpha must be a number, got 'banana'",
         call=lambda tmp, d: _sma_model(d, alpha="banana")),
    Case("use_sma(alpha=2)", "api", ValueError, "SMA: alpha must be in [0, 1] or None, got 2",
         call=lambda tmp, d: _sma_model(d, alpha=2)),
    Case("use_sma(central_momentum=1.0)", "api", ValueError, "SMA: central_momentum must be in [0, 1)",
         call=lambda tmp, d: _sma_model(d, central_momentum=1.0)),
    Case("use_sma(weight_decay=nan)", "api", ValueError, "SMA: weight_decay must be a finite number >= 0",
         call=lambda tmp, d: _sma_model(d, weight_decay=float("nan"))),
    Case("use_sma(learners='banana')", "api", ValueError, "learners must be \"auto\", \"fused\" or \"replicated\"",
         call=lambda tmp, d: _sma_model(d, learners="banana")),
    Case("use_sma(reset_on_lr_drop='yes')", "api", ValueError, "reset_on_lr_drop must be \"auto\", True or False",
         call=lambda tmp, d: _sma_model(d, reset_on_lr_drop="yes")),
    Case("SMA(momentum=1.0)", "api", ValueError, "SMA: momentum must be in [0, 1)", call=lambda tmp, d: SMA(momentum=1.0)),
    # ---- Python API: Engine
    Case("Engine(algorithm='sma')", "api", TypeError, "algorithm must be an update rule",
         call=lambda tmp, d: Engine(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]), LOSS, "sma",
                                    CrossbowStrategy(devices=d[:1]))),
    Case("Engine(learners='banana')", "api", ValueError, "learners must be \"auto\", \"fused\" or \"replicated\"",
         call=lambda tmp, d: Engine(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]), LOSS, SMA(),
                                    CrossbowStrategy(devices=d[:1]), learners="banana")),
    Case("Engine.train_step with 7 rows for k=2", "api", ValueError, "x has 7 rows; a global batch is k*b rows (k = 2",
         call=lambda tmp, d: _step(d, rows=7)),
    Case("Engine.train_step with a mask of the wrong length", "api", ValueError, "mask must have shape (8,)",
         call=lambda tmp, d: _step(d, mask=np.ones(6))),
    Case("Engine.train_step(lr=nan)", "api", ValueError, "lr must be a finite number >= 0, got nan",
         call=lambda tmp, d: _step(d, lr=float("nan"))),
    Case("Engine.train_step(lr='0.1')", "api", TypeError, "lr must be a number, got '0.1'",
         call=lambda tmp, d: _step(d, lr="0.1")),
]

ENTRY_POINTS = {"run": run_cli.main, "tf_ssgd": tf_ssgd.main, "crossbow_ssgd": crossbow_ssgd.main,
                "easgd": easgd.main, "compare": compare_tool.main, "sweep": sweep_tool.main,
                "reproduce": reproduce_tool.main}
COMMANDS = {"run": "python -m crossbow_tf.run", "tf_ssgd": "python -m baselines.tf_ssgd",
            "crossbow_ssgd": "python -m baselines.crossbow_ssgd", "easgd": "python -m baselines.easgd",
            "compare": "crossbow-compare", "sweep": "crossbow-sweep", "reproduce": "crossbow-reproduce",
            "api": "Python API"}
OUTCOMES = {}


def snapshot(root):
    """Every file under ROOT with a hash of its bytes (a changed, added or removed file shows)."""
    state = {}
    for here, _, names in os.walk(root):
        for name in names:
            path = os.path.join(here, name)
            with open(path, "rb") as f:
                state[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return state


def _write(root, files):
    for name, content in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode("utf-8").replace(b"{dir}", root.encode()) if isinstance(content, str) else content)


def test_at_least_forty_cases_across_every_entry_point():
    assert len(CASES) >= 40
    assert {c.entry for c in CASES} == set(ENTRY_POINTS) | {"api"}
    assert len({c.name for c in CASES}) == len(CASES)


# The commands' mode that validates without running (nothing trained, nothing written). Every case of
# these commands runs both ways and must give the same exit code and line. The baselines have no such
# mode: their cases run as the real command only.
CHECK_FLAGS = {"run": "--check", "compare": "--dry-run", "sweep": "--dry-run", "reproduce": "--dry-run"}
TWINS = {}   # case name -> the flag it was also run with or without ("" : no check mode)


def _call(entry, argv, capsys):
    """(exit code, stderr) of ENTRY's main(ARGV) in this process."""
    try:
        code = ENTRY_POINTS[entry](argv)
    except SystemExit as e:   # argparse
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err.strip()


def twin_argv(entry, argv):
    """ARGV with the entry's check flag added when absent, removed when present."""
    flag = CHECK_FLAGS[entry]
    return [a for a in argv if a != flag] if flag in argv else argv + [flag]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case, tmp_path, capsys, cpu_devices, monkeypatch):
    root = str(tmp_path)
    _write(root, case.files)
    monkeypatch.chdir(root)   # a command that wrongly wrote a default output would write here
    monkeypatch.setattr(sys, "dont_write_bytecode", True)   # a user's model file imported: no __pycache__
    before = snapshot(root)
    if case.entry == "api":
        with pytest.raises(case.expect) as info:
            case.call(root, cpu_devices)
        text = str(info.value)
        outcome = f"{type(info.value).__name__}: {text}"
    else:
        argv = [a.replace("{dir}", root) for a in case.args]
        code, text = _call(case.entry, argv, capsys)
        assert code == case.expect, (code, text[-2000:])
        assert len(text.splitlines()) == 1 and "Traceback" not in text, text
        outcome = f"exit {code}: {text.replace(root, '<dir>')}"
        if case.entry in CHECK_FLAGS:   # the same refusal with and without the check flag
            twin = twin_argv(case.entry, argv)
            assert snapshot(root) == before, "a file changed"
            assert _call(case.entry, twin, capsys) == (code, text), f"differs under {' '.join(twin[-3:])}"
        TWINS[case.name] = CHECK_FLAGS.get(case.entry, "")
    assert case.message.replace("{dir}", root) in text, text
    assert snapshot(root) == before, "a file changed"
    OUTCOMES[case.name] = outcome


def test_numbers_as_people_write_them_are_numbers(tmp_path):
    from crossbow_tf import config as config_lib
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 1e1\nlearning_rate: {base: 5e-2, drops_at_epochs: [1.0e1, 2E1]}\n"
                    "algorithm: {weight_decay: 1E-4}\neval_batch_size: 1_000\n")
    cfg = config_lib.load_config(str(path))
    assert cfg.epochs == 10 and isinstance(cfg.epochs, int)
    assert cfg.learning_rate.base == 0.05 and cfg.learning_rate.drops_at_epochs == [10.0, 20.0]
    assert cfg.algorithm.weight_decay == 1e-4 and cfg.eval_batch_size == 1000
    assert config_lib.parse_yaml("name: e5\nother: 1e\n") == {"name": "e5", "other": "1e"}   # words stay words


def bad_inputs_table():
    """The Markdown table of every case and what it gave (docs/bad_inputs.md's table)."""
    assert len(OUTCOMES) == len(CASES), "run the whole module: the table needs every case's outcome"
    rows = [TABLE_START, "|---|---|---|---|---|"]
    for i, case in enumerate(CASES, 1):
        given = " ".join(a.replace("{dir}", "<dir>") for a in case.args if a != "--config" and "c.yaml" not in a)
        text = OUTCOMES[case.name].replace("|", "\\|")
        config = case.files.get("c.yaml")
        if isinstance(config, str) and len(config) < 100:
            shown = config.strip().replace("{dir}", "<dir>").replace("\n", "; ")
            what = f"{case.name}: `{shown}`"
        elif config == STUDY_YAML:
            what = f"{case.name} (configs/lenet_fashion_mnist_cpu.yaml)"
        elif config is not None:
            what = f"{case.name} (configs/lenet_mnist_cpu.yaml, edited)" if "compare:" in str(config) else case.name
        else:
            what = case.name
        what = what.replace("|", "\\|")
        twin = TWINS.get(case.name)
        same = "–" if case.entry == "api" else f"the same with and without {twin}" if twin else "(no check mode)"
        rows.append(f"| {i} | {COMMANDS[case.entry]}{' ' + given if given else ''} | {what} | {text} | {same} |")
    return "\n".join(rows) + "\n"


TABLE_DOC = os.path.join(REPO, "docs", "bad_inputs.md")
TABLE_START = "| # | entry point | bad input | what it gives | checked without running |"


def test_the_committed_table_is_this_suites():
    """docs/bad_inputs.md's table is what the cases above give (runs after them). With
    CROSSBOW_TF_BAD_INPUTS_TABLE=1 it rewrites the file's table instead of comparing."""
    table = bad_inputs_table()
    with open(TABLE_DOC, encoding="utf-8") as f:
        text = f.read()
    assert TABLE_START in text, f"{TABLE_DOC}: no table header {TABLE_START!r}"
    header, committed = text[:text.index(TABLE_START)], text[text.index(TABLE_START):]
    if os.environ.get("CROSSBOW_TF_BAD_INPUTS_TABLE"):
        with open(TABLE_DOC, "w", encoding="utf-8") as f:
            f.write(header + table)
        return
    assert committed == table, ("docs/bad_inputs.md is stale: regenerate it with "
                                "CROSSBOW_TF_BAD_INPUTS_TABLE=1 python -m pytest -q tests/test_bad_inputs.py")


# ------------------------------------------------------------------------------------ end to end

def _start(*args, env=None, cwd=None):
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("TF_CPP_MIN_LOG_LEVEL", None)   # what a user's shell has: nothing
    full_env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd)


def _finish(proc, timeout=300):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _command(*args, env=None, cwd=None, timeout=300):
    return _finish(_start(*args, env=env, cwd=cwd), timeout)


def test_end_to_end_bad_config_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "c.yaml").write_text("model: lenet\nseed: 1\nseed: 2\n")
    proc = _command("-m", "crossbow_tf.run", "--config", str(tmp_path / "c.yaml"), "--results",
                    str(tmp_path / "r.json"), cwd=str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"crossbow_tf: error: {tmp_path / 'c.yaml'}: not valid YAML (duplicate key 'seed' at line 3, column 1)"]
    assert sorted(os.listdir(tmp_path)) == ["c.yaml"]


def test_end_to_end_check_is_quiet_and_verbose_shows_tensorflow(tmp_path):
    """--check validates the default experiment and its data from outside the checkout; TensorFlow's
    start-up lines appear only with --verbose."""
    started = [_start("-m", "crossbow_tf.run", "--check", *verbose, cwd=str(tmp_path)) for verbose in ([], ["--verbose"])]
    quiet, loud = [_finish(p) for p in started]   # the two processes side by side
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "lenet_mnist_embedded.yaml: valid; lenet on mnist_embedded (4000 train / 1000 test)" in quiet.stdout
    assert "cpu_feature_guard" not in quiet.stderr and "I0000" not in quiet.stderr, quiet.stderr
    assert loud.returncode == 0
    assert "cpu_feature_guard" in loud.stderr
    assert os.listdir(tmp_path) == []


def test_end_to_end_tool_error_is_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(HARNESS_YAML.replace("  budget: 4\n", "  budget: .inf\n"))
    proc = _command(os.path.join(REPO, "tools", "compare.py"), "--config", str(cfg), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"compare: error: {cfg}: compare.budget: expected a positive int, got inf"]
    assert sorted(os.listdir(tmp_path)) == ["c.yaml"]
