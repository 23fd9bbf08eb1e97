"""The consumer side of the Redis-stream queue: reading, holding, releasing and committing entries, and
the dead letters an entry that cannot be trained goes to.

:class:`StreamConsumer` is mixed into :class:`~streamgrpo.transport.queue.redis_stream.RedisQueue`, which owns
the connection (``_r``, ``_call``, ``_with_group``, ``wait_for_memory``), the Lua scripts and the state it
reads; the keys and the exactly-once guarantees are in that module's docstring.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from streamgrpo import metrics
from streamgrpo.transport.queue.base import Delivery, QueueError
from streamgrpo.transport.queue.keys import CONSUMER_GROUP
from streamgrpo.transport.queue.resp import parse_autoclaim, parse_entries, to_str
from streamgrpo.wire import ScoredGroup, WireError, decode, encode_parts

log = logging.getLogger("streamgrpo.transport.queue.redis_stream")

DEAD_MAXLEN = 10_000
DEAD_KEEP_BYTES = 1 << 20  # raw payloads up to this size are kept in the dead-letter entry


class StreamConsumer:
    """What a learner calls: :meth:`get`, :meth:`ack`, :meth:`commit`, :meth:`dead_letter`, :meth:`adopt`,
    :meth:`record_failure` (a mixin of RedisQueue)."""

    def get(self, n: int, timeout_s: float) -> list[Delivery]:
        """Up to ``n`` groups, waiting up to ``timeout_s`` for the first (less once ``stop`` is set); ``[]`` if
        none came.

        Order of sources: this consumer's own unacknowledged entries (once, after a restart),
        entries idle for ``claim_idle_s`` on other consumers, then new entries. Undecodable
        entries are dead-lettered and acked, already-trained or already-in-flight group ids are
        acked and skipped; neither is returned.
        """
        if n < 1:
            return []
        deadline = time.monotonic() + max(0.0, timeout_s)
        out: list[Delivery] = []
        self._refresh_inflight()
        while self._own_cursor is not None and len(out) < n:  # after a restart: our own unacked entries
            raw = self._with_group("XREADGROUP", self._r.execute_command, "XREADGROUP", "GROUP", CONSUMER_GROUP,
                                   self.consumer, "COUNT", n - len(out), "STREAMS", self.stream, self._own_cursor)
            entries = parse_entries(raw[0][1]) if raw else []
            if not entries:
                self._own_cursor = None
                break
            self._own_cursor = entries[-1][0]
            entries = [e for e in entries if e[0] not in self._inflight]
            if entries:
                log.info("re-reading %d unacknowledged group(s) of consumer %s", len(entries), self.consumer)
                out += self._accept(entries, claimed=True)
        if len(out) < n and time.monotonic() >= self._next_claim:
            out += self._claim(n - len(out))
        while len(out) < n:
            remaining = deadline - time.monotonic()
            block = [] if (out or remaining <= 0) else ["BLOCK", max(1, int(min(remaining, self._block_s) * 1000))]
            raw = self._with_group("XREADGROUP", self._r.execute_command, "XREADGROUP", "GROUP", CONSUMER_GROUP,
                                   self.consumer, "COUNT", n - len(out), *block, "STREAMS", self.stream, ">")
            entries = parse_entries(raw[0][1]) if raw else []
            out += self._accept(entries, claimed=False)
            if out or time.monotonic() >= deadline or self.stop:  # a stop request: none waits out timeout_s
                break
        return out

    def pending_consumers(self) -> dict[str, int]:
        """The consumers that hold pending entries (delivered, not acked): name -> how many."""
        info = self._with_group("XPENDING", self._r.xpending, self.stream, CONSUMER_GROUP)
        return {to_str(c["name"]): int(c["pending"]) for c in (info or {}).get("consumers") or []}

    def adopt(self, consumer: str) -> int:
        """Take over every pending entry of ``consumer``, a consumer known to be gone (a learner rank the
        restarted learner does not have), now: XCLAIM with min-idle 0, not after ``claim_idle_s``. This
        consumer's next :meth:`get` reads them like its own unacknowledged entries. Returns how many."""
        if consumer == self.consumer:
            return 0
        taken = 0
        while True:
            rows = self._with_group("XPENDING", self._r.xpending_range, self.stream, CONSUMER_GROUP, "-", "+", 1000,
                                    consumer)
            ids = [to_str(row["message_id"]) for row in rows or []]
            if not ids:
                break
            got = self._call("XCLAIM", self._r.xclaim, self.stream, CONSUMER_GROUP, self.consumer, 0, ids, justid=True)
            if not got:  # all deleted meanwhile (Redis 7 drops those from the PEL itself)
                break
            taken += len(got)
        if taken:
            self._own_cursor = "0"  # re-read this consumer's pending entries, the adopted ones among them
        return taken

    def _claim(self, n: int) -> list[Delivery]:
        raw = self._with_group("XAUTOCLAIM", self._r.execute_command, "XAUTOCLAIM", self.stream, CONSUMER_GROUP,
                               self.consumer, int(self.claim_idle_s * 1000), self._claim_cursor, "COUNT", n)
        try:
            cursor, entries, deleted = parse_autoclaim(raw)
        except ValueError as exc:
            raise QueueError(str(exc)) from None
        self._claim_cursor = cursor
        # Scan again right away while there is more to claim, else in a while.
        more = cursor != "0-0" or len(entries) >= n
        self._next_claim = time.monotonic() + (0.0 if more else min(5.0, self.claim_idle_s / 2))
        mine = [e for e in entries if e[0] in self._inflight]  # our own slow entries: claiming just refreshed them
        entries = [e for e in entries if e[0] not in self._inflight]
        if mine:
            now = time.monotonic()
            with self._lock:
                for sid, _ in mine:
                    self._inflight[sid] = (self._inflight[sid][0], now)
        if entries:
            log.warning("claimed %d group(s) idle for over %.0fs on other consumers", len(entries), self.claim_idle_s)
        if deleted:
            log.info("%d pending entries had been deleted from %s", len(deleted), self.stream)
        return self._accept(entries, claimed=True)

    def _accept(self, entries: list[tuple[str, dict[bytes, bytes] | None]], *, claimed: bool) -> list[Delivery]:
        """Decode, dead-letter and hold a batch of entries; returns the deliveries.

        Entries that fail to decode are dead-lettered; then one atomic script holds the rest for
        this consumer, refusing group ids that are trained, held by another live entry (counted as
        ``groups_dropped{reason=duplicate}``), or whose training failed ``max_failures`` times
        (dead-lettered with the last error).
        """
        if not entries:
            return []
        gone = [sid for sid, f in entries if f is None]  # deleted while pending: just clear the pending entry
        if gone:
            self._call("XACK", self._r.xack, self.stream, CONSUMER_GROUP, *gone)
        decoded: list[tuple[str, ScoredGroup, int]] = []
        for sid, fields in entries:
            if fields is None:
                continue
            gid = to_str(fields.get(b"g", b""))
            data = fields.get(b"d")
            try:
                if data is None:
                    raise WireError("entry: no 'd' field")
                group = decode(data, max_bytes=self.max_message_bytes)
                if gid and group.group_id != gid:
                    raise WireError(f"group_id: entry says {gid!r}, message says {group.group_id!r}")
            except WireError as exc:
                self._dead_letter(sid, gid, str(exc), data or b"")
                continue
            decoded.append((sid, group, len(data)))
        if not decoded:
            return []
        args: list[Any] = [time.time() - self.dedupe_ttl_s, self.max_failures]
        for sid, group, _ in decoded:
            args += [group.group_id, sid]
        codes = self.wait_for_memory("hold", "hold", self._hold_script, keys=self._keys(), args=args)
        out, dup = [], []
        for (sid, group, size), code in zip(decoded, codes):
            code = int(code)
            if code == 0:
                out.append(Delivery(sid, group, size, claimed))
            elif code == 3:
                why = self._call("HGET", self._r.hget, self.failures, f"{group.group_id}:err")
                self.dead_letter(sid, group, f"training failed {self.max_failures} times; last error: "
                                             f"{to_str(why) if why else '?'}", label="poison")
            else:
                dup.append((sid, group.group_id if code == 1 else ""))
        if dup:
            metrics.GROUPS_DROPPED.labels(reason="duplicate").inc(len(dup))
            log.info("skipped %d duplicate group(s) (already trained, or held by another entry)", len(dup))
            self._release(dup)
        now = time.monotonic()
        with self._lock:
            for d in out:
                self._inflight[d.stream_id] = (d.group.group_id, now)
        return out

    def _dead_letter(self, sid: str, gid: str, reason: str, data: bytes, label: str = "malformed") -> None:
        metrics.GROUPS_DROPPED.labels(reason=label).inc()
        if label == "malformed":
            metrics.ERRORS.labels(kind="wire").inc()
        log.warning("dead-lettering %s entry %s (group %s): %s", self.stream, sid, gid or "?", reason)
        letter = {
            b"stream_id": sid, b"reason": reason, b"group_id": gid, b"consumer": self.consumer,
            b"time": repr(time.time()), b"size": str(len(data)),
        }
        if len(data) <= DEAD_KEEP_BYTES:
            letter[b"data"] = data
        fields = [x for kv in letter.items() for x in kv]  # one script: released, then lettered (atomic)
        self.wait_for_memory("dead_letter", "dead-letter", self._dead_script, keys=[*self._keys(), self.dead],
                    args=[CONSUMER_GROUP, sid, gid, DEAD_MAXLEN, *fields])
        with self._lock:
            self._inflight.pop(sid, None)

    def dead_letter(self, stream_id: str, group: ScoredGroup, reason: str, label: str = "invalid") -> None:
        """Move a decoded entry that cannot be trained (invalid for this model: ``label="invalid"``;
        its training raised: ``"poison"``) to the dead letters with ``reason``, keeping its message;
        counted as ``groups_dropped{reason=<label>}``."""
        try:
            data = b"".join(bytes(memoryview(p).cast("B")) for p in encode_parts(group, max_bytes=self.max_message_bytes))
        except WireError:
            data = b""
        self._dead_letter(to_str(stream_id), group.group_id, reason, data, label)

    def _keys(self) -> list[str]:
        return [self.stream, self.trained, self.held, self.failures]

    def _refresh_inflight(self) -> None:
        """Reset the idle time of our slow in-flight entries so other consumers do not claim them."""
        now = time.monotonic()
        with self._lock:
            stale = [sid for sid, (_, t) in self._inflight.items() if now - t > self.claim_idle_s / 3]
        if not stale:
            return
        self._call("XCLAIM", self._r.execute_command, "XCLAIM", self.stream, CONSUMER_GROUP, self.consumer, 0,
                   *stale, "JUSTID")
        with self._lock:
            for sid in stale:
                if sid in self._inflight:
                    self._inflight[sid] = (self._inflight[sid][0], now)

    def _release(self, entries: list[tuple[str, str]]) -> int:
        """Acknowledge and delete ``(stream id, group id)`` entries and drop their holds, atomically."""
        acked = 0
        for i in range(0, len(entries), 1000):  # bounded script arguments
            args: list[Any] = [CONSUMER_GROUP]
            for sid, gid in entries[i:i + 1000]:
                args += [sid, gid]
            acked += int(self.wait_for_memory("release", "XACK", self._release_script, keys=self._keys(), args=args))
        return acked

    def ack(self, stream_ids: list[str]) -> int:
        """Release entries that will not be trained (dropped; or any consumer that needs no
        exactly-once commit): acknowledge, delete and un-hold them; returns how many were pending.
        Safe to repeat."""
        stream_ids = [to_str(s) for s in stream_ids]
        if not stream_ids:
            return 0
        with self._lock:
            entries = [(sid, self._inflight.pop(sid, ("", 0.0))[0]) for sid in stream_ids]
        return self._release(entries)

    def commit(self, entries: list[tuple[str, str]], step: int | None = None,
               cursor: dict[str, tuple[int, int]] | None = None) -> int:
        """The training of these ``(stream id, group id)`` entries is durable (in a checkpoint): mark
        the groups trained, acknowledge and delete the entries, drop their holds -- atomically.

        Idempotent, and any consumer may commit any entry (a resumed learner rolls forward the
        commit its checkpoint records). The trained set is a sorted set ``<ns>:trained`` (member =
        group id, score = time), trimmed to ``dedupe_ttl_s`` and expiring when idle that long: one
        entry (~100 B) per group. ``step``: the checkpoint that holds their training; the highest one
        committed is kept (:meth:`committed_step`). ``cursor`` (with ``step``): that checkpoint's data cursor,
        ``"<num_shards>/<shard>"`` -> ``(epoch, position)``, written in the same step unless a later checkpoint's
        is already committed (:meth:`committed_cursors`). Returns how many entries were still pending.
        """
        entries = [(to_str(s), g) for s, g in entries if g]
        if not entries and step is None:
            return 0
        fields: list[Any] = []
        if step is not None:
            for key, (epoch, position) in sorted((cursor or {}).items()):
                fields += [key, f"{int(epoch)} {int(position)} {int(step)}"]
        acked, now = 0, time.time()
        for i in range(0, max(1, len(entries)), 1000):
            args: list[Any] = [CONSUMER_GROUP, now, now - self.dedupe_ttl_s, max(1, int(self.dedupe_ttl_s)),
                               -1 if step is None else int(step), len(fields) // 2, *fields]
            for sid, gid in entries[i:i + 1000]:
                args += [sid, gid]
            acked += int(self.wait_for_memory("commit", "commit", self._commit_script,
                                     keys=[*self._keys(), self.committed_step_key, self.cursor_key], args=args))
        with self._lock:
            for sid, _ in entries:
                self._inflight.pop(sid, None)
        return acked

    def record_failure(self, group_ids: list[str], error: str) -> list[int]:
        """Count one failed training attempt per group (kept in Redis across restarts); returns the
        counts. A group that reaches ``max_failures`` is dead-lettered the next time it is read."""
        gids = [g for g in group_ids if g]
        if not gids:
            return []
        out = self.wait_for_memory("failure", "record_failure", self._fail_script, keys=[self.failures],
                          args=[error[:2000], *gids])
        return [int(x) for x in out]
