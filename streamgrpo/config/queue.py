"""The ``queue`` section: the Redis stream of scored groups."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from streamgrpo.sections import Section


class QueueConfig(Section):
    url: Optional[str] = None
    """Redis URL (redis://user:pass@host:port/db, rediss:// for TLS); null starts an embedded server."""
    namespace: str = Field("streamgrpo", min_length=1, max_length=128)
    """Key prefix: groups go to <namespace>:groups, dead letters to <namespace>:dead."""
    max_pending: int = Field(64, ge=1, le=1_000_000)
    """Producers block while the stream holds more than this many unread or unacked groups."""
    claim_idle_s: float = Field(120.0, gt=0.0)
    """Entries pending this long on another consumer are claimed (it is presumed dead)."""
    max_message_mib: float = Field(256.0, gt=0.0, le=512.0)
    """Messages larger than this are refused by producers and dead-lettered by consumers (Redis caps a value at 512 MiB)."""
    dedupe_ttl_s: int = Field(7 * 24 * 3600, ge=60)
    """How long trained group ids are remembered in Redis for de-duplication."""
    max_outage_s: Optional[float] = Field(None, gt=0.0)
    """Give up with an error after Redis has been unreachable this long; null retries (with backoff) forever."""
    max_failures: int = Field(3, ge=1, le=1000)
    """A group whose training raised this many times (counted in Redis, across learner restarts) is dead-lettered with the last error."""
