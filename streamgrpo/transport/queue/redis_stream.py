"""The replay queue between generators and the learner: ScoredGroups on a Redis stream.

The keys: :mod:`streamgrpo.transport.queue.keys`.

Delivery is at least once; training is exactly once with the learner (docs/design.md): an accepted
entry is *held*, stays pending while it trains, and is committed (:meth:`RedisQueue.commit`: marked
trained, acked and deleted atomically) only after the checkpoint holding its effect is on disk. A
learner that crashes re-reads its pending entries under the same consumer name and trains them
again; a group id that is trained or held by another live entry is never accepted twice, however it
arrives. Entries not trained are released (:meth:`RedisQueue.ack`) or dead-lettered. Backpressure
and ``streamgrpo_queue_depth`` count the entries no learner holds. The entries of a consumer silent
for ``claim_idle_s`` are claimed by another (XAUTOCLAIM); a live consumer refreshes its own. The entries of
a consumer known to be gone (a learner rank a restarted learner does not have) are adopted at once
(:meth:`RedisQueue.adopt`).

What each side counts in :mod:`streamgrpo.metrics`: the queue counts what only it can see --
``groups_dropped{reason=malformed|duplicate|invalid|poison}``, ``errors{kind=wire|queue}``, ``queue_depth``,
``backpressure`` and the generator's ``idle_seconds`` while blocked. Callers count
``groups{event=produced|consumed|trained}`` and their own drops (stale, rolled_back, mismatch, nan_loss).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from streamgrpo import metrics
from streamgrpo.transport.queue.base import (  # noqa: F401 - QueueFull is part of this module's API
    Delivery,
    GroupQueue,
    QueueError,
    QueueFull,
    QueueStopped,
)
from streamgrpo.transport.queue.crash_marks import CrashMarks
from streamgrpo.transport.queue.errors import tls_on_plain_port
from streamgrpo.transport.queue.keys import Keys
from streamgrpo.transport.queue.resp import (
    COMMIT_LUA,
    DEAD_LUA,
    FAIL_LUA,
    HOLD_LUA,
    RELEASE_LUA,
    coalesce,
    command,
    parse_autoclaim,
    parse_entries,
    safe_url,
    to_str,
    xadd_command,
)
from streamgrpo.wire import DEFAULT_MAX_BYTES, ScoredGroup, WireError, decode, encode_parts

if TYPE_CHECKING:
    from streamgrpo.config import QueueConfig

log = logging.getLogger(__name__)

CONSUMER_GROUP = "learner"
DEAD_MAXLEN = 10_000
DEAD_KEEP_BYTES = 1 << 20  # raw payloads up to this size are kept in the dead-letter entry
FULL_WARN_EVERY_S = 30.0  # one warning per this many seconds while Redis refuses writes at maxmemory


def _unknown_url_options(client: redis.Redis) -> set[str]:
    """URL query options the client's connection class does not take (redis-py passes them on, and the
    first command then fails with a TypeError)."""
    import inspect

    pool = client.connection_pool
    cls = pool.connection_class
    accepted: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            accepted |= {p.name for p in inspect.signature(init).parameters.values()
                         if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k for k in pool.connection_kwargs if k not in accepted}


class RedisQueue(GroupQueue):
    """ScoredGroups over a Redis stream; see the module docstring for the keys and guarantees.

    ``url`` may carry a password or an ACL user (``redis://user:pass@host:port/db``), use TLS
    (``rediss://...?ssl_ca_certs=/path/ca.pem``) or a unix socket (``unix:///path/redis.sock``).
    Connection loss is retried with capped exponential backoff (one log line per outage) for up to
    ``max_outage_s`` (None: forever); a wrong password raises :class:`QueueError` at once. An ACL user
    needs ``+@stream +@sortedset +@hash +@scripting +@transaction +ping +expire +client`` on ``<namespace>:*``.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "streamgrpo",
        consumer: str = "learner-0",
        max_pending: int = 64,
        claim_idle_s: float = 120.0,
        max_message_bytes: int = DEFAULT_MAX_BYTES,
        dedupe_ttl_s: float = 7 * 24 * 3600,
        max_failures: int = 3,
        max_outage_s: float | None = None,
        backoff_s: tuple[float, float] = (0.05, 5.0),
        socket_timeout_s: float = 60.0,
        stop: Any = None,
    ) -> None:
        self.url = url
        self.safe_url = safe_url(url)
        self.namespace = namespace
        self.consumer = consumer
        self.max_pending = int(max_pending)
        self.claim_idle_s = float(claim_idle_s)
        self.max_message_bytes = int(max_message_bytes)
        self.dedupe_ttl_s = float(dedupe_ttl_s)
        self.max_outage_s = max_outage_s
        self.backoff_s = backoff_s
        self.stop = stop  # truthy when the process should stop (a StopFlag): ends outage retries early
        self.keys = Keys(namespace)
        self.stream, self.dead, self.trained = self.keys.stream, self.keys.dead, self.keys.trained
        self.held, self.failures = self.keys.held, self.keys.failures
        self.committed_step_key, self.cursor_key = self.keys.committed_step, self.keys.cursor
        self.max_failures = int(max_failures)
        # one XREADGROUP BLOCK at most this long: a stop request ends a wait for groups within it
        self._block_s = max(0.05, min(0.5, socket_timeout_s / 4))
        self._closed = False
        self._lock = threading.Lock()
        self._outage_since: float | None = None
        self._connected = False  # a command succeeded: a dropped connection is an outage, never a TLS mix-up
        self._inflight: dict[str, tuple[str, float]] = {}  # stream id -> (group id, last refreshed)
        self._own_cursor: str | None = "0"  # history cursor over our own pending entries; None when done
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._last_depth: int | None = None  # producer: depth seen by the last put (skips a round trip)
        self._full_since: float | None = None  # producer: start of the current backpressure spell
        self._full_logged = 0.0
        self._oom_logged = -1e9  # last "Redis at maxmemory" warning (producer and consumer alike)
        self._added: dict[str, str] = {}  # producer: group id -> stream id added by a batch Redis refused part of
        try:
            tcp = {} if url.startswith("unix:") else {"socket_connect_timeout": 5.0, "socket_keepalive": True}
            self._r = redis.Redis.from_url(
                url, socket_timeout=socket_timeout_s, retry=Retry(NoBackoff(), 0), client_name=f"streamgrpo-{consumer}",
                decode_responses=False, protocol=2, socket_read_size=1 << 20, **tcp,
            )
        except ValueError as exc:
            raise QueueError(f"bad redis url {self.safe_url}: {exc}") from None
        unknown = _unknown_url_options(self._r)
        if unknown:
            raise QueueError(f"bad redis url {self.safe_url}: unknown option(s) {', '.join(sorted(unknown))} (redis-py's "
                             "URL options: ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs, ssl_password, "
                             "socket_timeout, db, ...)") from None

        mixed = tls_on_plain_port(self._r, self.safe_url)
        if mixed:
            raise QueueError(mixed) from None
        for cmd in ("XREADGROUP", "XAUTOCLAIM", "XCLAIM"):  # parse replies ourselves (deleted entries keep ids)
            self._r.set_response_callback(cmd, lambda r, **_: r)
        self._hold_script = self._r.register_script(HOLD_LUA)
        self._release_script = self._r.register_script(RELEASE_LUA)
        self._commit_script = self._r.register_script(COMMIT_LUA)
        self._fail_script = self._r.register_script(FAIL_LUA)
        self._dead_script = self._r.register_script(DEAD_LUA)
        self._ensure_group()

    @classmethod
    def from_config(cls, cfg: QueueConfig, url: str | None = None, consumer: str = "learner-0", **kw) -> RedisQueue:
        """Build from the ``queue`` config section; ``url`` overrides ``cfg.url`` (e.g. an embedded server's)."""
        url = url or cfg.url
        if not url:
            raise QueueError("no redis url: set queue.url or start an EmbeddedRedis and pass its url")
        return cls(
            url, namespace=cfg.namespace, consumer=consumer, max_pending=cfg.max_pending,
            claim_idle_s=cfg.claim_idle_s, max_message_bytes=int(cfg.max_message_mib * (1 << 20)),
            dedupe_ttl_s=cfg.dedupe_ttl_s, max_failures=cfg.max_failures, **{"max_outage_s": cfg.max_outage_s, **kw},
        )

    # ------------------------------------------------------------------------ redis calls
    def _call(self, what: str, fn, *args, **kwargs):
        """Run one Redis call; retry connection loss with capped exponential backoff, one log line per outage.

        A mistake that retrying cannot fix (password, ACL permissions, TLS settings, ``redis://`` on a
        TLS port: :func:`~streamgrpo.transport.queue.errors.misconfiguration`) raises :class:`QueueError` at once.
        """
        delay = self.backoff_s[0]
        while True:
            if self._closed:
                raise QueueError(f"queue on {self.safe_url} is closed")
            try:
                out = fn(*args, **kwargs)
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.InvalidResponse,
                    redis.exceptions.NoPermissionError) as exc:
                from streamgrpo.transport.queue.errors import misconfiguration

                # a mistake (password, TLS...) ends here; anything else is an outage (refused, LOADING...)
                fatal = misconfiguration(exc, self._r, self.safe_url, what, connected=self._connected)
                if fatal:
                    raise QueueError(fatal) from None
                if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                    raise
                now = time.monotonic()
                with self._lock:
                    first = self._outage_since is None
                    if first:
                        self._outage_since = now
                    since = self._outage_since
                if first and not self.stop:  # a stop already requested: QueueStopped below says it all
                    metrics.ERRORS.labels(kind="queue").inc()
                    log.warning("redis at %s unavailable during %s (%s); retrying with backoff up to %gs",
                                self.safe_url, what, exc, self.backoff_s[1])
                if self.max_outage_s is not None and now - since > self.max_outage_s:
                    raise QueueError(f"redis at {self.safe_url} unavailable for {now - since:.0f}s: {exc}") from None
                if self.stop:
                    raise QueueStopped(f"stop requested while redis at {self.safe_url} was unavailable "
                                       f"({now - since:.1f}s) during {what}") from None
                time.sleep(delay)
                delay = min(delay * 2, self.backoff_s[1])
                continue
            self._connected = True
            with self._lock:
                since, self._outage_since = self._outage_since, None
            if since is not None:
                log.warning("redis at %s is back after %.1fs", self.safe_url, time.monotonic() - since)
            return out

    def _ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless it exists. Looked up first (XINFO reads only):
        Redis at maxmemory refuses XGROUP CREATE even for a group that exists, which would stop a
        ``--resume`` against a full Redis; a group really missing there is waited for (:meth:`wait_for_memory`)."""

        def exists() -> bool:
            try:
                return any(to_str(g.get("name", b"")) == CONSUMER_GROUP for g in self._r.xinfo_groups(self.stream))
            except redis.ResponseError as exc:
                if "no such key" in str(exc).lower():
                    return False
                raise

        def create() -> None:
            try:
                self._r.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.exceptions.OutOfMemoryError:
                raise
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

        if not self._call("XINFO GROUPS", exists):
            self.wait_for_memory("group_create", "XGROUP CREATE", create)

    def wait_for_memory(self, op: str, what: str, fn, *args, **kwargs):
        """:meth:`_call`, waiting while Redis refuses the call at maxmemory (``OutOfMemoryError``): one
        warning every 30 s, ``redis_full_waits{op}`` counted and ``redis_full`` set meanwhile; the call is
        retried until memory is freed (the learner's commit frees it) or raised. A stop request ends the
        wait (:class:`QueueStopped`). The learner's own scripts are never refused (resp.OOM_PASS): this is
        for what Redis still refuses (creating a missing consumer group) and for other Redis servers."""
        since, pause = None, 0.1
        while True:
            try:
                out = self._call(what, fn, *args, **kwargs)
            except redis.exceptions.OutOfMemoryError as exc:
                now = time.monotonic()
                if since is None:
                    since = now
                    metrics.REDIS_FULL_WAITS.labels(op=op).inc()
                    metrics.REDIS_FULL.set(1)
                self._note_full(what, exc, "waiting for memory to be freed (the learner's commit frees it)")
                if self.stop:
                    metrics.REDIS_FULL.set(0)
                    raise QueueStopped(f"stop requested while redis at {self.safe_url} was at maxmemory "
                                       f"({now - since:.1f}s) during {what}") from None
                time.sleep(pause)
                pause = min(pause * 2, 2.0)
                continue
            if since is not None:
                metrics.REDIS_FULL.set(0)
                log.warning("redis at %s took %s again after %.1fs at maxmemory", self.safe_url, what,
                            time.monotonic() - since)
            return out

    def _note_full(self, what: str, exc: Exception, doing: str) -> None:
        """One warning per FULL_WARN_EVERY_S while Redis refuses writes at maxmemory."""
        now = time.monotonic()
        if now - self._oom_logged >= FULL_WARN_EVERY_S:
            self._oom_logged = now
            log.warning("redis at %s refuses %s: it is at maxmemory (%s); %s (raise maxmemory, or lower "
                        "learner.save_steps x groups_per_step or queue.max_pending)", self.safe_url, what,
                        str(exc).split("\n")[0].split(". script:")[0], doing)

    def _with_group(self, what: str, fn, *args):
        """Like _call, but recreate the consumer group once if Redis lost it (restarted without its AOF)."""
        try:
            return self._call(what, fn, *args)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("consumer group %r on %s is gone (redis restarted without data?); recreating it",
                        CONSUMER_GROUP, self.stream)
            self._ensure_group()
            return self._call(what, fn, *args)

    def ping(self) -> bool:
        """True if Redis answers now (no retry); :class:`QueueError` for a mistake (password, TLS: redis_errors)."""
        try:
            ok = bool(self._r.ping())
            self._connected = True
            return ok
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.InvalidResponse) as exc:
            from streamgrpo.transport.queue.errors import misconfiguration

            fatal = misconfiguration(exc, self._r, self.safe_url, "PING", connected=self._connected)
            if fatal:
                raise QueueError(fatal) from None
            return False

    # ------------------------------------------------------------------------ producer
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

    # ------------------------------------------------------------------------ consumer
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

    def memory(self) -> tuple[int, int]:
        """``(used_memory, maxmemory)`` of the Redis server in bytes (maxmemory 0: no limit)."""
        info = self._call("INFO", self._r.info, "memory")
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    def committed_step(self) -> int | None:
        """The highest checkpoint step whose groups were committed (None: none since the last reset)."""
        raw = self._call("GET", self._r.get, self.committed_step_key)
        return None if raw is None else int(raw)

    def reset_committed_step(self) -> None:
        """A learner starting at step 0 (a new run in this namespace) forgets the previous run's committed
        step and data cursor (its generators start their shards from the beginning)."""
        self._call("DEL", self._r.delete, self.committed_step_key, self.cursor_key)

    def committed_cursors(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """The committed data cursor: ``(num_shards, shard)`` -> ``(epoch, position, step)``, the furthest record
        of that shard the learner consumed, committed with the groups of checkpoint ``step`` (empty: none since
        the last reset). A field that does not parse is left out."""
        raw = self._call("HGETALL", self._r.hgetall, self.cursor_key) or {}
        out: dict[tuple[int, int], tuple[int, int, int]] = {}
        for key, value in raw.items():
            try:
                n, k = (int(x) for x in to_str(key).split("/"))
                epoch, position, step = (int(x) for x in to_str(value).split())
            except ValueError:
                continue
            out[(n, k)] = (epoch, position, step)
        return out

    def is_trained(self, group_ids: list[str]) -> list[bool]:
        """Whether each group id was committed as trained within ``dedupe_ttl_s``."""
        if not group_ids:
            return []
        scores = self._call("ZMSCORE", self._r.zmscore, self.trained, list(group_ids))
        horizon = time.time() - self.dedupe_ttl_s
        return [s is not None and s >= horizon for s in scores]

    def held_count(self) -> int:
        """Entries accepted by a learner and not yet committed or released (all consumers)."""
        return int(self._call("HLEN", self._r.hlen, self.held))

    def crash_marks(self) -> CrashMarks:
        """This consumer's crash-loop marks (:mod:`streamgrpo.transport.queue.crash_marks`)."""
        return CrashMarks(self._r, self.namespace, self.consumer)

    def claim_sync_slots(self, version: int, want: int, per_step: int) -> int:
        """On-policy mode: claim up to ``want`` of the ``per_step`` group slots of policy ``version``. All
        generators share one counter per version, so exactly one step's worth of groups is produced with each
        version and the learner never sees a stale group. Waits while Redis is at maxmemory."""
        key = self.keys.sync(version)
        total = int(self.wait_for_memory("sync_claim", "INCRBY", self._r.incrby, key, want))
        self._call("EXPIRE", self._r.expire, key, 24 * 3600)
        return max(0, min(want, per_step - (total - want)))

    def persistence(self) -> dict[str, str] | None:
        """The server's ``append*`` settings (AOF), or None where CONFIG is refused (managed Redis, ACL)."""
        try:
            settings = self._r.config_get("append*")
        except redis.RedisError:
            return None
        return {to_str(k): to_str(v) for k, v in settings.items()}

    def entries(self, count: int | None = None) -> list[tuple[str, str, bytes]]:
        """``(stream id, group id, message bytes)`` of the stream's first ``count`` entries (None: all), read only."""
        raw = self._call("XRANGE", self._r.xrange, self.stream, "-", "+", count=count)
        return [(to_str(sid), fields.get(b"g", b"").decode(errors="replace"), fields.get(b"d", b""))
                for sid, fields in raw]

    # ------------------------------------------------------------------------ inspection
    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (RESP2, bytes replies; no automatic retry) for small side keys."""
        return self._r

    def in_flight(self) -> list[str]:
        """Stream ids delivered to this consumer and not yet acked."""
        with self._lock:
            return list(self._inflight)

    def dead_letters(self, count: int | None = 100) -> list[dict[str, Any]]:
        """The newest ``count`` dead letters (None: all; without raw bytes), newest first."""
        raw = self._call("XREVRANGE", self._r.xrevrange, self.dead, count=count)
        return [
            {"id": to_str(sid), **{to_str(k): (to_str(v) if k != b"data" else len(v)) for k, v in fields.items()}}
            for sid, fields in raw
        ]

    def close(self) -> None:
        """Release the connections; in-flight entries stay pending in Redis (re-read on restart or claimed)."""
        if not self._closed:
            self._closed = True
            if self._full_since is not None:
                metrics.BACKPRESSURE.set(0)
            self._r.close()  # only drops sockets; never talks to the server

    def __repr__(self) -> str:
        return f"RedisQueue({self.safe_url!r}, stream={self.stream!r}, consumer={self.consumer!r})"
