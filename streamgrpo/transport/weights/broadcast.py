"""The :class:`~.publisher.WeightPublisher`'s background thread: it sends each version chunk by chunk on
the PUB socket (whole, or as a delta to the previous version), announces the latest one with heartbeats,
and answers snapshot requests on the ROUTER socket with the latest complete version's chunks.

:class:`Broadcaster` is mixed into WeightPublisher, which owns the sockets, the lock and condition, the
version slots (``_pending``, ``_current``, ``_latest``, ``_retired``) and the hash pool; the protocol is in
:mod:`.codec` and docs/protocol.md.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import zmq

from streamgrpo.metrics import (
    ERRORS,
    WEIGHT_BYTES,
    WEIGHT_DELTA_RATIO,
    WEIGHT_SUBSCRIBERS,
    WEIGHT_VERSION_BYTES,
    WEIGHT_VERSIONS,
)
from streamgrpo.transport.weights.codec import (
    BEAT_S,
    TOPIC,
    TOPIC_BEAT,
    TOPIC_DELTA,
    VersionMeta,
    chunk_digest,
    chunk_span,
    encode_delta_meta,
    encode_header,
    make_header,
    n_chunks_for,
    report_error,
)
from streamgrpo.transport.weights.delta import encode_delta
from streamgrpo.transport.weights.outgoing import OutgoingVersion
from streamgrpo.transport.weights.sockets import endpoint

log = logging.getLogger("streamgrpo.transport.weights.publisher")


class Broadcaster:
    """The sender thread's work (a mixin of WeightPublisher): :meth:`_serve` is its loop."""

    def _raise_hwm(self, hwm: int) -> None:
        """Rebind PUB with a high-water mark that holds two versions (libzmq applies a new HWM only to
        new connections). Subscribers reconnect by themselves; what they miss meanwhile comes from
        the snapshot endpoint. Happens once, at the first version bigger than ``sndhwm`` allows."""
        self._drop_monitor()
        self._pub.close(linger=0)
        self._pub = self._socket(zmq.PUB, hwm)
        self._pub_monitor = self._pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.subscribers = 0
        if ":" in self.bind_host:
            self._pub.ipv6 = True
        tcp = [endpoint(self.bind_host, self.pub_port)] if self.pub_port is not None else []
        for ep in tcp + ([self._ipc[0]] if self._ipc else []):
            for _ in range(250):  # the old listener closes asynchronously
                try:
                    self._pub.bind(ep)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE:
                        raise
                    time.sleep(0.02)
            else:
                raise RuntimeError(f"weights: could not rebind PUB endpoint {ep}")
        log.info("weights: PUB high-water mark raised from %d to %d messages (two versions)", self._hwm, hwm)
        self._hwm = hwm

    def _count_subscribers(self) -> None:
        """Follow PUB's connections (accepted minus disconnected): the fan-out gauge."""
        from zmq.utils.monitor import recv_monitor_message

        mon = self._pub_monitor
        while mon is not None and mon.poll(0):
            event = recv_monitor_message(mon)["event"]
            self.subscribers += 1 if event == zmq.EVENT_ACCEPTED else -1 if event == zmq.EVENT_DISCONNECTED else 0
        self.subscribers = max(0, self.subscribers)
        WEIGHT_SUBSCRIBERS.set(self.subscribers)

    def _beat(self) -> None:
        """Announce the latest complete version, so a subscriber that lost a version's tail notices."""
        latest = self._latest
        if latest is not None:
            self._pub.send_multipart([TOPIC_BEAT, msgpack.packb({"s": latest.meta.src, "v": latest.meta.version})])
            self._last_beat = time.monotonic()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_pull, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        while True:
            try:
                events = dict(poller.poll(int(BEAT_S * 1000)))
                if self._wake_pull in events:
                    while self._wake_pull.poll(0):
                        self._wake_pull.recv()
                with self._cv:
                    job, self._pending = self._pending, None
                    self._sending = job is not None
                    self._current = job
                    if job is None and self._closing:
                        return
                if job is not None:
                    self._send(job)
                self._drain_outbox()
                self._answer_snapshots()
                self._count_subscribers()
                if time.monotonic() - self._last_beat >= BEAT_S:
                    self._beat()
            except zmq.ContextTerminated:
                return
            except Exception:
                ERRORS.labels(kind="weights").inc()
                log.exception("weights publisher: unexpected error (continuing)")
                with self._cv:
                    if self._sending and self._current is not None and self._current is not self._latest:
                        self._retired.append(self._current)  # its buffer goes back to the pool
                    self._sending = False
                    self._cv.notify_all()

    def _ready_upto(self, job: OutgoingVersion, end: int, block: bool) -> bool:
        """Advance ``job.ready`` over the marks whose copies are done (waiting for them if ``block``)
        until it covers ``end``. False when the version was given up."""
        while job.ready < end:
            with self._cv:
                if not job.marks:
                    if not block:
                        return False
                    self._cv.wait_for(lambda: job.marks or job.failed or self._closing, 1.0)
                    if job.failed or (self._closing and not job.marks):
                        return False
                    continue
                mark_end, event = job.marks[0]
            if event is not None:
                if block:
                    event.synchronize()
                elif not event.query():
                    return False
            with self._cv:
                job.marks.popleft()
            job.ready = max(job.ready, mark_end)
        return True

    def _send(self, job: OutgoingVersion) -> None:
        base = self._latest
        if (self.delta_max_ratio is not None and base is not None and base.meta.nbytes == job.meta.nbytes
                and base.layout.header == job.layout.header):
            if self._send_delta(job, base):
                return
        self._send_full(job)

    def _send_delta(self, job: OutgoingVersion, base: OutgoingVersion) -> bool:
        """Send ``job`` as its delta to ``base`` (the latest version) when that is at most
        ``delta_max_ratio`` of its bytes; False (nothing sent) when it is not. Waits for all of ``job``'s
        bytes first: a delta cannot stream while the version is still being written."""

        meta = job.meta
        if not self._ready_upto(job, meta.nbytes, block=True) or not self._committed(job):
            self._give_up(job)
            return True
        full, prev = job.buf_N.numpy(), base.buf_N.numpy()
        mv = memoryview(full)
        hashing = [self._hash_pool.submit(chunk_digest, meta.algo, mv[slice(*chunk_span(meta, i))],
                                          job.meta_bytes if i == 0 else None)
                   for i in range(meta.n_chunks)]  # of the full version (snapshots, checks after applying), meanwhile
        if self._delta_pool is None:
            self._delta_pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="weights-delta")
        raw = encode_delta(prev, full, executor=self._delta_pool, max_bytes=int(self.delta_max_ratio * meta.nbytes))
        digests = [f.result() for f in hashing]
        WEIGHT_DELTA_RATIO.set(1.0 if raw is None else len(raw) / max(1, meta.nbytes))
        if raw is None:  # stopped as soon as it passed delta_max_ratio of the version
            return False  # (the full path hashes again: only while deltas do not pay, early in training)
        job.digests, job.delta = digests, raw
        dmeta = VersionMeta(meta.version, meta.src, len(raw), self.chunk_bytes, n_chunks_for(len(raw), self.chunk_bytes),
                            meta.published_at, meta.algo)
        dmeta_bytes = encode_delta_meta(dmeta, base.meta.version, job.meta_bytes, digests)
        if 2 * dmeta.n_chunks + 16 > self._hwm:
            self._raise_hwm(2 * dmeta.n_chunks + 16)
        dv = memoryview(raw)
        for seq in range(dmeta.n_chunks):
            start, end = chunk_span(dmeta, seq)
            header = encode_header(make_header(dmeta, seq, dmeta_bytes, chunk_digest(
                dmeta.algo, dv[start:end], dmeta_bytes if seq == 0 else None)))
            job.trackers.append(self._pub.send_multipart([TOPIC_DELTA, header, dv[start:end]], copy=False, track=True))
            self._answer_snapshots()
        self.deltas_sent += 1
        self._finish(job, "delta", len(raw))
        return True

    def _committed(self, job: OutgoingVersion) -> bool:
        """Wait until the caller's commit() (or abort) of ``job``: True when committed."""
        with self._cv:  # the caller may still be inside commit(): wait for it (bytes are all final)
            self._cv.wait_for(lambda: job.committed or job.failed or self._closing)
        return job.committed

    def _finish(self, job: OutgoingVersion, kind: str, sent: int) -> None:
        """``job`` went out whole (or as a delta): it is the latest version now."""
        WEIGHT_BYTES.inc(sent)
        WEIGHT_VERSIONS.labels(kind=kind).inc()
        WEIGHT_VERSION_BYTES.labels(kind=kind).inc(sent)
        with self._cv:
            if self._latest is not None:
                self._retired.append(self._latest)
            self._latest = job
            self._sending = False
            self.versions_sent += 1
            self._cv.notify_all()
        self._version_out(job)
        self._beat()

    def _send_full(self, job: OutgoingVersion) -> None:
        meta, mv = job.meta, memoryview(job.buf_N.numpy())
        if 2 * meta.n_chunks + 16 > self._hwm:
            self._raise_hwm(2 * meta.n_chunks + 16)
        ahead = 2 * self._hash_threads
        futures: dict[int, object] = {}
        next_hash = 0
        for seq in range(meta.n_chunks):
            while next_hash < meta.n_chunks and next_hash < seq + ahead:
                start, end = chunk_span(meta, next_hash)
                if not self._ready_upto(job, end, block=next_hash <= seq):
                    if job.failed or self._closing:
                        return self._give_up(job)
                    break
                futures[next_hash] = self._hash_pool.submit(chunk_digest, meta.algo, mv[start:end],
                                                            job.meta_bytes if next_hash == 0 else None)
                next_hash += 1
            start, end = chunk_span(meta, seq)
            digest = futures.pop(seq).result()
            job.digests.append(digest)
            self._chunk_out(job, seq)
            header = encode_header(make_header(meta, seq, job.meta_bytes, digest))
            job.trackers.append(self._pub.send_multipart([TOPIC, header, mv[start:end]], copy=False, track=True))
            self._answer_snapshots()  # keep late joiners served while a big version goes out
        if not self._committed(job):  # aborted after its last byte: subscribers got it whole, but it is not a version
            return self._give_up(job)
        self._finish(job, "full", meta.nbytes)

    def _give_up(self, job: OutgoingVersion) -> None:
        self._version_dropped(job)
        with self._cv:
            self._sending = False
            self._retired.append(job)
            self._cv.notify_all()

    def _answer_snapshots(self, limit: int = 256) -> None:
        for _ in range(limit):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ident, kind, body = frames
                req = msgpack.unpackb(body, raw=False)
                rid, want, seq = req["r"], req["v"], req["q"]
                if kind != b"snap" or not all(isinstance(x, int) for x in (rid, want, seq)):
                    raise ValueError("not a snapshot request")
            except Exception as exc:
                report_error(f"weights publisher: malformed snapshot request ({exc})")
                continue
            latest = self._latest
            if latest is None:
                self._router.send_multipart([ident, b"none", msgpack.packb({"r": rid})])
            elif (want != -1 and want != latest.meta.version) or not 0 <= seq < latest.meta.n_chunks:
                self._router.send_multipart([ident, b"gone", msgpack.packb({"r": rid, "v": latest.meta.version})])
            else:
                start, end = chunk_span(latest.meta, seq)
                header = encode_header(make_header(latest.meta, seq, latest.meta_bytes, latest.digests[seq], req=rid))
                chunk = memoryview(latest.buf_N.numpy())[start:end]
                tracker = self._router.send_multipart([ident, TOPIC, header, chunk], copy=False, track=True)
                with self._lock:
                    latest.trackers.append(tracker)
                WEIGHT_BYTES.inc(end - start)
