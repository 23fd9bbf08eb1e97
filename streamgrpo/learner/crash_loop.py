"""The crash-loop breaker: one message can never stop training.

A group that kills the learner (a kill -9 by an out-of-memory killer, a step that raises) stays
pending, so a restarted learner reads it again and dies again: the run stands still. So each rank
writes the group ids of the step it is about to train to ``<ns>:stepping:<consumer>`` and deletes the
key once the step returns; the groups whose visuals are being decoded outside a step (read-ahead, in
the media threads) are in the set ``<ns>:reading:<consumer>`` meanwhile. A learner that starts and finds
either died inside that step or decode: it adds one to each of those groups' count in the hash
``<ns>:crash_starts``. Then

* a group whose count reached ``learner.crash_loop_starts`` is dead-lettered ``crash_loop`` when next
  read (one line; ``groups_dropped{reason=crash_loop}``);
* a group with a count trains in a step of its own, the most counted first (:meth:`CrashLoopBreaker.isolate`),
  so the next death is counted only for the group that causes it, never for the others of its first step
  (the cost: after a death, up to a step's groups train one per step);
* a step that returns clears its groups' counts: the starts counted are consecutive;
* with several ranks, a step that raises a collective's failure (another rank died, the link between the ranks
  broke: :func:`~streamgrpo.learner.distributed.is_peer_failure`) clears this rank's mark: the death that follows
  (the rank stops, torchrun restarts them all) is the peer's, never counted for this rank's groups. Only the rank
  whose own process died in the step (killed, out of memory) counts it.

Best effort: when Redis refuses these small writes the learner says so once and trains on.
"""

from __future__ import annotations

import contextlib
import json
import logging

import redis

from streamgrpo.learner.distributed import is_peer_failure

log = logging.getLogger("streamgrpo.learner")

COUNTS_TTL_S = 7 * 86400


class CrashLoopBreaker:
    """Counts, per group, the learner starts that found it in the step the last one died in."""

    def __init__(self, queue, starts: int, ranks: int = 1):
        self.client = queue.client
        self.starts = int(starts)
        self.ranks = int(ranks)
        self.namespace = queue.namespace
        self.marker = f"{queue.namespace}:stepping:{queue.consumer}"
        self.counts_key = f"{queue.namespace}:crash_starts"
        self.reading_key = f"{queue.namespace}:reading:{queue.consumer}"  # groups being decoded (read-ahead)
        self.counts: dict[str, int] = {}  # group id -> starts that found it in a dead step (this rank's)
        self._warned = False

    def on_start(self, adopted: list[str] = ()) -> list[str]:
        """Count this start for the groups of the step the previous learner died in (and those of the ``adopted``
        consumers, ranks this start does not have, whose groups this rank took over); returns their ids."""
        markers = [self.marker, *(f"{self.namespace}:stepping:{c}" for c in adopted)]
        try:
            died_in = [str(g) for raw in self.client.mget(markers) if raw for g in json.loads(raw)]
            died_in += sorted(g for g in map(_text, self.client.smembers(self.reading_key)) if g not in died_in)
            p = self.client.pipeline(transaction=True)
            for gid in died_in:
                p.hincrby(self.counts_key, gid, 1)
            p.delete(*markers, self.reading_key)
            p.expire(self.counts_key, COUNTS_TTL_S)  # counts of groups dropped for other reasons do not pile up
            p.hgetall(self.counts_key)
            counts = p.execute()[-1]
        except (redis.RedisError, ValueError, TypeError) as exc:
            self._warn(exc)
            return []
        self.counts = {_text(k): int(v) for k, v in counts.items()}
        again = [g for g in died_in if self.counts.get(g, 0) < self.starts]  # the others: their dead letter says it
        if again:
            log.warning("the last learner died while training group(s) %s (%s of %d starts before one is "
                        "dead-lettered as crash_loop): each trains in a step of its own now", ", ".join(again),
                        "/".join(str(self.counts.get(g, 0)) for g in again), self.starts)
        return died_in

    def verdict(self, group_id: str) -> str | None:
        """The dead-letter reason for a group that crash-looped, or None."""
        n = self.counts.get(group_id, 0)
        if n < self.starts:
            return None
        return (f"the learner died while training it in {n} consecutive starts (learner.crash_loop_starts "
                f"{self.starts}): dead-lettered so that training goes on")

    def isolate(self, batch: list) -> tuple[list, list]:
        """``(step, later)``: the group with the highest count alone (the likeliest cause first, before the
        others of its step move the policy on), the rest later; without counts the whole batch."""
        counts = [self.counts.get(a.group.group_id, 0) for a in batch]
        if len(batch) < 2 or not any(counts):
            return batch, []
        i = counts.index(max(counts))
        return [batch[i]], batch[:i] + batch[i + 1:]

    @contextlib.contextmanager
    def stepping(self, batch: list):
        """Around the step that trains ``batch``: marked before, cleared when it returns (not when it raises,
        unless a peer's failure raised: :meth:`peer_failed`)."""
        self.begin_step(batch)
        try:
            yield
        except Exception as exc:
            if self.ranks > 1 and is_peer_failure(exc):
                self.peer_failed()
            raise
        self.end_step(batch)

    @contextlib.contextmanager
    def reading(self, group_id: str):
        """Around the work of reading one group outside a step (its visuals decoded in read-ahead, any
        thread): a learner that dies in it counts that start for the group, as for a step."""
        try:
            self.client.sadd(self.reading_key, group_id)
        except redis.RedisError as exc:
            self._warn(exc)
        try:
            yield
        finally:  # returned or raised: the learner is alive
            try:
                self.client.srem(self.reading_key, group_id)
            except redis.RedisError as exc:
                self._warn(exc)

    def peer_failed(self) -> None:
        """This rank's step failed because another rank did: this rank's end is not its groups' doing."""
        try:
            self.client.delete(self.marker)
        except redis.RedisError as exc:
            self._warn(exc)

    def begin_step(self, batch: list) -> None:
        """Before training ``batch``: what a learner that starts after a death here will count."""
        try:
            self.client.set(self.marker, json.dumps([a.group.group_id for a in batch]))
        except redis.RedisError as exc:
            self._warn(exc)

    def end_step(self, batch: list) -> None:
        """``batch``'s step returned (applied or not): the learner did not die in it."""
        done = [a.group.group_id for a in batch if a.group.group_id in self.counts]
        try:
            p = self.client.pipeline(transaction=True)
            p.delete(self.marker)
            if done:
                p.hdel(self.counts_key, *done)
            p.execute()
        except redis.RedisError as exc:
            self._warn(exc)
            return
        for gid in done:
            self.counts.pop(gid, None)

    def forget(self, group_id: str) -> None:
        """A dead-lettered group: its count is no longer needed."""
        if self.counts.pop(group_id, None) is None:
            return
        try:
            self.client.hdel(self.counts_key, group_id)
        except redis.RedisError as exc:
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("crash-loop breaker off for now: Redis refused its bookkeeping (%s); training goes on",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
