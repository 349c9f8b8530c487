"""Training processes of the tests, forked from tests/fork_server.py instead of started afresh.

A fresh Python process spends ~6 CPU s importing TensorFlow before it does anything; the suite
starts dozens (the kill tests' runs, the multi-worker tests' workers, the harness's trials, the
command-line runs). The server imports TensorFlow once and forks each of them; each is still a
separate process running `python ...` as __main__ (tests/fork_server.py says what it shares and
what it does not).

- `ForkedProcess(argv)`: a child with the parts of a Popen the kill tests use.
- `PYTHON` (tests/forked_python) stands in for the interpreter in any command line, with the
  caller's environment, folder, streams and network namespace; `forked_runs` (a module fixture)
  makes it the harness's interpreter (CROSSBOW_RUN_PYTHON) and the one of the commands that name
  `forking.PYTHON`.
One server serves each test process for its whole session; the CPU of the children it reaped
counts in the test that waited for them (`ForkServer.children_cpu`, read by tests/conftest.py).
"""
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.path.join(TESTS, "forked_python")


class ForkServer:
    """tests/fork_server.py, started on first use and stopped as the test process exits: it forks
    the training processes of the tests after importing TensorFlow once (~6 CPU s each saved)."""
    instance = None

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="crossbow-test-fork-")
        self.path = os.path.join(self.directory, "socket")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, os.path.join(TESTS, "fork_server.py"), self.path],
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline() == "ready\n", "the fork server did not start"

    @classmethod
    def get(cls):
        if cls.instance is None:
            cls.instance = cls()
        return cls.instance

    @classmethod
    def children_cpu(cls):
        """The CPU seconds of the children the server has reaped so far (0 before it starts)."""
        if cls.instance is None:
            return 0.0
        with open(cls.instance.path + ".cpu", encoding="utf-8") as f:
            return float(f.read())

    @classmethod
    def stop(cls):
        if cls.instance is not None:
            cls.instance.proc.terminate()
            cls.instance.proc.wait(60)
            shutil.rmtree(cls.instance.directory, ignore_errors=True)
            cls.instance = None


atexit.register(ForkServer.stop)


class ForkedProcess:
    """A child of the fork server running `python ARGV...`, with the parts of a Popen the tests use:
    stdout (stdout and stderr combined), pid, poll, send_signal, wait and returncode (-N: signal N)."""

    def __init__(self, argv):
        read_end, write_end = os.pipe()
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._connection.connect(ForkServer.get().path)
        # This process's environment and folder now, not the server's from its start.
        request = {"argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd(), "fds": ["stdout", "stderr"]}
        socket.send_fds(self._connection, [json.dumps(request).encode()], [write_end, write_end])
        os.close(write_end)
        self.stdout = os.fdopen(read_end, "r")
        self._replies = self._connection.makefile("r")
        self.pid = int(self._replies.readline().split()[1])
        self.returncode, self._exited = None, threading.Event()
        threading.Thread(target=self._await_exit, daemon=True).start()

    def _await_exit(self):
        self.returncode = int(self._replies.readline().split()[1])
        self._connection.close()
        self._exited.set()

    def poll(self):
        return self.returncode

    def send_signal(self, signum):
        if not self._exited.is_set():
            os.kill(self.pid, signum)

    def wait(self, timeout=None):
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.returncode


@pytest.fixture(scope="module")
def forked_runs():
    """tests/forked_python as the interpreter of the harness's training processes and of the commands
    that name `forking.PYTHON`, for the module; the environment restored at the end."""
    names = ("CROSSBOW_RUN_PYTHON", "CROSSBOW_TEST_FORK_SOCKET", "CROSSBOW_TEST_PYTHON")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(CROSSBOW_RUN_PYTHON=PYTHON, CROSSBOW_TEST_FORK_SOCKET=ForkServer.get().path,
                      CROSSBOW_TEST_PYTHON=sys.executable)
    yield PYTHON
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
