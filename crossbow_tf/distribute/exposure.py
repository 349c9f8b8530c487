"""What a worker's TensorFlow server exposes, said in one line when it starts (issue 52).

TensorFlow's gRPC server binds every interface of the machine (``0.0.0.0:<port>``, whatever host its
TF_CONFIG names) with insecure credentials and no authentication: whoever reaches the port can run
graph operations, which read and write files, with the worker's permissions. Nothing here imports
TensorFlow.
"""
import ipaddress
import os
import socket

SECURITY_DOC = "docs/multiworker.md#security"


def is_loopback(host):
    """Whether HOST (a name or an address, without the port) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_address(address):
    """(host, port) of a TF_CONFIG address 'host:port' or '[v6]:port'."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def exposure_line(worker, address, addresses):
    """The line a starting WORKER (its description) prints about its server at ADDRESS, in a cluster of
    ADDRESSES (every task's 'host:port')."""
    _, port = split_address(address)
    others = sorted({split_address(a)[0] for a in addresses if not is_loopback(split_address(a)[0])})
    where = (f"its cluster names other hosts ({', '.join(others)})" if others else
             "its cluster is on this machine only, but the server binds every interface all the same")
    return (f"crossbow_tf: {worker}: TensorFlow's server listens on port {port} of every interface of this machine "
            f"and accepts unauthenticated connections, which can run operations with your permissions; {where}: "
            f"run workers on a trusted network only ({SECURITY_DOC})")


LISTEN = "0A"   # a TCP socket's state in /proc/net/tcp: listening


def _address(hex_address, family):
    raw = bytes.fromhex(hex_address)
    if family == socket.AF_INET:
        return socket.inet_ntop(family, raw[::-1])
    # /proc/net/tcp6 writes the address as four 32-bit words, each in the host's (little-endian) order.
    return socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening_sockets(net="/proc/net"):
    """{socket inode: (address, port)} of the listening TCP sockets of one network namespace: NET is
    /proc/net (this process's) or /proc/<pid>/net (that process's)."""
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(os.path.join(net, name)) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN:
                address, port = fields[1].split(":")
                found[int(fields[9])] = (_address(address, family), int(port, 16))
    return found


def socket_inodes(pid):
    """The inodes of the sockets process PID holds open (empty once it has gone)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(int(link[len("socket:["):-1]))
    except OSError:
        pass
    return inodes


def exposed_listeners(pids):
    """[(pid, address, port)]: the listening TCP sockets of PIDS in this process's network namespace on an
    address other than loopback. One on 0.0.0.0 or :: (every interface, as TensorFlow's server binds) is
    exposed; one in another network namespace (a private one) is not in this table at all."""
    here = listening_sockets()
    return [(pid, *here[inode]) for pid in pids for inode in sorted(socket_inodes(pid))
            if inode in here and not is_loopback(here[inode][0])]
