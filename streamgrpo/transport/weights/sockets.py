"""Where the weight channel's ZeroMQ sockets live: TCP endpoints (IPv6 in brackets), the ipc://
endpoints of same-host generators, and a bind that turns a port in use into one line naming the
config key."""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from streamgrpo.config import ConfigError

IPC_PATH_MAX = getattr(zmq, "IPC_PATH_MAX_LEN", 107) or 107
"""The longest path a unix socket (ipc://) takes: ``sizeof(sockaddr_un.sun_path) - 1`` on Linux."""


def ipc_endpoints(ipc_dir: str | os.PathLike) -> tuple[str, str]:
    """``(pub, snapshot)`` ipc:// endpoints in ``ipc_dir``; a ConfigError when a path is too long for a unix
    socket (the relay's folder is under ``weights.shm_dir``, the ipc/shm transports' under ``run_dir``)."""
    d = Path(ipc_dir)
    paths = d / "weights-pub.sock", d / "weights-snap.sock"
    longest = max(len(os.fsencode(p)) for p in paths)
    if longest > IPC_PATH_MAX:
        raise ConfigError(f"weights: the socket path {paths[1]} is {longest} bytes, over the {IPC_PATH_MAX} a unix "
                          "socket takes: give weights.shm_dir (a relay's sockets) or run_dir (transport ipc/shm) "
                          "a shorter path")
    return f"ipc://{paths[0]}", f"ipc://{paths[1]}"


def endpoint(host: str, port: int | str) -> str:
    """ZeroMQ TCP endpoint; IPv6 hosts get brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class PortInUse(ConfigError):
    """A weights port is held by another process: one line for the user, no traceback."""


def bind_tcp(sock, host: str, port: int, setting: str) -> int:
    """Bind a ZeroMQ ``sock`` on ``host:port`` (0: any free port) and return the port; ``setting`` names the
    config key the port came from, for the one-line :class:`PortInUse`."""
    import zmq

    if ":" in host:
        sock.ipv6 = True
    try:
        sock.bind(endpoint(host, port or "*"))
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EADDRINUSE:
            raise
        raise PortInUse(f"cannot listen on {host}:{port} ({setting}): another process holds that port (another "
                        f"learner on this host?); stop it, or set {setting} to a free port in the learner's and the "
                        "generators' config") from None
    return int(sock.last_endpoint.decode().rsplit(":", 1)[1])
