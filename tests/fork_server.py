"""`python tests/fork_server.py SOCKET`: starts Python programs without paying for TensorFlow's import.

The kill tests start many training processes (`python -m crossbow_tf.run ...`, `python
tests/bn_dropout_run.py ...`); each one spends ~6 CPU s importing TensorFlow before it does anything.
This server imports TensorFlow, Keras and crossbow_tf's engine once, before TensorFlow initialises anything
(no devices, no threads of its own runtime), then forks one child per request. The child is a real,
separate process: it splits its own devices, installs its own signal handlers, writes its own
checkpoints, can be SIGKILLed, and runs the program as `python PROGRAM ARGS` would (runpy, as
__main__). The server reaps each child and sends the test its exit code, as a Popen would give it.

Protocol (one Unix socket connection per child): the client sends a JSON list [program args...]
(a first element "-m" names a module) together with one file descriptor (SCM_RIGHTS) that becomes
the child's stdout and stderr; the server answers "pid N\\n", then "exit CODE\\n" once it has reaped it.
"""
import json
import os
import socket
import sys
import threading
import traceback


def run_child(argv, output_fd):
    """In the forked child: ARGV's program as __main__ with OUTPUT_FD as stdout and stderr; never returns."""
    import runpy
    code = 1
    try:
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        os.close(output_fd)
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
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
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve_one(connection):
    """Forks the child CONNECTION asks for and reports its pid and, once reaped, its exit code."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 1)
    argv = json.loads(message.decode())
    pid = os.fork()
    if pid == 0:
        connection.close()
        run_child(argv, fds[0])
    os.close(fds[0])
    connection.sendall(f"pid {pid}\n".encode())

    def reap():
        _, status = os.waitpid(pid, 0)
        try:
            connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        finally:
            connection.close()
    threading.Thread(target=reap, daemon=True).start()


def main(path):
    import keras  # noqa: F401  (imported once here, inherited by every child)
    import tensorflow  # noqa: F401

    # Not crossbow_tf.run itself: a child runs it as __main__, which runpy warns about once imported.
    import crossbow_tf.engine.core  # noqa: F401
    import crossbow_tf.experiment  # noqa: F401
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        serve_one(connection)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1])
