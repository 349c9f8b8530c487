"""No function in the package or the baselines over 80 lines (issue 28): a longer one was doing
several jobs each time one was found, and this keeps a new one from growing back unnoticed."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 80


def functions_over(limit, folders=("crossbow_tf", "baselines")):
    found = []
    for folder in folders:
        for directory, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(names):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                found += [(os.path.relpath(path, ROOT), node.lineno, node.name, node.end_lineno - node.lineno + 1)
                          for node in ast.walk(tree)
                          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and node.end_lineno - node.lineno + 1 > limit]
    return found


def test_no_function_is_over_80_lines():
    assert functions_over(LIMIT) == []


def test_the_check_sees_the_package_and_the_baselines():
    # The longest functions of each folder are found at a lower bound: the walk reads both folders.
    files = {path.split(os.sep)[0] for path, *_ in functions_over(30)}
    assert files == {"crossbow_tf", "baselines"}
