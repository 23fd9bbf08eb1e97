"""The replay queue's interface: what generators and the learner need, whatever holds the groups.

:class:`~streamgrpo.transport.queue.redis_stream.RedisQueue` implements it (see there for the guarantees).
Producers ``put``; a learner takes deliveries (``get``), commits the ones whose training a
checkpoint holds, with that checkpoint's data cursor (``commit``; generators read it back: ``committed_cursors``), releases (``ack``) or dead-letters (``dead_letter``) the rest, and
counts training failures per group (``record_failure``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from streamgrpo.wire import ScoredGroup


class QueueError(RuntimeError):
    """The queue cannot do its job (authentication, permissions, an outage longer than allowed, closed)."""


class QueueStopped(QueueError):
    """A stop was requested (``stop`` flag set, e.g. by SIGTERM) while Redis was unreachable."""


class QueueFull(QueueError):
    """``put(..., timeout_s=...)`` waited that long under backpressure."""


@dataclass(frozen=True)
class Delivery:
    """One group handed to a consumer: commit ``stream_id`` after the checkpoint that holds its
    training, or release it with ``ack`` if it is not trained."""

    stream_id: str
    group: ScoredGroup
    nbytes: int = 0  # size of the wire message
    claimed: bool = False  # taken over from another (presumed dead) consumer or re-read after a restart


class GroupQueue(abc.ABC):
    """What generators and the learner need from a replay queue."""

    @abc.abstractmethod
    def put(self, group: ScoredGroup, *, timeout_s: float | None = None) -> str: ...

    def put_many(self, groups: list[ScoredGroup], *, timeout_s: float | None = None) -> list[str]:
        return [self.put(g, timeout_s=timeout_s) for g in groups]

    @abc.abstractmethod
    def get(self, n: int, timeout_s: float) -> list[Delivery]: ...
    @abc.abstractmethod
    def ack(self, stream_ids: list[str]) -> int: ...
    @abc.abstractmethod
    def commit(self, entries: list[tuple[str, str]], step: int | None = None,
               cursor: dict[str, tuple[int, int]] | None = None) -> int: ...
    @abc.abstractmethod
    def dead_letter(self, stream_id: str, group: ScoredGroup, reason: str, label: str = "invalid") -> None: ...
    @abc.abstractmethod
    def record_failure(self, group_ids: list[str], error: str) -> list[int]: ...
    @abc.abstractmethod
    def depth(self) -> int: ...

    def committed_cursors(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """The data cursor committed with the learner's checkpoints: ``(num_shards, shard)`` -> ``(epoch,
        position, step)`` (a queue that keeps none: empty, and generators start at the beginning)."""
        return {}
    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
