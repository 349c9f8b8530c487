"""The paper's models, by name, and a user's own: ``module:function`` or ``path/to/file.py:function``.

A user's function takes (input_shape, num_classes) and returns an uncompiled Keras model giving
logits. A module is imported from the current folder or PYTHONPATH; a file path is relative to
the current folder.
"""
import importlib
import importlib.util
import os
import sys

from crossbow_tf import training_hooks as hooks
from crossbow_tf.errors import ConfigError
from crossbow_tf.models.lenet import lenet, lenet_bn
from crossbow_tf.models.resnet32 import resnet32
from crossbow_tf.models.resnet50 import resnet50
from crossbow_tf.models.vgg16 import vgg16
from crossbow_tf.user_model import parse_spec

MODELS = {"lenet": lenet, "lenet_bn": lenet_bn, "resnet32": resnet32, "vgg16": vgg16, "resnet50": resnet50}


def is_user_model(spec):
    """True when SPEC names a user's function (``module:function`` or ``file.py:function``)."""
    return ":" in spec


def _import_file(spec, path):
    if not os.path.isfile(path):
        raise ConfigError(f"model: {spec}: file {path} not found (paths are relative to the current folder "
                          f"{os.getcwd()})")
    absolute = os.path.abspath(path)
    # One module per file, under a name of its own: two users' files called models.py do not clash.
    name = "crossbow_tf_user_model_" + "".join(c if c.isalnum() else "_" for c in absolute)
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, absolute)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"model: {spec}: {path} does not import ({type(e).__name__}: {_one_line(e)})") from None
    return module


def _import_module(spec, module_name):
    # `python -m` puts the current folder on sys.path, an installed console script does not.
    here = os.getcwd()
    added = not any(os.path.abspath(p or os.curdir) == here for p in sys.path)
    if added:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        # The module itself missing, rather than something it imports.
        if isinstance(e, ModuleNotFoundError) and e.name and (module_name + ".").startswith(e.name + "."):
            raise ConfigError(f"model: {spec}: no module {module_name!r} in the current folder ({here}) "
                              "or on PYTHONPATH") from None
        raise ConfigError(f"model: {spec}: module {module_name} does not import ({type(e).__name__}: "
                          f"{_one_line(e)})") from None
    finally:
        if added:
            sys.path.remove(here)


def _one_line(error):
    return " ".join(str(error).split()) or "no message"


def resolve_model(spec):
    """The function that builds model SPEC: a key of MODELS, ``module:function`` or
    ``path/to/file.py:function``. ConfigError (one line) when it does not import or is not there."""
    if not is_user_model(spec):
        try:
            return MODELS[spec]
        except KeyError:
            raise ConfigError(f"model: unknown model {spec!r}; choose one of {', '.join(sorted(MODELS))}, or "
                              "your own as module:function or path/to/file.py:function") from None
    where, function_name, is_file = parse_spec(spec)
    module = _import_file(spec, where) if is_file else _import_module(spec, where)
    function = getattr(module, function_name, None)
    if function is None:
        raise ConfigError(f"model: {spec}: {where} has no {function_name!r}")
    if not callable(function):
        kind = type(function).__name__
        raise ConfigError(f"model: {spec}: {function_name} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a function")
    return function


def build_model(name, input_shape, num_classes):
    """Builds model NAME (see resolve_model) returning logits; a user's model is checked to be a
    Keras model and built for INPUT_SHAPE if it is not yet."""
    import keras
    import numpy as np

    factory = resolve_model(name)
    if not is_user_model(name):
        return factory(input_shape=input_shape, num_classes=num_classes)
    call = f"{name}({tuple(input_shape)}, {num_classes})"
    try:
        model = factory(tuple(input_shape), num_classes)
    except Exception as e:
        raise ConfigError(f"model: {call} failed ({type(e).__name__}: {_one_line(e)})") from None
    if not isinstance(model, keras.Model):
        raise ConfigError(f"model: {call} returned {type(model).__name__}, not a Keras model")
    own = [hook.name for hook in hooks.overridden(type(model)) if hook.name not in hooks.RUN_PATH_HONOURS]
    if own:
        # The engine's step would drop that logic while Keras's fit in tf_ssgd ran it: no fair comparison.
        raise ConfigError(f"model: {call} returned a {type(model).__name__}, which overrides {' and '.join(own)}: "
                          "crossbow_tf.run and the harness run the learners' step themselves and would drop that "
                          "logic; move it into train_step or compute_loss, which they run per learner "
                          "(docs/keras.md)")
    if not model.built:
        # A subclassed model without an Input creates its weights in its first call, as in fit;
        # Model.build would mark it built without them.
        try:
            model(np.zeros((1, *input_shape), np.float32), training=False)
        except Exception as e:
            raise ConfigError(f"model: {call}: the model does not build for input shape {tuple(input_shape)} "
                              f"({type(e).__name__}: {_one_line(e)})") from None
    return model
