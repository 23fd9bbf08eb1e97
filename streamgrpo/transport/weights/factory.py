"""The weight channel a config asks for: the one place that reads ``weights.transport``.

``tcp``: ZeroMQ over TCP (:mod:`.publisher`, :mod:`.subscriber`; generators on any host). ``ipc``:
the same, plus unix sockets in ``<run_dir>/ipc`` for generators on the learner's host. ``shm``
(:mod:`.shm_publisher`, :mod:`.shm_subscriber`): as ipc, but each version's bytes stay in a
shared-memory file under ``weights.shm_dir`` that same-host generators map. A subscriber whose
``weights.connect_host`` is not an address of its own host takes TCP whatever ``weights.transport``
says (:func:`learner_is_local`): the sockets under a shared ``run_dir`` and the files in its own
``shm_dir`` are another host's. Kept apart from the interface (:mod:`.base`) so that the interface
imports no backend.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from pathlib import Path

from streamgrpo.config import WeightsConfig
from streamgrpo.transport.weights.base import WeightSync, WeightSyncClient
from streamgrpo.transport.weights.publisher import WeightPublisher
from streamgrpo.transport.weights.shm_publisher import ShmPublisher
from streamgrpo.transport.weights.shm_subscriber import ShmSubscriber
from streamgrpo.transport.weights.subscriber import WeightSubscriber

log = logging.getLogger("streamgrpo.weights")


def learner_is_local(host: str) -> bool:
    """Whether ``host`` (``weights.connect_host``) names this host: a loopback or unspecified address, or one
    this host can bind (an address of one of its interfaces). A name that does not resolve is not local."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        ip = ipaddress.ip_address(addr[0].split("%")[0])
        if ip.is_loopback or ip.is_unspecified:
            return True
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def subscriber_transport(wcfg: WeightsConfig) -> str:
    """The transport a subscriber of ``wcfg`` uses: ``weights.transport``, except tcp when the learner
    (``weights.connect_host``) is on another host, where ipc sockets and shm files cannot reach."""
    if wcfg.transport == "tcp" or learner_is_local(wcfg.connect_host):
        return wcfg.transport
    return "tcp"


def relay_dir(wcfg: WeightsConfig) -> Path:
    """The host's relay for this learner: ``<shm_dir>/sgr-<10 hex of connect_host:pub_port>`` (its lock,
    its config and its ipc:// sockets; mode 0700, so only this user's generators reach it)."""
    import hashlib

    tag = hashlib.sha256(f"{wcfg.connect_host}:{wcfg.pub_port}".encode()).hexdigest()[:10]
    return Path(wcfg.shm_dir) / f"sgr-{tag}"


def ipc_dir_of(wcfg: WeightsConfig, run_dir: str | Path) -> Path | None:
    """Where the same-host sockets of ``ipc`` and ``shm`` (whose announcements go over ipc) live:
    ``<run_dir>/ipc``; None for tcp."""
    return Path(run_dir) / "ipc" if wcfg.transport in ("ipc", "shm") else None


def publisher_from_config(wcfg: WeightsConfig, run_dir: str | Path, **kw) -> WeightSync:
    """The learner's weight channel (rank 0)."""

    kw = {"ipc_dir": ipc_dir_of(wcfg, run_dir), "io_threads": wcfg.io_threads, "host_buffers": wcfg.host_buffers,
          "algo": wcfg.digest, "delta_max_ratio": wcfg.delta_max_ratio if wcfg.delta else None, **kw}
    args = (wcfg.bind_host, wcfg.pub_port, wcfg.snapshot_port, wcfg.chunk_mib, wcfg.curve_keys_dir, wcfg.sndhwm)
    if wcfg.transport == "shm":
        return ShmPublisher(*args, shm_dir=wcfg.shm_dir, **kw)
    return WeightPublisher(*args, **kw)


def subscriber_from_config(wcfg: WeightsConfig, run_dir: str | Path, client_key: str | None = None,
                           **kw) -> WeightSyncClient:
    """A generator's (or the evaluator's) weight channel (``client_key``: e.g. ``client-3``, with CURVE
    keys); with ``weights.relay`` the host's relay's, through shared memory. ``weights.transport`` ipc or
    shm on a host other than the learner's (``weights.connect_host``) falls back to TCP, in one log line."""

    if wcfg.relay:  # the relay on this host: its ipc:// sockets, versions in its shared-memory files
        return ShmSubscriber("127.0.0.1", 0, 0, shm_dir=wcfg.shm_dir, ipc_dir=relay_dir(wcfg), **kw)
    transport = subscriber_transport(wcfg)
    if transport != wcfg.transport:
        log.info("weights.transport=%s is for the learner's host; %s is another host's: weights over TCP "
                 "(%s:%d)", wcfg.transport, wcfg.connect_host, wcfg.connect_host, wcfg.pub_port)
        wcfg = wcfg.model_copy(update={"transport": transport})
    kw = {"ipc_dir": ipc_dir_of(wcfg, run_dir), **kw}
    args = (wcfg.connect_host, wcfg.pub_port, wcfg.snapshot_port, wcfg.curve_keys_dir, client_key)
    if wcfg.transport == "shm":
        return ShmSubscriber(*args, shm_dir=wcfg.shm_dir, **kw)
    return WeightSubscriber(*args, delta=wcfg.delta, **kw)


def relay_publisher_from_config(wcfg: WeightsConfig, **kw) -> WeightSync:
    """A relay's publisher to its host's generators: ipc:// sockets in :func:`relay_dir` (no TCP), versions
    in shared-memory files (its high-water mark holds the early-chunk messages of a few versions)."""

    return ShmPublisher("127.0.0.1", 0, 0, wcfg.chunk_mib, None, max(wcfg.sndhwm, 100_000), shm_dir=wcfg.shm_dir,
                        ipc_dir=relay_dir(wcfg), tcp=False, algo=wcfg.digest, host_buffers=2, **kw)
