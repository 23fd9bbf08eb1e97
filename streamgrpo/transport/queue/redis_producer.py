"""The producer side of the Redis-stream queue: appending ScoredGroups (:meth:`StreamProducer.put`,
:meth:`StreamProducer.put_many`) with backpressure while the queue holds ``max_pending`` groups.

:class:`StreamProducer` is mixed into :class:`~streamgrpo.transport.queue.redis_stream.RedisQueue`, which owns
the connection (``_r``, ``_call``, ``_note_full``) and the state it reads; the keys and guarantees are in
that module's docstring. Each XADD entry carries ``g`` (the group id) and ``d`` (the wire message).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from streamgrpo import metrics
from streamgrpo.transport.queue.base import QueueFull
from streamgrpo.transport.queue.resp import coalesce, command, to_str, xadd_command
from streamgrpo.wire import ScoredGroup, WireError, encode_parts

log = logging.getLogger("streamgrpo.transport.queue.redis_stream")


class StreamProducer:
    """What a generator calls: :meth:`depth`, :meth:`put`, :meth:`put_many` (a mixin of RedisQueue)."""

    def depth(self) -> int:
        """Groups in the stream not held by a learner: undelivered, or delivered and not yet accepted
        (one round trip; also sets ``streamgrpo_queue_depth``)."""

        def both() -> list[int]:
            p = self._r.pipeline(transaction=False)
            p.xlen(self.stream)
            p.hlen(self.held)
            return p.execute()

        length, held = self._call("XLEN", both)
        n = max(0, int(length) - int(held))
        metrics.QUEUE_DEPTH.set(n)
        self._last_depth = n
        return n

    def put(self, group: ScoredGroup, *, timeout_s: float | None = None) -> str:
        """Append ``group``; blocks while the queue holds ``max_pending`` groups (never drops). Returns the stream id.

        Raises :class:`WireError` (counted as ``errors{kind=wire}``) if the group is invalid or over
        ``max_message_bytes``, :class:`QueueFull` after ``timeout_s`` of backpressure. One round
        trip: the depth (XLEN, HLEN) is read in the same pipeline as the XADD, and the next put
        waits while that depth plus its own puts reach the bound; so the bound is soft by at most
        one put per producer racing for the last slots. If the reply to an XADD is lost, the retry
        may add a second entry: consumers drop it as a duplicate.
        """
        return self.put_many([group], timeout_s=timeout_s)[0]

    def put_many(self, groups: list[ScoredGroup], *, timeout_s: float | None = None) -> list[str]:
        """Append several groups in one round trip (pipelined XADDs); waits for room for all of them.

        Same errors and guarantees as :meth:`put`; nothing is sent if any group fails to encode. Redis at
        maxmemory may take the first XADDs of a batch and refuse the rest: :class:`QueueFull`, and the
        caller's next ``put_many`` of the same groups adds only the ones refused (never a second entry).
        """
        messages = []
        for g in groups:
            try:  # the message stays in pieces (the arrays' own memory) down to the socket: no copy
                messages.append(encode_parts(g, max_bytes=self.max_message_bytes))
            except WireError:
                metrics.ERRORS.labels(kind="wire").inc()
                raise
        if not messages:
            return []
        done = {g.group_id: self._added[g.group_id] for g in groups if g.group_id in self._added}
        self._added = {}  # what a refused batch added: only the groups of this call may use it
        todo = [(g, parts) for g, parts in zip(groups, messages) if g.group_id not in done]
        if not todo:
            return [done[g.group_id] for g in groups]
        need = min(len(todo), self.max_pending)
        # Depth is re-read only when the estimate (last depth read + our puts since) nears the bound.
        if self._last_depth is None or self._last_depth + need > self.max_pending:
            self._wait_for_room(timeout_s, need)

        def add() -> list[bytes]:  # [XLEN, HLEN, XADD...]: the depth other producers left, in the same trip
            chunks = [command(b"XLEN", self.stream.encode()), command(b"HLEN", self.held.encode())]
            for g, parts in todo:
                chunks += xadd_command(self.stream.encode(), [(b"g", [g.group_id.encode()]), (b"d", parts)])
            replies = self._send_raw(chunks, 2 + len(todo))
            other = next((x for x in replies if isinstance(x, redis.ResponseError)
                          and not isinstance(x, redis.exceptions.OutOfMemoryError)), None)
            if other is not None:
                raise other  # as before: a permission error is told apart from an outage by _call
            return replies

        length, held, *sids = self._call("XADD", add)
        refused = next((x for x in (length, held, *sids) if isinstance(x, redis.ResponseError)), None)
        for (g, _), sid in zip(todo, sids):
            if not isinstance(sid, redis.ResponseError):
                done[g.group_id] = to_str(sid)
        if refused is not None:  # Redis at maxmemory (the only error left): backpressure, not a crash
            self._added = done  # the next put_many of these groups adds only the rest
            self._last_depth = None
            metrics.ERRORS.labels(kind="queue_oom").inc()
            metrics.REDIS_FULL_WAITS.labels(op="put").inc()
            metrics.REDIS_FULL.set(1)
            self._note_full("XADD", refused, "waiting for the learner to commit and free what it holds")
            time.sleep(min(1.0, timeout_s if timeout_s is not None else 1.0))
            left = sum(g.group_id not in done for g in groups)
            raise QueueFull(f"redis at {self.safe_url} is at maxmemory: {left} group(s) not added yet") from None
        metrics.REDIS_FULL.set(0)
        self._last_depth = max(0, int(length) - int(held)) + len(todo)
        return [done[g.group_id] for g in groups]

    def _send_raw(self, chunks: list[Any], n_replies: int) -> list[Any]:
        """Write pre-packed commands on one pooled connection and read ``n_replies`` replies; an error
        reply (a ``redis.ResponseError``, e.g. one XADD refused at maxmemory) takes its place in the list."""
        pool = self._r.connection_pool
        conn = pool.get_connection()

        def reply() -> Any:
            try:
                return conn.read_response()
            except redis.ResponseError as exc:  # read in full: the socket stays in step
                return exc

        try:
            conn.send_packed_command(coalesce(chunks))
            return [reply() for _ in range(n_replies)]
        except BaseException:
            conn.disconnect()  # replies may be left unread: never reuse this socket
            raise
        finally:
            pool.release(conn)

    def _wait_for_room(self, timeout_s: float | None, need: int = 1) -> None:
        """Block until ``need`` more groups fit. A full spell spans calls (a caller retrying after
        QueueFull): one log line when it starts, one every 5 s, one when it ends."""
        t0 = time.monotonic()
        depth, pause = self.depth(), 0.02
        while depth + need > self.max_pending:
            now = time.monotonic()
            if self._full_since is None:
                self._full_since = self._full_logged = now
                metrics.BACKPRESSURE.set(1)
                log.info("queue %s full (%d >= max_pending %d): producer waits", self.stream, depth, self.max_pending)
            elif now - self._full_logged >= 5.0:
                self._full_logged = now
                log.info("queue %s still full (%d groups) after %.0fs", self.stream, depth, now - self._full_since)
            if timeout_s is not None and now - t0 >= timeout_s:
                raise QueueFull(f"queue {self.stream} still full after {timeout_s:.1f}s (depth {depth})")
            time.sleep(pause)
            metrics.IDLE_SECONDS.labels(role="generator").inc(time.monotonic() - now)
            pause = min(pause * 1.5, 0.5)
            depth = self.depth()
        if self._full_since is not None:
            log.info("queue %s has room again after %.1fs", self.stream, time.monotonic() - self._full_since)
            self._full_since = None
            metrics.BACKPRESSURE.set(0)
