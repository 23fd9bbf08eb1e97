"""Where the weight channel's ZeroMQ sockets live: TCP endpoints (IPv6 in brackets), the ipc://
endpoints of same-host generators, and a bind that turns a port in use into one line naming the
config key."""

from __future__ import annotations

import os
from pathlib import Path

from streamgrpo.config import ConfigError


def ipc_endpoints(ipc_dir: str | os.PathLike) -> tuple[str, str]:
    """``(pub, snapshot)`` ipc:// endpoints in ``ipc_dir``."""
    d = Path(ipc_dir)
    return f"ipc://{d / 'weights-pub.sock'}", f"ipc://{d / 'weights-snap.sock'}"


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
