"""The queue a config asks for: the one place roles get their :class:`~.base.GroupQueue` from.

Today one backend: :class:`~.redis_stream.RedisQueue` (a Redis stream; its keys: :mod:`.keys`). Kept apart from
the interface (:mod:`.base`) so that the interface imports no backend.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from streamgrpo.config import ConfigError, QueueConfig
from streamgrpo.transport.queue.base import GroupQueue
from streamgrpo.transport.queue.redis_stream import RedisQueue


def open_queue(cfg: QueueConfig, url: str | None = None, consumer: str = "learner-0", **kw) -> GroupQueue:
    """The queue of the ``queue`` config section, as ``consumer`` (``url`` overrides ``cfg.url``: an embedded
    server's); ``kw``: the backend's own options (``stop``, ``max_outage_s``, ...)."""
    return RedisQueue.from_config(cfg, url, consumer=consumer, **kw)


class NoRedisConfigured(ConfigError, RuntimeError):
    """Neither ``queue.url``, ``STREAMGRPO_REDIS_URL`` nor an embedded server's record names a Redis."""


def queue_url(qcfg, run_dir: Path) -> str:
    """``queue.url`` (a :class:`~streamgrpo.config.QueueConfig`), ``STREAMGRPO_REDIS_URL``, or the embedded
    server's URL that `streamgrpo up` recorded in the run directory."""
    if qcfg.url:
        return qcfg.url
    env = os.environ.get("STREAMGRPO_REDIS_URL")
    if env:
        return env
    rec = run_dir / "redis.json"
    if rec.is_file():
        return json.loads(rec.read_text())["url"]
    raise NoRedisConfigured(
        "no Redis configured: set queue.url (redis://host:port/db) or start everything with `streamgrpo up`, "
        "which runs an embedded Redis (or set STREAMGRPO_REDIS_URL)"
    )
