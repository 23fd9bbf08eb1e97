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

The producer side (:mod:`.redis_producer`) and the consumer side with its dead letters
(:mod:`.redis_consumer`) are mixins of :class:`RedisQueue`; this module holds the connection (retries,
maxmemory waits, the consumer group) and the inspection calls.

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
    GroupQueue,
    QueueError,
    QueueFull,
    QueueStopped,
)
from streamgrpo.transport.queue.crash_marks import CrashMarks
from streamgrpo.transport.queue.errors import tls_on_plain_port
from streamgrpo.transport.queue.keys import CONSUMER_GROUP, Keys
from streamgrpo.transport.queue.redis_consumer import StreamConsumer
from streamgrpo.transport.queue.redis_producer import StreamProducer
from streamgrpo.transport.queue.resp import (
    COMMIT_LUA,
    DEAD_LUA,
    FAIL_LUA,
    HOLD_LUA,
    RELEASE_LUA,
    safe_url,
    to_str,
)
from streamgrpo.wire import DEFAULT_MAX_BYTES

if TYPE_CHECKING:
    from streamgrpo.config import QueueConfig

log = logging.getLogger(__name__)

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


class RedisQueue(StreamProducer, StreamConsumer, GroupQueue):
    """ScoredGroups over a Redis stream; see the module docstring for the keys and guarantees. The producer's
    calls come from :class:`StreamProducer`, the consumer's from :class:`StreamConsumer`.

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
