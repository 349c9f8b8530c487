"""`python tests/fork_server.py SOCKET`: starts Python programs without paying for TensorFlow's import.

The tests start many training processes (`python -m crossbow_tf.run ...`, the harness's trials, the
multi-worker tests' workers); each one spends ~6 CPU s importing TensorFlow before it does anything.
This server imports TensorFlow and Keras once, before TensorFlow initialises anything
(no devices, no threads of its own runtime), then forks one child per request. The child is a real,
separate process: it splits its own devices, installs its own signal handlers, writes its own
checkpoints, can be SIGKILLed, and runs the program as `python PROGRAM ARGS` would (runpy, as
__main__). The server reaps each child and sends the client its exit code, as a Popen would give it.

Protocol (one Unix socket connection per child): the client sends a JSON request with file
descriptors (SCM_RIGHTS), and the server answers "pid N\n", then "exit CODE\n" once it has reaped
the child (CODE -N: killed by signal N). The request is either a list [program args...] (a first
element "-m" names a module) with one descriptor, the child's stdout and stderr; or an object
{"argv": [...], "env": {...}, "cwd": DIR, "fds": ["stdin", "stdout", "stderr", "netns"]} naming the
descriptors sent, in order (tests/forked_python, which stands in for `python`, sends its own):
the child runs in that environment, folder and network namespace. A client that goes away before
its child has exited (the shim SIGKILLed, say) takes the child's process group with it.

The server serves a whole test session; the CPU seconds of the children it has reaped (user and
system, their own reaped children included) are in the file SOCKET.cpu, updated before each "exit"
reply, so that the test that waited for a child can count its CPU (tests/conftest.py).
"""
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import traceback

CLONE_NEWNET = 0x40000000
STREAMS = ("stdin", "stdout", "stderr")


class ChildrenCpu:
    """The CPU seconds of the reaped children, kept in the file PATH (written whole, then renamed)."""

    def __init__(self, path):
        self.path, self.total, self.lock = path, 0.0, threading.Lock()
        self._write()

    def add(self, usage):
        with self.lock:
            self.total += usage.ru_utime + usage.ru_stime
            self._write()

    def _write(self):
        with open(self.path + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{self.total:.3f}\n")
        os.replace(self.path + ".tmp", self.path)


def take_over(request, fds):
    """In the forked child: the standard streams, network namespace, folder, environment and import
    path REQUEST asks for (FDS: its descriptors, named by request["fds"])."""
    named = dict(zip(request["fds"], fds, strict=True))
    for number, name in enumerate(STREAMS):
        if name in named:
            os.dup2(named[name], number)
    if "netns" in named and os.fstat(named["netns"]).st_ino != os.stat("/proc/self/ns/net").st_ino:
        if ctypes.CDLL(None, use_errno=True).setns(named["netns"], CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns to the client's network namespace")
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # As the interpreter would: PYTHONPATH's folders right after the program's own.
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra


def run_child(argv, output_fd=None, request=None, fds=()):
    """In the forked child: ARGV's program as __main__ (-m MODULE, -c CODE or a script), its output
    on OUTPUT_FD, or as REQUEST asks with FDS; never returns."""
    import runpy
    code = 1
    try:
        os.setpgid(0, 0)   # its own group: a client that vanishes takes the child's children too
        if request is not None:
            take_over(request, fds)
        else:
            os.dup2(output_fd, 1)
            os.dup2(output_fd, 2)
            os.close(output_fd)
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:   # as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve_one(connection, children_cpu):
    """Forks the child CONNECTION asks for and reports its pid and, once reaped (its CPU added to
    CHILDREN_CPU), its exit code."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
    request = json.loads(message.decode())
    argv = request["argv"] if isinstance(request, dict) else request
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        connection.close()
        if isinstance(request, dict):
            run_child(argv, request=request, fds=fds)
        run_child(argv, fds[0])
    try:
        os.setpgid(pid, pid)   # also here, so that the group exists whichever of the two runs first
    except OSError:
        pass
    for fd in fds:
        os.close(fd)
    connection.sendall(f"pid {pid}\n".encode())
    exited = threading.Event()

    def reap():
        _, status, usage = os.wait4(pid, 0)
        children_cpu.add(usage)
        exited.set()
        try:
            connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:   # the client has gone
            pass
        finally:
            connection.close()

    def watch_client():
        try:
            gone = connection.recv(1) == b""
        except OSError:
            gone = True
        if gone and not exited.is_set():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    threading.Thread(target=reap, daemon=True).start()
    threading.Thread(target=watch_client, daemon=True).start()


def main(path):
    import keras  # noqa: F401  (imported once here, inherited by every child)
    import tensorflow  # noqa: F401
    # Nothing of crossbow_tf (0.1 CPU s): each child imports what its program needs, so that the
    # modules a process reports loaded are its own (the stock baseline must load no engine code).
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    children_cpu = ChildrenCpu(path + ".cpu")
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        serve_one(connection, children_cpu)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1])
