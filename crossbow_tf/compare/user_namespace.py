"""A network namespace with only loopback for a user who is not root: the kernel lets any user make a
user namespace (in which they alone are root) and, owned by it, a network namespace. Standard library
only, run as a script by path (no package import, no TensorFlow):

    python user_namespace.py hold                      # makes both, brings lo up, says "ready", then
                                                       # holds them until its stdin closes
    python user_namespace.py enter PID -- COMMAND...   # joins PID's two namespaces, then execs COMMAND

A worker entered this way dies with the process that started it (the harness), as launch.start's
workers do: the kernel clears that setting when a process joins a user namespace, so it is set again
after joining. The holder ends when the harness closes its stdin, or dies (the pipe closes with it);
the namespaces end with their last process.
"""
import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_PDEATHSIG = 1
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
READY = "ready"

_libc = ctypes.CDLL(None, use_errno=True)


def _checked(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def loopback_up():
    """Sets lo up in this process's network namespace (a new one has it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def hold():
    uid, gid = os.getuid(), os.getgid()
    _checked(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(CLONE_NEWUSER | CLONE_NEWNET)")
    _write("/proc/self/setgroups", "deny")   # an unprivileged gid_map needs it
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")
    loopback_up()
    print(READY, flush=True)
    sys.stdin.read()


def enter(pid, command):
    parent = os.getppid()
    for kind, flag in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)):
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
        try:
            _checked(_libc.setns(fd, flag), f"setns({kind} namespace of process {pid})")
        finally:
            os.close(fd)
    _checked(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:   # the starter died before the setting took
        os._exit(1)
    os.execvp(command[0], command)


def main(argv):
    try:
        if argv[:1] == ["hold"] and len(argv) == 1:
            return hold()
        if argv[:1] == ["enter"] and len(argv) > 3 and argv[2] == "--":
            return enter(int(argv[1]), argv[3:])
    except OSError as e:
        print(f"{e.strerror or e}", file=sys.stderr)
        return 1
    print("usage: user_namespace.py hold | enter PID -- COMMAND...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
