"""The weight channel a config asks for: the ZeroMQ backends behind the :mod:`.weight_sync` interface.

Kept apart from the interface so that it imports no backend (the backends import the interface).
"""

from __future__ import annotations

from pathlib import Path

from streamgrpo.transport.weight_sync import WeightSync, WeightSyncClient
from streamgrpo.transport.weights import WeightPublisher
from streamgrpo.transport.weights_subscriber import WeightSubscriber


def ipc_dir_of(cfg) -> Path | None:
    """Where ``weights.transport=ipc`` (and ``shm``, whose announcements go over ipc) puts its sockets:
    ``<run_dir>/ipc`` (None for tcp)."""
    return Path(cfg.run_dir) / "ipc" if cfg.weights.transport in ("ipc", "shm") else None


def publisher_from_config(cfg, **kw) -> WeightSync:
    """The learner's weight channel for a :class:`streamgrpo.config.Config`."""
    return WeightPublisher.from_config(cfg.weights, ipc_dir=ipc_dir_of(cfg), **kw)


def subscriber_from_config(cfg, client_key: str | None = None, **kw) -> WeightSyncClient:
    """A generator's weight channel for a :class:`streamgrpo.config.Config`."""
    return WeightSubscriber.from_config(cfg.weights, client_key=client_key, ipc_dir=ipc_dir_of(cfg), **kw)
