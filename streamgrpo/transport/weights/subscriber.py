"""Generator side of the weight channel: :class:`WeightSubscriber` (see :mod:`.publisher` for the design)."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import zmq

from streamgrpo.metrics import ERRORS, POLICY_VERSION, WEIGHT_BYTES, WEIGHT_DELTAS, WEIGHT_SYNC_SECONDS
from streamgrpo.transport.weights.base import WeightsStatus, WeightSyncClient
from streamgrpo.transport.weights.codec import (
    TOPIC,
    TOPIC_BEAT,
    TOPIC_DELTA,
    Assembler,
    ChunkHeader,
    Completed,
    VersionMeta,
    WeightsFormatError,
    chunk_digest,
    chunk_span,
    decode_delta_meta,
    decode_header,
    default_hash_threads,
    key_of,
    newer,
    report_error,
    select_chunks,
)
from streamgrpo.transport.weights.delta import apply_delta
from streamgrpo.transport.weights.keys import client_keys, server_keys
from streamgrpo.transport.weights.layout import parse_layout
from streamgrpo.transport.weights.links import Links
from streamgrpo.transport.weights.sockets import endpoint, ipc_endpoints

log = logging.getLogger("streamgrpo.transport.weights")


@dataclass
class _Fetch:
    rid: int
    asm: Assembler
    last_activity: float
    key: tuple[int, int] | None = None
    n_chunks: int = 1
    next_seq: int = 1
    outstanding: int = 1


class WeightSubscriber(WeightSyncClient):
    """Generator side: a background thread receives, verifies and parks the newest version.

    ``poll()`` hands out only complete, digest-verified versions newer than the last one it
    returned. Lost or corrupt versions are counted in ``streamgrpo_errors_total{kind="weights"}``
    and repaired from the snapshot endpoint, which is also asked at start-up (late joiners).
    ``pin_memory=True`` receives into pinned buffers (fast, asynchronous copies to a CUDA model).
    Chunks are copied into preallocated receive buffers and hashed by ``copy_threads`` worker
    threads, off the receiving thread. ``ipc_dir`` connects to the publisher's ``ipc://`` sockets
    there instead of TCP (generators on the learner's host); :class:`~.shm_subscriber.ShmSubscriber`
    reads each new version from the learner's shared-memory file instead of receiving its bytes.

    ``delta=True`` also takes versions sent as deltas (``weights.delta``): it keeps a private copy of
    the last whole version (one payload of host memory), applies each delta to it, checks the result
    against the full version's chunk digests, and fetches the snapshot when it does not hold the
    version a delta applies to (it missed one) or the result does not check.

    :meth:`status` says why no weights arrive (key refused, handshake failed, learner unreachable,
    nothing published yet) from the sockets' monitor events (:mod:`.links`); after an auth
    or protocol failure, which libzmq never retries, both endpoints are dialled again every
    ``redial_s`` seconds.
    """

    def __init__(
        self,
        connect_host: str = "127.0.0.1",
        pub_port: int = 5555,
        snapshot_port: int = 5556,
        curve_keys_dir: str | None = None,
        client_key: str | None = None,
        *,
        pin_memory: bool = False,
        snapshot_credit: int = 4,
        repair_delay_s: float = 0.2,
        retry_s: float = 0.5,
        snapshot_timeout_s: float = 10.0,
        copy_threads: int | None = None,
        ipc_dir: str | os.PathLike | None = None,
        redial_s: float = 5.0,
        delta: bool = False,
    ):

        self.pin_memory = pin_memory
        self.credit = max(1, snapshot_credit)
        self.repair_delay_s, self.retry_s, self.snapshot_timeout_s = repair_delay_s, retry_s, snapshot_timeout_s
        if ipc_dir is not None:  # (a path too long for a socket: one line before any socket)
            pub_ep, snap_ep = ipc_endpoints(ipc_dir)
        else:
            pub_ep, snap_ep = endpoint(connect_host, pub_port), endpoint(connect_host, snapshot_port)
        self._ctx = zmq.Context()
        self._ctx.linger = 0  # every socket: a term() never waits on messages nobody will take
        try:
            self._connect(connect_host, curve_keys_dir, client_key, delta, pub_ep, snap_ep, redial_s)
            self._pool = ThreadPoolExecutor(copy_threads or default_hash_threads(), thread_name_prefix="weights-recv")
            self._wake_addr = f"inproc://weights-sub-{secrets.randbits(62)}"
            self._wake_pull = self._ctx.socket(zmq.PULL)
            self._wake_pull.bind(self._wake_addr)
            self._wake_push = self._ctx.socket(zmq.PUSH)
            self._wake_push.connect(self._wake_addr)
            self._init_state()
            self._setup_backend()
        except BaseException:
            self._abandon()
            raise
        self._thread = threading.Thread(target=self._run, name="weights-subscriber", daemon=True)
        self._thread.start()

    def _abandon(self) -> None:
        """A constructor that failed half-way leaves nothing open: a context left to the garbage collector
        closes its sockets in whatever thread collects it and can hang in its term()."""
        for s in (getattr(self, "_sub", None), getattr(self, "_dealer", None)):
            if s is not None and not s.closed:
                try:
                    s.disable_monitor()
                except zmq.ZMQError:
                    pass
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False)
        self._ctx.destroy(linger=0)

    def _connect(self, connect_host, curve_keys_dir, client_key, delta, pub_ep, snap_ep, redial_s) -> None:
        self._sub = self._ctx.socket(zmq.SUB)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.immediate = True  # sends fail fast (EAGAIN) while not connected/authorised
        for s in (self._sub, self._dealer):
            s.linger = 0
            if ":" in connect_host:
                s.ipv6 = True
        if curve_keys_dir:
            server_public, _ = server_keys(curve_keys_dir, secret=False)
            public, secret = client_keys(curve_keys_dir, client_key)
            for s in (self._sub, self._dealer):
                s.curve_serverkey = server_public
                s.curve_publickey = public
                s.curve_secretkey = secret
        self._sub.subscribe(self._data_topic)
        self._sub.subscribe(TOPIC_BEAT)
        self.delta = delta
        if delta:
            self._sub.subscribe(TOPIC_DELTA)
        self._links = Links([("PUB", self._sub, pub_ep), ("snapshot", self._dealer, snap_ep)],
                            curve=bool(curve_keys_dir), client=str(client_key) if client_key else None,
                            redial_s=redial_s)  # monitors first: they see the first connection attempt
        self._learner_empty = False  # the snapshot endpoint answered that nothing is published yet
        self._sub.connect(pub_ep)
        self._dealer.connect(snap_ep)

    def _init_state(self) -> None:
        self._cv = threading.Condition(threading.RLock())
        self._ready: Completed | None = None
        self._have: VersionMeta | None = None  # newest of ready / last returned
        self._last: VersionMeta | None = None  # last returned by poll()
        self._closing = False
        self._spares: list[torch.Tensor] = []  # receive buffers ready for reuse (at most 2)
        self._returned: torch.Tensor | None = None  # buffer of the version poll() last returned
        self._pub_asm = Assembler(self._alloc, self._release, self._pool)
        self._delta_asm = Assembler(lambda n: torch.empty(max(n, 1), dtype=torch.uint8)[:n], None, self._pool,
                                    tensor_table=False)
        self._base: tuple[tuple[int, int], np.ndarray] | None = None  # (key, private copy) of the last whole version
        self._delta_joined = False  # a delta's chunk 0 seen (chunks before it are no loss)
        self._fetch: _Fetch | None = None
        self._fetch_due: float | None = time.monotonic()  # late joiner: ask the snapshot at once
        self._announced: tuple[int, int] | None = None  # newest version a heartbeat announced
        self._joined = False  # a version start seen on PUB (chunks before the first one are no loss)
        self._rid = 0
        self.stats = {"returned": 0, "from_pub": 0, "from_snapshot": 0, "from_delta": 0, "discarded": 0,
                      "snapshot_requests": 0, "beats": 0, "delta_no_base": 0}

    # -- caller thread ---------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest verified version not returned yet, waiting up to ``timeout_s``; else None.

        The tensors are CPU views into one receive buffer; they stay valid until
        :meth:`mark_applied` hands that buffer back (``release=True``), so copy them (e.g. with
        :func:`~streamgrpo.models.apply.apply_to_model`) before calling it.
        """
        with self._cv:
            self._cv.wait_for(lambda: self._ready is not None or self._closing, max(0.0, timeout_s))
            done, self._ready = self._ready, None
            if done is None:
                return None
            self._last = done.meta
            self._returned = done.buf_N
        self.stats["returned"] += 1
        return done.meta.version, done.tensors()

    def request_snapshot(self, timeout_s: float = 10.0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Ask the snapshot endpoint for the latest version now and wait for it (or a newer PUB one)."""
        with self._cv:
            self._fetch_due = time.monotonic()
            self._wake_push.send(b"", zmq.NOBLOCK)
        return self.poll(timeout_s)

    @property
    def version(self) -> int | None:
        """Version last returned by :meth:`poll`."""
        return self._last.version if self._last else None

    def status(self) -> WeightsStatus:
        """Why weights do (not) arrive: the worst of the two connections (PUB, snapshot), in one line."""
        with self._cv:
            have, empty = self._have, self._learner_empty
        return self._links.status(have.version if have is not None else None, learner_empty=empty)

    @property
    def source(self) -> int | None:
        """Publisher id of the version last returned by :meth:`poll` (a restarted learner has a new one)."""
        return self._last.src if self._last else None

    @property
    def published_at(self) -> float | None:
        """Wall time (``time.time()``) at which the last returned version was published."""
        return self._last.published_at if self._last else None

    def mark_applied(self, release: bool = True) -> float | None:
        """Record that the last returned version is now in use: observes ``streamgrpo_weight_sync_seconds``
        (publish to applied) and sets ``streamgrpo_policy_version{role="generator"}``; returns the seconds.

        ``release=True`` also hands the version's receive buffer back for reuse (a fresh buffer costs
        page faults at every version): the tensors :meth:`poll` returned must not be read afterwards.
        Pass ``release=False`` to keep them (e.g. to apply a version later).
        """
        if self._last is None:
            return None
        if release:
            with self._cv:
                buf, self._returned = self._returned, None
                if buf is not None:
                    self._release(buf)
        seconds = max(0.0, time.time() - self._last.published_at)
        WEIGHT_SYNC_SECONDS.observe(seconds)
        POLICY_VERSION.labels(role="generator").set(self._last.version)
        return seconds

    def close(self) -> None:
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._wake_push.send(b"", zmq.NOBLOCK)
            self._cv.notify_all()
        self._thread.join(5.0)
        self._pool.shutdown(wait=True)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- buffers ----------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> torch.Tensor:
        with self._cv:
            for i, b in enumerate(self._spares):
                if nbytes <= b.numel() <= 2 * nbytes + (1 << 16):
                    return self._spares.pop(i)[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin_memory)[:nbytes]

    def _release(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        with self._cv:
            self._spares = [base, *self._spares][:2]

    # -- what a backend built on this one changes (ShmSubscriber) -----------------------------------
    _data_topic = TOPIC  # the PUB topic that carries versions to this subscriber

    def _setup_backend(self) -> None:
        """Called once in the constructor, before the receiver thread starts."""

    def _side_message(self, frames: list) -> bool:
        """A PUB message of the backend's own (receiver thread); True when it was one."""
        return False

    # -- receiver thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        monitors = self._links.monitors
        for s in (self._sub, self._dealer, self._wake_pull, *monitors):
            poller.register(s, zmq.POLLIN)
        while not self._closing:
            try:
                events = dict(poller.poll(50))
                if any(m in events for m in monitors):
                    self._links.drain()
                if self._wake_pull in events:
                    while self._wake_pull.poll(0):
                        self._wake_pull.recv()
                if self._sub in events:
                    self._drain_pub()
                if self._dealer in events:
                    self._drain_snapshot()
                self._tick()
            except zmq.ContextTerminated:
                return
            except Exception:
                ERRORS.labels(kind="weights").inc()
                log.exception("weights subscriber: unexpected error (continuing)")
                time.sleep(0.05)

    def _dropped(self, why: str, repair: bool) -> None:
        report_error(why)
        self.stats["discarded"] += 1
        if repair and self._fetch is None and self._fetch_due is None:
            self._fetch_due = time.monotonic() + self.repair_delay_s

    def _offer(self, done: Completed, source: str) -> None:
        with self._cv:
            if not newer(done.meta, self._have):
                self._release(done.buf_N)
                return
        if self.delta and source != "delta":  # the base the next delta applies to (a delta updated it in place)
            self._keep_base(done)
        with self._cv:
            old, self._ready, self._have = self._ready, done, done.meta
            self._cv.notify_all()
        if old is not None:
            self._release(old.buf_N)
        self.stats["from_" + source] += 1
        self._fetch_due = None
        for asm in (self._pub_asm, self._delta_asm):
            cur = asm.in_progress
            if cur is not None and not newer(cur[0], done.meta):
                asm.reset()
        if self._fetch is not None and (self._fetch.key is None or not newer(self._fetch.key, done.meta)):
            self._abort_fetch()

    def _drain_pub(self, limit: int = 512) -> None:
        """Take up to ``limit`` waiting PUB messages: heartbeats, the backend's own, delta chunks and
        whole-version chunks (assembled as one batch); then look for versions whose tail was lost."""
        batch = []
        for _ in range(limit):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                if frames[0].bytes == TOPIC_BEAT and len(frames) == 2:
                    self._beat(frames[1].bytes)
                    continue
                if self._side_message(frames):
                    continue
                if frames[0].bytes == TOPIC_DELTA and self.delta:
                    if len(frames) != 3:
                        raise WeightsFormatError(f"weights delta message has {len(frames)} frames, expected 3")
                    if batch:  # whole versions before it first: the delta may apply to one of them
                        self._assemble(batch)
                        batch = []
                    self._delta_chunk(frames)
                    continue
                if len(frames) != 3:
                    raise WeightsFormatError(f"weights message has {len(frames)} frames, expected 3")
                h = decode_header(frames[1].bytes)
            except (WeightsFormatError, KeyError, ValueError, TypeError) as exc:
                self._dropped(f"weights: malformed message ({exc})", repair=True)
                continue
            self._whole_chunk(h, frames[2], batch)
        if batch:
            self._assemble(batch)
        self._check_announced()

    def _beat(self, payload: bytes) -> None:
        """A heartbeat: note the version it announces when newer than the last one announced."""
        beat = msgpack.unpackb(payload)
        key = (int(beat["s"]), int(beat["v"]))
        self.stats["beats"] += 1
        if newer(key, self._announced):
            self._announced = key

    def _whole_chunk(self, h: ChunkHeader, frame, batch: list) -> None:
        """A chunk of a whole version: added to ``batch`` when newer than what is held, once this
        subscriber has seen a version's first chunk."""
        WEIGHT_BYTES.inc(len(frame))
        if h.seq == 0:
            self._joined = True
        elif not self._joined:
            return  # subscribed in the middle of a version: its tail is no loss (the snapshot covers it)
        if newer(h, self._have):  # older or already-held versions cost nothing
            batch.append((h, frame))

    def _check_announced(self) -> None:
        """Heartbeats follow a version's last chunk: if the announced version is newer than what we
        hold and nothing newer is arriving, its chunks were lost (e.g. at the high-water mark): the
        partial versions are dropped and the snapshot is due now (unless a fetch is under way)."""
        announced = self._announced
        partial = [a for a in (self._pub_asm, self._delta_asm) if a.in_progress is not None]
        if (announced is not None and newer(announced, self._have)
                and not any(newer(a.in_progress[0], announced) for a in partial)):
            self._announced = None
            for a in partial:  # (whole version or delta) not newer than the announced one: its tail was lost
                (_, version), got = a.in_progress
                a.reset()
                self._dropped(f"weights version {version}: incomplete ({got} chunks), its tail was lost", repair=False)
            if self._fetch is None:
                self._fetch_due = time.monotonic()

    # -- deltas ------------------------------------------------------------------------------------
    def _keep_base(self, done: Completed) -> None:
        """Copy a whole version aside: the next delta is applied to this copy."""
        src = done.buf_N.numpy()
        if self._base is not None and self._base[1].size == src.size:
            base = self._base[1]
        else:
            self._base = None
            base = np.empty(src.size, np.uint8)
        np.copyto(base, src)
        self._base = (key_of(done.meta), base)

    def _delta_chunk(self, frames: list) -> None:
        h = decode_header(frames[1].bytes)
        WEIGHT_BYTES.inc(len(frames[2]))
        if h.seq == 0:
            self._delta_joined = True
        elif not self._delta_joined:
            return  # subscribed in the middle of a delta: no loss (the snapshot covers it)
        if not newer(h, self._have):
            return
        done, why = self._delta_asm.feed(h, frames[2].buffer)
        if why:
            WEIGHT_DELTAS.labels(result="lost").inc()  # a gap or a bad chunk on the way
            self._dropped(why, repair=True)
        if done is not None:
            self._apply_delta(done)

    def _apply_delta(self, done: Completed) -> None:
        """Apply a whole, digest-checked delta to the base copy; check the result against the full
        version's digests; offer it. Without the right base (a version missed, or none yet): the snapshot."""

        try:
            info = decode_delta_meta(done.raw_meta)
        except WeightsFormatError as exc:
            WEIGHT_DELTAS.labels(result="corrupt").inc()
            return self._dropped(f"weights delta v{done.meta.version}: {exc}", repair=True)
        full = info.full
        if not newer(full, self._have):
            return
        if self._base is None or self._base[0] != (full.src, info.base) or self._base[1].size != full.nbytes:
            WEIGHT_DELTAS.labels(result="no_base").inc()
            self.stats["delta_no_base"] += 1
            log.debug("weights: delta v%d -> v%d, not holding v%d: fetching the snapshot", info.base, full.version,
                      info.base)
            if self._fetch is None:
                self._fetch_due = time.monotonic()
            return None
        base = self._base[1]
        self._base = None  # changed in place from here: a failure below leaves no base
        try:
            apply_delta(base, done.buf_N.numpy())
        except WeightsFormatError as exc:
            WEIGHT_DELTAS.labels(result="corrupt").inc()
            return self._dropped(f"weights delta v{full.version}: {exc}", repair=True)
        mv = memoryview(base)
        ok = list(self._pool.map(
            lambda i: chunk_digest(full.algo, mv[slice(*chunk_span(full, i))], info.full_meta if i == 0 else None)
            == info.digests[i], range(full.n_chunks)))
        if not all(ok):
            WEIGHT_DELTAS.labels(result="corrupt").inc()
            return self._dropped(f"weights version {full.version}: digest mismatch ({full.algo}) in chunk "
                                 f"{ok.index(False)} after applying its delta: discarded", repair=True)
        try:
            entries = parse_layout(base)
        except WeightsFormatError as exc:
            WEIGHT_DELTAS.labels(result="corrupt").inc()
            return self._dropped(f"weights version {full.version}: malformed tensor table after its delta ({exc})",
                                 repair=True)
        self._base = ((full.src, full.version), base)
        self._delta_digests = info.digests  # the full version's, for a relay that serves it on
        buf = self._alloc(full.nbytes)
        np.copyto(buf.numpy(), base)
        WEIGHT_DELTAS.labels(result="applied").inc()
        self._offer(Completed(full, buf, entries, info.full_meta), "delta")
        return None

    def _worth_assembling(self, batch: list) -> list[int]:
        """Indices of ``batch`` to feed (:func:`select_chunks`); drops a partial version that a newer
        complete one in the batch supersedes."""
        keep = select_chunks([h for h, _ in batch], self._pub_asm.in_progress)
        if keep and keep[0] > 0 and self._pub_asm.in_progress is not None:
            if self._pub_asm.in_progress[0] == key_of(batch[0][0]):
                self._pub_asm.reset()  # superseded by a newer complete version in this batch
        return keep

    def _assemble(self, batch: list) -> None:
        for i in self._worth_assembling(batch):
            h, frame = batch[i]
            done, why = self._pub_asm.feed(h, frame.buffer)
            if why:
                self._dropped(why, repair=True)
            if done is not None:
                self._offer(done, "pub")

    # -- snapshot fetch ----------------------------------------------------------------------------
    def _request(self, f: _Fetch, version: int, seq: int) -> bool:
        try:
            self._dealer.send_multipart([b"snap", msgpack.packb({"r": f.rid, "v": version, "q": seq})], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _tick(self) -> None:
        self._links.redial_due()
        now = time.monotonic()
        f = self._fetch
        if f is not None and now - f.last_activity > self.snapshot_timeout_s:
            log.warning("weights subscriber: snapshot fetch timed out after %.1f s; retrying", self.snapshot_timeout_s)
            self._abort_fetch()
            self._fetch_due = now + self.retry_s
        if self._fetch is None and self._fetch_due is not None and now >= self._fetch_due:
            self._rid += 1
            f = _Fetch(self._rid, Assembler(self._alloc, self._release, self._pool), now)
            if self._request(f, -1, 0):
                self._fetch, self._fetch_due = f, None
                self.stats["snapshot_requests"] += 1
            else:  # not connected (yet), or not authorised
                self._fetch_due = now + self.retry_s

    def _abort_fetch(self) -> None:
        if self._fetch is not None:
            self._fetch.asm.reset()
        self._fetch = None

    def _drain_snapshot(self, limit: int = 64) -> None:
        for _ in range(limit):
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            f = self._fetch
            try:
                kind = frames[0].bytes
                if kind in (b"none", b"gone"):
                    rid = msgpack.unpackb(frames[1].bytes)["r"]
                    if kind == b"none" and self._have is None:
                        with self._cv:
                            self._learner_empty = True
                    if f is not None and rid == f.rid:
                        self._abort_fetch()
                        now = time.monotonic()
                        # nothing published yet: ask again soon; version gone: ask for the new one now
                        self._fetch_due = now if kind == b"gone" else (now + 2 * self.retry_s if self._have is None else None)
                    continue
                if kind != TOPIC or len(frames) != 3:
                    raise WeightsFormatError(f"weights snapshot reply {kind[:8]!r} with {len(frames)} frames")
                h = decode_header(frames[1].bytes)
            except (WeightsFormatError, KeyError, ValueError, TypeError) as exc:
                self._dropped(f"weights snapshot: malformed reply ({exc})", repair=False)
                continue
            if f is None or h.req != f.rid:
                continue  # a reply to an abandoned fetch
            WEIGHT_BYTES.inc(len(frames[2]))
            f.last_activity = time.monotonic()
            f.outstanding -= 1
            if h.seq == 0:
                if not newer(h, self._have):
                    self._abort_fetch()  # we already hold this version or a newer one
                    continue
                f.key, f.n_chunks = key_of(h), h.n_chunks
            done, why = f.asm.feed(h, frames[2].buffer)
            if why:
                self._abort_fetch()
                self._dropped(why, repair=False)
                self._fetch_due = time.monotonic() + self.retry_s
                continue
            if done is not None:
                self._fetch = None
                self._offer(done, "snapshot")
                continue
            while f.outstanding < self.credit and f.next_seq < f.n_chunks and f.key is not None:
                if not self._request(f, f.key[1], f.next_seq):
                    break
                f.next_seq += 1
                f.outstanding += 1
