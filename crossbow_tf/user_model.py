"""A user's model function, ``module:function`` or ``path/to/file.py:function``, located without
running the user's code: the harness checks every run's model this way before it starts any run,
and itself never imports TensorFlow (which a user's module would). Building the model is
crossbow_tf.models.build_model's business.

Imports no TensorFlow.
"""
import ast
import importlib.machinery
import os
import sys

from crossbow_tf.errors import ConfigError


def parse_spec(spec):
    """(where, function name, whether WHERE is a file path) of a user's model SPEC."""
    where, _, function_name = spec.rpartition(":")
    if not where or not function_name.isidentifier():
        raise ConfigError(f"model: {spec!r}: expected module:function or path/to/file.py:function")
    is_file = where.endswith(".py") or os.sep in where or bool(os.altsep and os.altsep in where)
    return where, function_name, is_file


def search_path():
    """Where a user's module is looked for: the current folder, then sys.path (PYTHONPATH first)."""
    here = os.getcwd()
    return [here] + [os.path.abspath(p or os.curdir) for p in sys.path if os.path.abspath(p or os.curdir) != here]


def _module_source(spec, module_name):
    """The .py file of MODULE_NAME on search_path(), or None when it is found but is not Python
    source (an extension or a zip); ConfigError when it is not found."""
    parts = module_name.split(".")
    for base in search_path():
        for candidate in (os.path.join(base, *parts) + ".py", os.path.join(base, *parts, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    if len(parts) == 1 and importlib.machinery.PathFinder.find_spec(module_name, search_path()) is not None:
        return None
    raise ConfigError(f"model: {spec}: no module {module_name!r} in the current folder ({os.getcwd()}) "
                      "or on PYTHONPATH")


def _top_level_names(tree):
    """Names bound at the top level of TREE (also inside top-level if / try / with blocks), and
    whether the module may bind others that cannot be seen (``import *``, ``__getattr__``)."""
    names, open_ended = set(), False
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    open_ended = True
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                statements.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            statements.extend(node.body)
    return names, open_ended or "__getattr__" in names


def locate_model(spec):
    """Raises ConfigError (one line) unless SPEC's file or module exists, is valid Python and binds
    its function name at the top level. Runs none of the user's code; whether the function
    returns a Keras model is only known once it runs (the run then stops with exit code 2)."""
    where, function_name, is_file = parse_spec(spec)
    if is_file:
        if not os.path.isfile(where):
            raise ConfigError(f"model: {spec}: file {where} not found (paths are relative to the current folder "
                              f"{os.getcwd()})")
        source = where
    else:
        source = _module_source(spec, where)
        if source is None:
            return
    try:
        with open(source, "rb") as f:
            tree = ast.parse(f.read(), filename=source)
    except SyntaxError as e:
        raise ConfigError(f"model: {spec}: {source} does not import (SyntaxError: {e.msg}, line {e.lineno})") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model: {spec}: cannot read {source} ({e})") from None
    names, open_ended = _top_level_names(tree)
    if function_name not in names and not open_ended:
        raise ConfigError(f"model: {spec}: {where} has no {function_name!r}")
