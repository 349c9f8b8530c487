"""The private Keras, TensorFlow and Optuna internals crossbow_tf uses, in one list, with the versions
they are tested on.

Each entry names an internal, where it is used and why no public API serves. A new Keras, TensorFlow
or Optuna may move or remove any of them without notice: ``missing()`` says which no longer
resolve, and tests/test_internals.py fails on an untested version whose internals moved.

Nothing here imports Keras, TensorFlow or Optuna at import time.
"""
import dataclasses
import importlib
import importlib.metadata
import itertools

# The versions every internal below is tested on, (oldest, newest): the oldest is pyproject.toml's lower
# bound (tests/test_internals.py holds the two equal), the newest the test suite's installed version.
# Only these ends are tested, so a lower bound moves down only with a CI run on that version.
TESTED_VERSIONS = {"keras": ("3.15.1", "3.15.1"), "tensorflow": ("2.21.0", "2.21.0"), "optuna": ("5.1.0", "5.1.0")}
# The distributions that may provide TensorFlow.
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly")


@dataclasses.dataclass(frozen=True)
class Internal:
    """A private name: ATTRIBUTE (dotted, may be empty) of what MODULE gives, or of an instance made by
    one of the factories below (OF: "layer", "functional", "optimizer", "model", "trial")."""
    library: str          # keras | tensorflow | optuna
    module: str
    attribute: str
    where: str            # the file that uses it, relative to crossbow_tf/
    why: str
    of: str = ""          # an instance attribute of this kind of object, not a module attribute

    @property
    def name(self):
        return f"{self.module}.{self.attribute}" if not self.of else f"<{self.of}>.{self.attribute}"


INTERNALS = (
    Internal("keras", "keras.src.backend", "AutocastScope", "engine/fused.py",
             "the scope in which layers read autocast variables in the compute dtype"),
    Internal("keras", "keras.src.backend.common.global_state", "get_global_attribute", "engine/fused.py",
             "the call context through which an outer layer's training flag reaches the layers it calls"),
    Internal("keras", "keras.src.backend.common.global_state", "set_global_attribute", "engine/fused.py",
             "(as get_global_attribute) its key current_call_ctx"),
    Internal("keras", "keras.src.backend.common.masking", "get_keras_mask", "engine/fused.py",
             "how layers read the mask attached to a tensor"),
    Internal("keras", "keras.src.backend.common.masking", "set_keras_mask", "engine/fused.py",
             "how layers attach a mask to a tensor"),
    Internal("keras", "keras.src.layers.layer", "CallContext", "engine/fused.py",
             "the call context a fused layer opens as Layer.__call__ does"),
    Internal("keras", "keras.src.layers.layer", "CallSpec", "engine/fused.py",
             "Layer.__call__'s reading of a call's arguments (masks, training)"),
    Internal("keras", "keras.src.backend.tensorflow.random", "_cast_seed", "engine/fused.py",
             "the seed Keras's stateless random ops take, per learner"),
    Internal("keras", "keras.layers", "_call_signature", "engine/fused.py", "Layer.__call__'s own signature",
             of="layer"),
    Internal("keras", "keras.layers", "_call_context_args", "engine/fused.py",
             "the arguments a layer takes from the call context", of="layer"),
    Internal("keras", "keras", "_run_through_graph", "engine/fused.py",
             "a Functional model's walk of its graph with each layer replaced", of="functional"),
    Internal("keras", "keras", "_nodes_by_depth", "engine/fused.py", "a Functional model's graph by depth",
             of="functional"),
    Internal("keras", "keras", "_inputs", "engine/fused.py", "a Functional model's input specs", of="functional"),
    Internal("tensorflow", "tensorflow.python.ops.parallel_for.pfor", "_pfor_converter_registry", "engine/fused.py",
             "which ops tf.vectorized_map can convert"),
    Internal("tensorflow", "tensorflow.python.ops.parallel_for.pfor", "RegisterPFor", "engine/fused.py",
             "registers a converter for the V2 stateless random ops Dropout uses"),
    Internal("tensorflow", "tensorflow.python.ops.parallel_for.pfor", "_convert_stateless_multinomial",
             "engine/fused.py", "TensorFlow's converter for the V1 stateless random ops (a loop over learners)"),
    Internal("keras", "keras.optimizers", "_learning_rate", "keras/sma.py",
             "the compiled optimizer's rate or schedule as given, not its current value", of="optimizer"),
    Internal("keras", "keras.optimizers", "_variables", "keras/sma.py",
             "the optimizer's variables, cut to those built before the learners'", of="optimizer"),
    Internal("keras", "keras", "_symbolic_build", "keras/sma.py", "builds a model on a data batch as fit does",
             of="model"),
    Internal("keras", "keras", "_loss_tracker", "keras/sma.py", "the mean loss fit reports", of="model"),
    Internal("keras", "keras", "_call_has_training_arg", "keras/sma.py",
             "whether the model's call takes training", of="model"),
    Internal("keras", "keras", "_jit_compile", "keras/sma.py",
             "switched off while the engine compiles its own step", of="model"),
    Internal("optuna", "optuna.trial", "_trial_id", "compare/trials.py",
             "the storage's id of a trial, which the storage API takes", of="trial"),
)


def installed_versions():
    """{library: installed version, or None}."""
    versions = {}
    for library in TESTED_VERSIONS:
        names = TENSORFLOW_DISTRIBUTIONS if library == "tensorflow" else (library,)
        versions[library] = None
        for name in names:
            try:
                versions[library] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def _release(version):
    """The numeric release of VERSION ("2.21.0rc1" -> (2, 21, 0)), for ordering."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
        if digits != part:
            break
    return tuple(parts)


def untested_versions():
    """{library: (installed, (oldest, newest) tested)} where the installed version is outside the tested range."""
    installed = installed_versions()
    return {lib: (installed[lib], ends) for lib, ends in TESTED_VERSIONS.items()
            if installed[lib] is None or not _release(ends[0]) <= _release(installed[lib]) <= _release(ends[1])}


def _instance(kind):
    import keras
    if kind == "layer":
        return keras.layers.Dense(1)
    if kind in ("functional", "model"):
        inputs = keras.Input((2,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        return model
    if kind == "optimizer":
        return keras.optimizers.SGD(0.1)
    if kind == "trial":
        import optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        return optuna.create_study().ask()
    raise ValueError(kind)


def missing():
    """The names (Internal.name) of the internals that no longer resolve in the installed versions."""
    gone, instances = [], {}
    for internal in INTERNALS:
        try:
            if internal.of:
                owner = instances.setdefault(internal.of, _instance(internal.of))
            else:
                owner = importlib.import_module(internal.module)
            found = hasattr(owner, internal.attribute)
        except ImportError:
            found = False
        if not found:
            gone.append(internal.name)
    return gone
