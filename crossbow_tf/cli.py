"""What every command line of the project shares: one-line errors, quiet TensorFlow, safe results.

Imports no TensorFlow (the commands validate everything before it starts).
"""
import argparse
import contextlib
import importlib.util
import os
import re
import sys
import tempfile

from crossbow_tf.errors import CrossbowError
from crossbow_tf.files import OutputError

VERBOSE_VARIABLE = "CROSSBOW_TF_VERBOSE"


class OneLineParser(argparse.ArgumentParser):
    """argparse with an error as one line (``PROG: error: ...``) and exit code 2, no usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def path_argument(text):
    """argparse type of a file or folder argument: an empty one (``--results ''``) is refused in
    one line rather than taken as "not given"."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def add_verbose_flag(parser):
    parser.add_argument("--verbose", action="store_true",
                        help=f"show TensorFlow's start-up and XLA compile lines (also {VERBOSE_VARIABLE}=1)")


def quiet_tensorflow(verbose=False):
    """Hides TensorFlow's C++ start-up and XLA compile lines unless VERBOSE or CROSSBOW_TF_VERBOSE=1
    (warnings and errors stay). Call before TensorFlow is imported; child processes inherit it."""
    if verbose or os.environ.get(VERBOSE_VARIABLE) == "1":
        os.environ[VERBOSE_VARIABLE] = "1"
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# How a line of TensorFlow's C++ log (absl) begins after its severity letter (I, W, E, F): date,
# time, thread id.
ABSL_LINE_AFTER_SEVERITY = r"\d{4} \d\d:\d\d:\d+\.\d+ +\d+ "
# What TensorFlow's C++ libraries print while they load, before TF_CPP_MIN_LOG_LEVEL applies
# (absl logs to stderr until it is initialised): INFO lines and absl's notice about that.
_START_UP_LINE = re.compile(rf"^(I{ABSL_LINE_AFTER_SEVERITY}|WARNING: All log messages before absl::InitializeLog\(\)"
                            r"|To enable the following instructions: )")


def import_tensorflow(verbose=False):
    """Imports TensorFlow; unless verbose (see quiet_tensorflow), the start-up lines its libraries
    print while loading are held back (anything else they print is passed on)."""
    if "tensorflow" in sys.modules or verbose or os.environ.get(VERBOSE_VARIABLE) == "1":
        import tensorflow  # noqa: F401
        return
    with _filtered_stderr(_START_UP_LINE.match):
        import tensorflow  # noqa: F401


@contextlib.contextmanager
def _filtered_stderr(drop):
    """Sends file descriptor 2 (C++ libraries write there directly) to a temporary file meanwhile;
    then writes its lines that DROP does not match to stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not drop(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


# What a run's tf.summary (TensorBoard's summary API) and the harness's hparams writer import of
# TensorBoard; none of them imports TensorFlow, so --check can import them all.
TENSORBOARD_MODULES = ("tensorboard", "tensorboard.summary.v2", "tensorboard.compat.proto.event_pb2",
                       "tensorboard.summary.writer.record_writer", "tensorboard.plugins.hparams.summary_v2")


def require_tensorboard(what):
    """Raises CrossbowError naming WHAT (the flag or key that needs it) unless TensorBoard's modules that
    a run imports import: TensorFlow's tf.summary is TensorBoard's module, so without it a run fails
    after its first epoch (TBNotInstalledError). A dependency of the package; this is for an
    environment that lost it, or holds a broken one."""
    if importlib.util.find_spec("tensorboard") is None:
        raise CrossbowError(f"{what}: the tensorboard package is not installed, and TensorFlow writes event "
                            "files with it (pip install tensorboard)")
    for module in TENSORBOARD_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:   # noqa: BLE001  (whatever a broken install raises is the reason)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CrossbowError(f"{what}: the tensorboard package does not import ({module}: {type(e).__name__}: "
                                f"{reason}), and TensorFlow writes event files with it (pip install "
                                "--force-reinstall tensorboard)") from None


def save_results(results, path, log=print):
    """Writes RESULTS (a RunResults) to PATH atomically; if PATH cannot be written after all (disk
    full, directory gone), writes them to a new file in the temporary directory and raises
    OutputError naming both, so a finished run never loses its results."""
    try:
        results.save(path)
    except OSError as e:
        fd, fallback = tempfile.mkstemp(prefix="crossbow_tf-results-", suffix=".json")
        os.close(fd)
        try:
            results.save(fallback)
        except OSError:
            raise OutputError(f"{path}: cannot write the results ({e.strerror}), nor a copy in "
                              f"{tempfile.gettempdir()}") from None
        raise OutputError(f"{path}: cannot write the results ({e.strerror}); they are saved in {fallback}") from None
    log(f"results written to {path}")


def fail(prog, error):
    """Prints ERROR as PROG's one line on stderr; returns exit code 2."""
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    return 2
