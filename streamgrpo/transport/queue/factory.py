"""The queue a config asks for: the one place roles get their :class:`~.base.GroupQueue` from.

Today one backend: :class:`~.redis_stream.RedisQueue` (a Redis stream; its keys: :mod:`.keys`). Kept apart from
the interface (:mod:`.base`) so that the interface imports no backend.
"""

from __future__ import annotations

from streamgrpo.config import QueueConfig
from streamgrpo.transport.queue.base import GroupQueue
from streamgrpo.transport.queue.redis_stream import RedisQueue


def open_queue(cfg: QueueConfig, url: str | None = None, consumer: str = "learner-0", **kw) -> GroupQueue:
    """The queue of the ``queue`` config section, as ``consumer`` (``url`` overrides ``cfg.url``: an embedded
    server's); ``kw``: the backend's own options (``stop``, ``max_outage_s``, ...)."""
    return RedisQueue.from_config(cfg, url, consumer=consumer, **kw)
