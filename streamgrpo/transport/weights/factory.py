"""The weight channel a config asks for: the one place that reads ``weights.transport``.

``tcp``: ZeroMQ over TCP (generators on any host). ``ipc``: the same, plus unix sockets in
``<run_dir>/ipc`` for generators on the learner's host. ``shm``: as ipc, but each version's bytes
stay in a shared-memory file under ``weights.shm_dir`` that same-host generators map. Kept apart
from the interface (:mod:`.base`) so that the interface imports no backend.
"""

from __future__ import annotations

from pathlib import Path

from streamgrpo.config import WeightsConfig
from streamgrpo.transport.weights.base import WeightSync, WeightSyncClient


def ipc_dir_of(wcfg: WeightsConfig, run_dir: str | Path) -> Path | None:
    """Where the same-host sockets of ``ipc`` and ``shm`` (whose announcements go over ipc) live:
    ``<run_dir>/ipc``; None for tcp."""
    return Path(run_dir) / "ipc" if wcfg.transport in ("ipc", "shm") else None


def _same_host(wcfg: WeightsConfig, run_dir: str | Path) -> dict:
    shm = {"shm_dir": wcfg.shm_dir} if wcfg.transport == "shm" else {}
    return {"ipc_dir": ipc_dir_of(wcfg, run_dir), **shm}


def publisher_from_config(wcfg: WeightsConfig, run_dir: str | Path, **kw) -> WeightSync:
    """The learner's weight channel (rank 0)."""
    from streamgrpo.transport.weights.publisher import WeightPublisher

    return WeightPublisher(wcfg.bind_host, wcfg.pub_port, wcfg.snapshot_port, wcfg.chunk_mib, wcfg.curve_keys_dir,
                           wcfg.sndhwm, io_threads=wcfg.io_threads, host_buffers=wcfg.host_buffers,
                           **{**_same_host(wcfg, run_dir), **kw})


def subscriber_from_config(wcfg: WeightsConfig, run_dir: str | Path, client_key: str | None = None,
                           **kw) -> WeightSyncClient:
    """A generator's weight channel (``client_key``: e.g. ``client-3``, with CURVE keys)."""
    from streamgrpo.transport.weights.subscriber import WeightSubscriber

    return WeightSubscriber(wcfg.connect_host, wcfg.pub_port, wcfg.snapshot_port, wcfg.curve_keys_dir, client_key,
                            **{**_same_host(wcfg, run_dir), **kw})
