"""Output files: checked for writability before a run starts, written atomically after it.

Imports no TensorFlow: the command lines check their outputs before TensorFlow starts.
"""
import os
import tempfile

from crossbow_tf.errors import CrossbowError


class OutputError(CrossbowError):
    """An output path cannot be written (exists, is not a directory, no permission)."""


def check_writable(path, *, force=False, what="output file"):
    """Raises OutputError unless PATH can be created (or, with FORCE, replaced) as a file.

    Nothing is created: the nearest existing directory on the way must be writable; the missing
    ones are made when the file is written.
    """
    if os.path.isdir(path):
        raise OutputError(f"{path}: is a directory; give the {what} a file name")
    if os.path.lexists(path) and not force:
        raise OutputError(f"{path}: {what} exists; choose a new name or pass --force")
    check_creatable(path, os.path.dirname(os.path.abspath(path)), what)


def check_creatable(path, start, what):
    """Raises OutputError unless the nearest existing folder at or above START (where PATH, the WHAT,
    would be made) is a folder this process may write in."""
    parent = start
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise OutputError(f"{path}: cannot create the {what}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot create the {what}: no permission to write in {parent}")


def recorded_path(path):
    """PATH as commands, logs and results record it: an absolute path relative to the working
    directory (the folder the command ran in), so that nothing written names the machine's folders
    (/home/me/..., a venv's interpreter) and a report directory reads the same wherever it is copied."""
    if not path or not os.path.isabs(path):
        return path
    try:
        return os.path.relpath(path)
    except ValueError:   # another drive (Windows): no relative form
        return path


def atomic_write(path, write, binary=False):
    """Calls WRITE(file) on a new file that then replaces PATH, so that PATH is either its old self
    or complete, never half written.

    The temporary file is made by tempfile in PATH's own directory (so os.replace is atomic) under
    a name that cannot collide with a user's file.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_text(path, text):
    """Writes TEXT to PATH atomically (see atomic_write)."""
    atomic_write(path, lambda f: f.write(text))
