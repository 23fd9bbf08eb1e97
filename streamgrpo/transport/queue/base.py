"""The replay queue's interface: what generators and the learner need, whatever holds the groups.

:class:`~streamgrpo.transport.queue.redis_stream.RedisQueue` implements it (see there for the guarantees).
Producers ``put``; a learner takes deliveries (``get``), commits the ones whose training a
checkpoint holds, with that checkpoint's data cursor (``commit``; generators read it back: ``committed_cursors``), releases (``ack``) or dead-letters (``dead_letter``) the rest, and
counts training failures per group (``record_failure``); what the learner keeps beside the groups (the committed
step, the trained ids, the pending entries of absent ranks, the crash-loop marks), the server's state (memory,
persistence), on-policy generators' slot claims and read-only inspection. Roles get a queue from
:func:`streamgrpo.transport.queue.factory.open_queue`; every Redis key is in :mod:`.keys`.
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

    # --- the learner's bookkeeping around the groups
    @abc.abstractmethod
    def committed_step(self) -> int | None: ...
    @abc.abstractmethod
    def reset_committed_step(self) -> None: ...
    @abc.abstractmethod
    def is_trained(self, group_ids: list[str]) -> list[bool]: ...
    @abc.abstractmethod
    def pending_consumers(self) -> dict[str, int]: ...
    @abc.abstractmethod
    def adopt(self, consumer: str) -> int: ...
    @abc.abstractmethod
    def crash_marks(self): ...  # the crash-loop breaker's marks (.crash_marks.CrashMarks)

    # --- the server's state
    @abc.abstractmethod
    def memory(self) -> tuple[int, int]: ...
    @abc.abstractmethod
    def persistence(self) -> dict[str, str] | None: ...

    # --- on-policy generators, inspection
    @abc.abstractmethod
    def claim_sync_slots(self, version: int, want: int, per_step: int) -> int: ...
    @abc.abstractmethod
    def entries(self, count: int | None = None) -> list[tuple[str, str, bytes]]: ...
    @abc.abstractmethod
    def dead_letters(self, count: int | None = 100) -> list[dict]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
