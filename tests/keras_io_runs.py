"""Runs tools/keras_io_examples.py's main() once per argument list given, in one process.

    python tests/keras_io_runs.py '[["--short"], ["--short", "--scripts", "antirectifier"]]'

tests/test_keras_io_examples.py makes two runs of the tool (the classifiers under --require-within,
the NLP scripts under --require-fused); in one process they pay TensorFlow's start and the tool's
strategy line once instead of twice. Each run's output ends with a line "keras_io_runs: exit CODE"
on stdout and on stderr, so the caller can split both streams per run.
"""
import importlib.util
import json
import os
import sys

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "keras_io_examples.py")
END_OF_RUN = "keras_io_runs: exit "


def split_runs(text):
    """[(exit code, output)] per run, from the stdout or stderr of this script."""
    parts = text.split(END_OF_RUN)
    runs = []
    for output, after in zip(parts[:-1], parts[1:], strict=True):
        code, _, _ = after.partition("\n")
        if runs:    # every part but the first starts with the previous run's exit code
            output = output.partition("\n")[2]
        runs.append((int(code), output))
    return runs


def main(argv):
    runs = json.loads(argv[0])
    # The tool reads --learners-per-device from sys.argv at import (its strategy line comes right after
    # its imports, as in a user's script); every run here uses the default.
    sys.argv = [TOOL]
    spec = importlib.util.spec_from_file_location("keras_io_examples", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for args in runs:
        code = tool.main(args)
        for stream in (sys.stdout, sys.stderr):
            print(f"{END_OF_RUN}{code}", file=stream, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
