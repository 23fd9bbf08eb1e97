"""Weight broadcast over ZeroMQ (design.md §4): learner rank 0 publishes, generators subscribe.

Publisher (learner)::

    pub = WeightPublisher.from_config(cfg.weights)
    pub.publish(version, dict(model.state_dict()))    # returns once the bytes are copied out
    pub.close()

Subscriber (generator), applying at a safe point between generation batches::

    sub = WeightSubscriber.from_config(cfg.weights, client_key=f"client-{generator_id}")
    got = sub.poll()                                  # (version, tensors) or None; never blocks by default
    if got:
        apply_to_model(model, got[1]); sub.mark_applied()

How it works. ``publish`` copies every tensor once into a flat byte buffer (pinned when they live
on CUDA) and hands it to a background thread, which sends it as chunks ``[b"w", header, payload]``
on a PUB socket with zero-copy frames, hashing as it goes (the digest rides on the last chunk).
The same thread owns a ROUTER socket that serves the latest complete version chunk by chunk on
request (credit-based, so a slow client never blocks anyone), and sends a heartbeat
``[b"h", {src, version}]`` after each version and every second. PUB never blocks: a subscriber
whose queue is full loses messages. The PUB high-water mark is raised (once, by rebinding) to hold
two whole versions, so a subscriber that keeps up never loses chunks while a stalled one pins at
most about two version buffers. The subscriber's background thread drains the SUB socket, skips
versions a newer one supersedes, assembles and verifies the newest
(:class:`~streamgrpo.transport.weights_codec.Assembler`) and parks it for :meth:`poll`; when a
version is lost (a gap, a bad digest, or a heartbeat announcing a version it never completed) or at
start-up it fetches the latest version from the snapshot endpoint instead. So a version is applied
whole or not at all, and a late, slow or restarted generator catches up without slowing the learner.

Security: with ``curve_keys_dir`` both sockets are CURVE servers and only client public keys in
``DIR/clients/*.key`` may connect (ZAP via pyzmq's ThreadAuthenticator); see :mod:`.keys`. Without
keys anyone who can reach the ports can read the weights, so the default bind is 127.0.0.1.

LoRA mode: publish ``filter_lora(named_tensors)``; the generator applies with
:class:`~streamgrpo.transport.weights_apply.LoraApplier` (merges ``base + alpha/r * B @ A``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack
import torch
import zmq

from streamgrpo.metrics import ERRORS, POLICY_VERSION, WEIGHT_BYTES
from streamgrpo.transport.keys import authorised_dir, server_keys
from streamgrpo.transport.weights_apply import (
    LoraApplier,
    WeightsApplyError,
    apply_to_model,
    filter_lora,
    merge_lora_into,
)
from streamgrpo.transport.weights_codec import (
    BEAT_S,
    DEFAULT_ALGO,
    TOPIC,
    TOPIC_BEAT,
    VersionMeta,
    WeightsFormatError,
    chunk_span,
    encode_header,
    encode_meta,
    endpoint,
    make_header,
    n_chunks_for,
    new_hasher,
    pack_into,
    plan_layout,
    report_error,
)
from streamgrpo.transport.weights_subscriber import WeightSubscriber

__all__ = [
    "WeightPublisher", "WeightSubscriber", "apply_to_model", "filter_lora", "merge_lora_into", "LoraApplier",
    "WeightsApplyError", "WeightsFormatError",
]

log = logging.getLogger(__name__)
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    if ":" in host:
        sock.ipv6 = True
    sock.bind(endpoint(host, port or "*"))
    return int(sock.last_endpoint.decode().rsplit(":", 1)[1])


# ------------------------------------------------------------------------------------ publisher
@dataclass
class _Version:
    meta: VersionMeta
    meta_bytes: bytes
    base: torch.Tensor  # the allocation (reused once zmq has let go of every frame)
    buf_N: torch.Tensor  # base[:nbytes]
    digest: bytes | None = None
    trackers: list = field(default_factory=list)
    filled: int = -1  # bytes of buf_N already copied in (publish() and the sender overlap)
    failed: bool = False  # publish() raised while copying: never send it

    def released(self) -> bool:
        return all(t.done for t in self.trackers)


class WeightPublisher:
    """Learner side: PUB socket for new versions plus a ROUTER serving the latest complete one."""

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        pub_port: int = 0,
        snapshot_port: int = 0,
        chunk_mib: float = 8.0,
        curve_keys_dir: str | None = None,
        sndhwm: int = 64,
        *,
        algo: str = DEFAULT_ALGO,
    ):
        self.chunk_bytes = max(1, int(chunk_mib * (1 << 20)))
        self.algo = algo
        self.src = secrets.randbits(62)  # publisher id: a restarted learner starts a new lineage
        self.bind_host = bind_host
        self._ctx = zmq.Context()
        self._auth = None
        self._curve: tuple[bytes, bytes] | None = None
        if curve_keys_dir:
            from zmq.auth.thread import ThreadAuthenticator

            self._curve = server_keys(curve_keys_dir, secret=True)
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(authorised_dir(curve_keys_dir)))
        self._hwm = sndhwm
        self._pub = self._socket(zmq.PUB, sndhwm)
        self._router = self._socket(zmq.ROUTER, 100_000)
        self.pub_port = _bind(self._pub, bind_host, pub_port)
        self.snapshot_port = _bind(self._router, bind_host, snapshot_port)
        self._last_beat = 0.0
        self._wake_addr = f"inproc://weights-pub-{self.src}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.connect(self._wake_addr)

        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._pending: _Version | None = None
        self._sending = False
        self._latest: _Version | None = None
        self._retired: list[_Version] = []
        self._free: list[torch.Tensor] = []
        self._closing = False
        self.versions_sent = 0
        self._thread = threading.Thread(target=self._serve, name="weights-publisher", daemon=True)
        self._thread.start()

        where = f"PUB {endpoint(bind_host, self.pub_port)}, snapshot ROUTER {endpoint(bind_host, self.snapshot_port)}"
        if curve_keys_dir:
            log.info("weights: %s, CURVE on, clients authorised from %s", where, authorised_dir(curve_keys_dir))
        elif bind_host in _LOOPBACK:
            log.info("weights: %s, no CURVE keys: bound to %s only (set weights.curve_keys_dir to open it up)", where, bind_host)
        else:
            log.warning("weights: %s WITHOUT CURVE keys: anyone who reaches %s can read the weights "
                        "(make keys with `streamgrpo keys` and set weights.curve_keys_dir)", where, bind_host)

    def _socket(self, kind: int, sndhwm: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.sndhwm = sndhwm
        sock.linger = 0
        if self._curve is not None:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = self._curve
        return sock

    def _raise_hwm(self, hwm: int) -> None:
        """Rebind PUB with a high-water mark that holds two versions (libzmq applies a new HWM only to
        new connections). Subscribers reconnect by themselves; what they miss meanwhile comes from
        the snapshot endpoint. Happens once, at the first version bigger than ``sndhwm`` allows."""
        self._pub.close(linger=0)
        self._pub = self._socket(zmq.PUB, hwm)
        if ":" in self.bind_host:
            self._pub.ipv6 = True
        for _ in range(250):  # the old listener closes asynchronously
            try:
                self._pub.bind(endpoint(self.bind_host, self.pub_port))
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise
                time.sleep(0.02)
        else:
            raise RuntimeError(f"weights: could not rebind PUB port {self.pub_port}")
        log.info("weights: PUB high-water mark raised from %d to %d messages (two versions)", self._hwm, hwm)
        self._hwm = hwm

    def _beat(self) -> None:
        """Announce the latest complete version, so a subscriber that lost a version's tail notices."""
        latest = self._latest
        if latest is not None:
            self._pub.send_multipart([TOPIC_BEAT, msgpack.packb({"s": latest.meta.src, "v": latest.meta.version})])
            self._last_beat = time.monotonic()

    @classmethod
    def from_config(cls, cfg, **kw) -> WeightPublisher:
        """Build from a :class:`streamgrpo.config.WeightsConfig`."""
        return cls(cfg.bind_host, cfg.pub_port, cfg.snapshot_port, cfg.chunk_mib, cfg.curve_keys_dir, cfg.sndhwm, **kw)

    # -- caller thread ---------------------------------------------------------------------
    def publish(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the tensors out (one copy each) and queue them for sending; returns right after.

        If the previous version is still queued (not yet started) it is replaced: subscribers only
        ever want the newest. Raises ``TypeError``/``ValueError`` for unsupported input.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights: version must be an integer >= 0, got {version!r}")
        if self._closing:
            raise RuntimeError("weights: publish() after close()")
        entries, nbytes = plan_layout(named_tensors)
        cuda = any(t.is_cuda for t in named_tensors.values())
        base = self._take_buffer(nbytes, pinned=cuda and torch.cuda.is_available())
        meta = VersionMeta(version, self.src, nbytes, self.chunk_bytes, n_chunks_for(nbytes, self.chunk_bytes),
                           time.time(), self.algo, entries)
        job = _Version(meta, encode_meta(meta), base, base[:nbytes])
        with self._cv:  # queue it first: the sender streams chunks out while later tensors are copied
            replaced, self._pending = self._pending, job
            if replaced is not None:
                self._free_buffer(replaced.base)
            self._wake_push.send(b"", zmq.NOBLOCK)
        try:
            pack_into(job.buf_N, named_tensors, entries, progress=self._progress(job))
        except BaseException:
            with self._cv:
                job.failed = True
                self._cv.notify_all()
            raise
        POLICY_VERSION.labels(role="learner").set(version)

    def _progress(self, job: _Version):
        next_chunk = [0]  # notify the sender only when a whole chunk more is ready

        def progress(filled: int) -> None:
            if filled >= min(next_chunk[0] + self.chunk_bytes, job.meta.nbytes):
                with self._cv:
                    job.filled = filled
                    self._cv.notify_all()
                next_chunk[0] = filled

        return progress

    @property
    def latest_version(self) -> int | None:
        """The newest version fully handed to ZeroMQ (the one the snapshot endpoint serves)."""
        latest = self._latest
        return latest.meta.version if latest is not None else None

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every published version has been handed to ZeroMQ; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._sending, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish handing over queued versions (up to ``timeout_s``), then stop and close sockets."""
        if self._closing:
            return
        self.flush(timeout_s)
        with self._cv:
            self._closing = True
            self._wake_push.send(b"", zmq.NOBLOCK)
        self._thread.join(timeout_s)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=int(min(timeout_s, 1.0) * 1000))

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- buffers -------------------------------------------------------------------------------
    def _take_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            still = []
            for v in self._retired:
                (self._free.append(v.base) if v.released() else still.append(v))
            self._retired = still
            for i, b in enumerate(self._free):
                if nbytes <= b.numel() <= 2 * nbytes + (1 << 16) and b.is_pinned() == pinned:
                    return self._free.pop(i)
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)

    def _free_buffer(self, base: torch.Tensor) -> None:  # lock held
        self._free = [base, *self._free][:2]

    # -- background thread ---------------------------------------------------------------------
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
                    if job is None and self._closing:
                        return
                if job is not None:
                    self._send(job)
                self._answer_snapshots()
                if time.monotonic() - self._last_beat >= BEAT_S:
                    self._beat()
            except zmq.ContextTerminated:
                return
            except Exception:
                ERRORS.labels(kind="weights").inc()
                log.exception("weights publisher: unexpected error (continuing)")
                with self._cv:
                    self._sending = False
                    self._cv.notify_all()

    def _send(self, job: _Version) -> None:
        meta, mv = job.meta, memoryview(job.buf_N.numpy())
        if 2 * meta.n_chunks + 16 > self._hwm:
            self._raise_hwm(2 * meta.n_chunks + 16)
        hasher = new_hasher(meta.algo)
        hasher.update(job.meta_bytes)
        digest = None
        for seq in range(meta.n_chunks):
            start, end = chunk_span(meta, seq)
            if job.filled < end:
                with self._cv:
                    self._cv.wait_for(lambda e=end: job.filled >= e or job.failed)
                    if job.failed:
                        self._sending = False
                        self._cv.notify_all()
                        return
            chunk = mv[start:end]
            hasher.update(chunk)
            if seq == meta.n_chunks - 1:
                digest = hasher.digest()
            header = encode_header(make_header(meta, seq, job.meta_bytes, digest))
            job.trackers.append(self._pub.send_multipart([TOPIC, header, chunk], copy=False, track=True))
            self._answer_snapshots()  # keep late joiners served while a big version goes out
        job.digest = digest
        WEIGHT_BYTES.inc(meta.nbytes)
        with self._cv:
            if self._latest is not None:
                self._retired.append(self._latest)
            self._latest = job
            self._sending = False
            self.versions_sent += 1
            self._cv.notify_all()
        self._beat()

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
                header = encode_header(make_header(latest.meta, seq, latest.meta_bytes, latest.digest, req=rid))
                chunk = memoryview(latest.buf_N.numpy())[start:end]
                tracker = self._router.send_multipart([ident, TOPIC, header, chunk], copy=False, track=True)
                with self._lock:
                    latest.trackers.append(tracker)
                WEIGHT_BYTES.inc(end - start)
