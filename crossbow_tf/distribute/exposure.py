"""What a worker's TensorFlow server exposes, said in one line when it starts (issue 52).

TensorFlow's gRPC server binds every interface of the machine (``0.0.0.0:<port>``, whatever host its
TF_CONFIG names) with insecure credentials and no authentication: whoever reaches the port can run
graph operations, which read and write files, with the worker's permissions. Nothing here imports
TensorFlow.
"""
import ipaddress

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
