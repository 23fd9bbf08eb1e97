"""The crash-loop breaker's bookkeeping in Redis (:mod:`streamgrpo.learner.intake.crash_loop` decides; this stores).

Its keys (:mod:`.keys`): ``<ns>:stepping:<consumer>`` holds JSON ``{"groups": [...], "witness": {...}, "peer": bool}``:
the groups of the step a learner rank is in (``[]`` between steps), the witness its death is judged by
(:class:`streamgrpo.learner.intake.death_cause.Witness`), and whether a peer's failure ended it (a bare JSON list is the
format before witnesses: groups without a witness); ``<ns>:reading:<consumer>`` the groups it decodes outside a
step; ``<ns>:crash_starts`` the starts counted per group.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

import redis

from streamgrpo.transport.queue.base import QueueError
from streamgrpo.transport.queue.keys import Keys
from streamgrpo.transport.queue.resp import to_str

COUNTS_TTL_S = 7 * 86400


@dataclass
class Mark:
    """What one consumer's learner left: the groups it stepped and decoded, its witness, a peer's failure."""

    consumer: str
    groups: list[str] = field(default_factory=list)
    reading: list[str] = field(default_factory=list)
    witness: dict | None = None
    peer: bool = False

    @classmethod
    def parse(cls, consumer: str, raw, reading) -> Mark:
        try:
            value = json.loads(raw) if raw else None
        except ValueError:
            value = None
        if isinstance(value, list):  # the format before witnesses
            value = {"groups": value}
        value = value if isinstance(value, dict) else {}
        return cls(consumer, [str(g) for g in value.get("groups") or []], sorted(map(to_str, reading)),
                   value.get("witness"), bool(value.get("peer")))


@contextlib.contextmanager
def _refused():
    try:
        yield
    except redis.RedisError as exc:
        raise QueueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc


class CrashMarks:
    """One learner rank's marks (``consumer``) and the shared start counts; every call may raise QueueError
    (Redis refused it: the breaker is best effort)."""

    def __init__(self, client: redis.Redis, namespace: str, consumer: str):
        self.client = client
        self.keys = Keys(namespace)
        self.consumer = consumer
        self.counts_key = self.keys.crash_starts

    def stepping_key(self, consumer: str | None = None) -> str:
        return self.keys.stepping(consumer or self.consumer)

    def reading_key(self, consumer: str | None = None) -> str:
        return self.keys.reading(consumer or self.consumer)

    def read(self, consumers: list[str]) -> list[Mark]:
        """The marks the learners of ``consumers`` left (this rank's and adopted ranks')."""
        with _refused():
            p = self.client.pipeline(transaction=False)
            for c in consumers:
                p.get(self.stepping_key(c))
                p.smembers(self.reading_key(c))
            got = p.execute()
            return [Mark.parse(c, got[2 * i], got[2 * i + 1]) for i, c in enumerate(consumers)]

    def count(self, group_ids: list[str], consumers: list[str]) -> dict[str, int]:
        """One more start for each of ``group_ids``; the marks of ``consumers`` cleared; every count."""
        with _refused():
            p = self.client.pipeline(transaction=True)
            for gid in group_ids:
                p.hincrby(self.counts_key, gid, 1)
            p.delete(*(self.stepping_key(c) for c in consumers), *(self.reading_key(c) for c in consumers))
            p.expire(self.counts_key, COUNTS_TTL_S)  # counts of groups dropped for other reasons do not pile up
            p.hgetall(self.counts_key)
            return {to_str(k): int(v) for k, v in p.execute()[-1].items()}

    def mark(self, groups: list[str], witness: dict, *, peer: bool = False, done: list[str] = ()) -> None:
        """This rank steps ``groups`` now (``[]``: between steps); ``done``: groups whose counts end."""
        with _refused():
            p = self.client.pipeline(transaction=True)
            p.set(self.stepping_key(), json.dumps({"groups": list(groups), "witness": witness, "peer": peer}))
            if done:
                p.hdel(self.counts_key, *done)
            p.execute()

    def reading(self, group_id: str, on: bool) -> None:
        with _refused():
            if on:
                self.client.sadd(self.reading_key(), group_id)
            else:
                self.client.srem(self.reading_key(), group_id)

    def forget(self, group_id: str) -> None:
        with _refused():
            self.client.hdel(self.counts_key, group_id)
