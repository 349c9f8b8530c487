"""crossbow_tf.internals lists every private Keras, TensorFlow and Optuna name the package uses, and
each still exists in the installed versions."""
import os
import re

from crossbow_tf import internals

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "crossbow_tf")


def _source(where):
    with open(os.path.join(PACKAGE, where)) as f:
        return f.read()


def test_every_listed_internal_still_exists():
    assert len(internals.INTERNALS) >= 20
    assert internals.missing() == [], (f"installed {internals.installed_versions()}, tested "
                                       f"{internals.TESTED_VERSIONS}")


def test_missing_names_an_internal_that_is_gone(monkeypatch):
    """The check has teeth: an entry whose name no longer resolves is reported, by name."""
    gone = internals.Internal("keras", "keras.src.backend", "NoSuchScope", "engine/fused.py", "a test")
    monkeypatch.setattr(internals, "INTERNALS", internals.INTERNALS[:2] + (gone,))
    assert internals.missing() == ["keras.src.backend.NoSuchScope"]


def test_the_installed_versions_are_the_tested_ones_or_every_internal_exists():
    untested = internals.untested_versions()
    assert not untested or internals.missing() == [], untested


def test_each_entry_is_used_where_it_says():
    for internal in internals.INTERNALS:
        assert internal.attribute in _source(internal.where), internal


def test_every_private_import_of_the_three_files_is_listed():
    """A new ``from keras.src...`` or ``tensorflow.python`` import, or ``._trial_id``, in the files that
    use internals, must come with its entry."""
    listed = {(i.module, i.attribute) for i in internals.INTERNALS}
    for where in ("engine/fused.py", "keras/sma.py", "compare/trials.py"):
        source = _source(where)
        for module, names in re.findall(r"from ((?:keras\.src|tensorflow\.python)[\w.]*) import ([\w, ]+)", source):
            for name in (n.split(" as ")[0].strip() for n in names.split(",")):
                assert (module, name) in listed or any(m == f"{module}.{name}" for m, _ in listed), (where, module, name)
        for attribute in re.findall(r"\btrial\._(\w+)|\bt\._(\w+)", source):
            assert ("optuna.trial", "_" + "".join(attribute)) in listed, (where, attribute)


def test_pyproject_allows_no_version_older_than_the_tested_one():
    """Issue 43: the versions pyproject.toml allows are the versions tested; its lower bound of each
    library is TESTED_VERSIONS' oldest end."""
    with open(os.path.join(os.path.dirname(PACKAGE), "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    bounds = dict(re.findall(r'"(keras|optuna|tensorflow-cpu|tensorflow\[and-cuda\])>=([\w.]+)"', text))
    assert bounds == {"keras": internals.TESTED_VERSIONS["keras"][0],
                      "optuna": internals.TESTED_VERSIONS["optuna"][0],
                      "tensorflow-cpu": internals.TESTED_VERSIONS["tensorflow"][0],
                      "tensorflow[and-cuda]": internals.TESTED_VERSIONS["tensorflow"][0]}


def test_a_version_outside_the_tested_ends_is_untested(monkeypatch):
    monkeypatch.setattr(internals, "TESTED_VERSIONS", {"keras": ("3.15.1", "3.16.0")})
    for installed, untested in (("3.15.1", False), ("3.15.2", False), ("3.16.0", False), ("3.14.9", True),
                                ("3.16.1", True), ("3.6.0", True), (None, True)):
        monkeypatch.setattr(internals, "installed_versions", lambda: {"keras": installed})
        assert bool(internals.untested_versions()) == untested, installed
