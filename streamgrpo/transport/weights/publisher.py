"""Weight broadcast over ZeroMQ: the :class:`~.base.WeightSync` backend (learner rank 0 publishes).

Publisher (learner)::

    pub = publisher_from_config(cfg.weights, run_dir)   # streamgrpo.transport.weights.factory
    pub.publish(version, dict(model.named_parameters()), dtype=torch.bfloat16)
    pub.close()

Subscriber (generator): :class:`~.subscriber.WeightSubscriber`.

How a version goes out. ``publish`` plans the payload (a safetensors image, see
:mod:`.codec`) and takes a reusable host buffer (pinned when the tensors live on CUDA).
CUDA tensors are cast to the export dtype and copied device-to-host on a side stream, tensor by
tensor, with a CUDA event every chunk; the caller's stream is then made to wait for that side
stream, so ``publish`` returns without waiting for the copies, and the next optimizer step cannot
overwrite a weight before its bytes are out. CPU tensors are copied at once. A background thread
sends each chunk as soon as its event has fired, as ``[b"w", header, payload]`` on a PUB socket with
zero-copy frames; chunk digests are computed by a small thread pool ahead of the sender (xxh3 drops
the GIL). A version published while an older one still waits to start replaces it.

The same thread owns a ROUTER socket that serves the latest complete version chunk by chunk on
request (credit-based, so a slow client never blocks anyone), and sends a heartbeat
``[b"h", {src, version}]`` after each version and every second. PUB never blocks: a subscriber whose
queue is full loses messages and repairs through the snapshot endpoint. The PUB high-water mark is
raised (once, by rebinding) to hold two whole versions.

Endpoints: TCP on ``bind_host``; with ``ipc_dir`` the same sockets also listen on
``ipc://<ipc_dir>/weights-{pub,snap}.sock`` for generators on this host (``weights.transport=ipc``).

Security: with ``curve_keys_dir`` both sockets are CURVE servers and only client public keys in
``DIR/clients/*.key`` may connect (ZAP via pyzmq's ThreadAuthenticator); see :mod:`.keys`. Without
keys anyone who can reach the ports can read the weights, so the default bind is 127.0.0.1.

LoRA mode: publish ``filter_lora(named_tensors)`` (:mod:`streamgrpo.models.lora`); the generator
merges ``base + alpha/r * B @ A`` into its pristine base weights.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch
import zmq

from streamgrpo.metrics import (
    ERRORS,
    POLICY_VERSION,
    WEIGHT_BYTES,
    WEIGHT_DELTA_RATIO,
    WEIGHT_SUBSCRIBERS,
    WEIGHT_VERSION_BYTES,
    WEIGHT_VERSIONS,
)
from streamgrpo.transport.weights.base import VersionWriter, WeightSync
from streamgrpo.transport.weights.codec import (
    BEAT_S,
    DEFAULT_ALGO,
    TOPIC,
    TOPIC_BEAT,
    TOPIC_DELTA,
    VersionMeta,
    chunk_digest,
    chunk_span,
    default_hash_threads,
    encode_delta_meta,
    encode_header,
    encode_meta,
    make_header,
    n_chunks_for,
    report_error,
)
from streamgrpo.transport.weights.delta import encode_delta
from streamgrpo.transport.weights.keys import authorised_dir, server_keys
from streamgrpo.transport.weights.layout import Layout, LayoutMemo, TensorSpec, view_of
from streamgrpo.transport.weights.sockets import PortInUse, bind_tcp, endpoint, ipc_endpoints

log = logging.getLogger(__name__)
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


# ------------------------------------------------------------------------------------ versions
@dataclass
class _Version:
    meta: VersionMeta
    meta_bytes: bytes
    layout: Layout
    base: torch.Tensor  # the allocation (reused once zmq has let go of every frame)
    buf_N: torch.Tensor  # base[:nbytes]
    digests: list[bytes] = field(default_factory=list)
    trackers: list = field(default_factory=list)
    marks: deque = field(default_factory=deque)  # (end byte, CUDA event or None), increasing
    ready: int = 0  # bytes of buf_N known final (the sender's view)
    committed: bool = False
    failed: bool = False  # given up while being written: never send it
    storage: object | None = None  # a backend's handle of base (the shared-memory file it maps: ShmPublisher)
    delta: bytes | None = None  # sent as this delta to the previous version (kept alive until ZeroMQ lets go)

    def released(self) -> bool:
        return all(t.done for t in self.trackers)


class _Writer(VersionWriter):
    """Fills a version's buffer in byte order (any write order; the final prefix is what may go out)."""

    def __init__(self, pub: WeightPublisher, job: _Version, cuda: bool):
        self.pub, self.job = pub, job
        self._index = {e.name: i for i, e in enumerate(job.layout.data)}
        self._aliases = {e.name for e in job.layout.entries} - set(self._index)  # tied names: bytes already there
        self._done = [False] * len(job.layout.data)
        self._next = 0  # first data entry not written yet
        self._marked = len(job.layout.header)  # bytes covered by marks so far
        self._stream = pub._side_stream() if cuda else None
        self._async = False  # CUDA copies enqueued since the last mark
        if pub._stream is not None:  # copies of an earlier version may still target a recycled buffer
            pub._stream.synchronize()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        job.buf_N[: len(job.layout.header)].copy_(torch.frombuffer(bytearray(job.layout.header), dtype=torch.uint8))
        if not job.layout.data:
            self._mark(job.meta.nbytes)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        i = self._index.get(name)
        if i is None:
            if name in self._aliases:
                return
            raise KeyError(f"weights: {name!r} is not in this version's tensor table")
        e = self.job.layout.data[i]
        if e.nbytes:
            dst = view_of(self.job.buf_N, e)
            src = tensor.detach()
            if tuple(src.shape) != e.shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(src.shape)}, its spec says {e.shape}")
            if src.is_cuda and self._stream is not None:
                if src.device != self._stream.device:
                    raise ValueError(f"weights: {name!r} is on {src.device}, this version's copies run on "
                                     f"{self._stream.device} (publish from one device)")
                self._stream.wait_stream(torch.cuda.current_stream(src.device))  # e.g. a ZeRO-3 all-gather
                with torch.cuda.stream(self._stream):
                    if src.dtype != dst.dtype:
                        src = src.to(dst.dtype)  # cast on the GPU: half the bytes cross the bus
                    dst.copy_(src, non_blocking=True)
                self._async = True
            else:
                dst.copy_(src)
        self._done[i] = True
        data = self.job.layout.data
        while self._next < len(data) and self._done[self._next]:
            self._next += 1
        end = data[self._next - 1].offset + data[self._next - 1].nbytes if self._next else self._marked
        if end - self._marked >= self.pub.chunk_bytes or self._next == len(data):
            self._mark(end)

    def _mark(self, end: int) -> None:
        event = None
        if self._async:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._async = False
        with self.pub._cv:
            self.job.marks.append((end, event))
            self.pub._cv.notify_all()
        self._marked = end

    def sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def commit(self) -> None:
        missing = [e.name for e, done in zip(self.job.layout.data, self._done) if not done]
        if missing:
            raise ValueError(f"weights v{self.job.meta.version}: {len(missing)} tensors never written, e.g. {missing[:3]}")
        if self._stream is not None:  # the caller's next kernels (optimizer step) wait for the copies
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        with self.pub._cv:
            self.job.committed = True
            self.pub._cv.notify_all()
        POLICY_VERSION.labels(role="learner").set(self.job.meta.version)

    def abort(self) -> None:
        self.sync()
        with self.pub._cv:
            self.job.failed = True
            if self.pub._pending is self.job:
                self.pub._pending = None
                self.pub._recycle(self.job)
            self.pub._cv.notify_all()


# ------------------------------------------------------------------------------------ publisher
class WeightPublisher(WeightSync):
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
        ipc_dir: str | os.PathLike | None = None,
        hash_threads: int | None = None,
        io_threads: int = 1,
        host_buffers: int = 3,
        delta_max_ratio: float | None = None,
        tcp: bool = True,
    ):
        self.chunk_bytes = max(1, int(chunk_mib * (1 << 20)))
        self.delta_max_ratio = delta_max_ratio  # None: every version whole; else deltas up to this share of it
        self.algo = algo
        self.src = secrets.randbits(62)  # publisher id: a restarted learner starts a new lineage
        self.bind_host = bind_host
        self._ctx = zmq.Context(io_threads=max(1, io_threads))
        self._auth = None
        self._curve: tuple[bytes, bytes] | None = None
        if curve_keys_dir:
            from zmq.auth.thread import ThreadAuthenticator

            self._curve = server_keys(curve_keys_dir, secret=True)
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(authorised_dir(curve_keys_dir)))
        self._ipc: tuple[str, str] | None = None
        if ipc_dir is not None:
            Path(ipc_dir).mkdir(parents=True, exist_ok=True)
            self._ipc = ipc_endpoints(ipc_dir)
        self._hwm = sndhwm
        self._pub = self._socket(zmq.PUB, sndhwm)
        self._pub_monitor = self._pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.subscribers = 0  # connections on PUB now (counted from its monitor)
        self._router = self._socket(zmq.ROUTER, 100_000)
        try:
            if tcp:  # (a relay serves its host over ipc:// only: no other user reaches it)
                self.pub_port = bind_tcp(self._pub, bind_host, pub_port, "weights.pub_port")
                self.snapshot_port = bind_tcp(self._router, bind_host, snapshot_port, "weights.snapshot_port")
            else:
                self.pub_port = self.snapshot_port = None
        except PortInUse:
            if self._auth is not None:
                self._auth.stop()
            self._ctx.destroy(linger=0)
            raise
        if self._ipc is not None:
            self._pub.bind(self._ipc[0])
            self._router.bind(self._ipc[1])
        self._last_beat = 0.0
        self._wake_addr = f"inproc://weights-pub-{self.src}"
        self._wake_pull = self._ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.connect(self._wake_addr)
        self._relay_push: zmq.Socket | None = None
        self._outbox: deque = deque()  # forward()/adopt() items for the sender thread
        self._hash_threads = hash_threads or default_hash_threads()
        self._hash_pool = ThreadPoolExecutor(self._hash_threads, thread_name_prefix="weights-hash")
        self._delta_pool: ThreadPoolExecutor | None = None  # delta encoding, made at the first delta
        self._stream = None
        self._plan = LayoutMemo()

        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._pending: _Version | None = None
        self._sending = False
        self._current: _Version | None = None  # the version the sender works on
        self._latest: _Version | None = None
        self._retired: list[_Version] = []
        self._free: list[torch.Tensor] = []
        self._closing = False
        self.versions_sent = 0
        self.deltas_sent = 0
        self.superseded = 0  # versions replaced before they started going out
        self.host_buffers = max(2, host_buffers)
        self._pinned = 0
        self.reclaimed = 0  # pinned buffers taken back from a lagging subscriber's queue
        try:
            self._setup_backend()
        except BaseException:
            if self._auth is not None:
                self._auth.stop()
            self._hash_pool.shutdown(wait=False)
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._serve, name="weights-publisher", daemon=True)
        self._thread.start()

        where = (f"PUB {endpoint(bind_host, self.pub_port)}, snapshot ROUTER {endpoint(bind_host, self.snapshot_port)}"
                 if tcp else "no TCP")
        if self._ipc is not None:
            where += f", also {self._ipc[0]} and {self._ipc[1]}"
        where += self._describe_backend()
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

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

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

    def _drop_monitor(self) -> None:
        if self._pub_monitor is not None:
            self._pub.disable_monitor()
            self._pub_monitor.close(linger=0)
            self._pub_monitor = None

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

    # -- caller thread ---------------------------------------------------------------------
    def begin(self, version: int, specs: Sequence[TensorSpec], *, cuda: bool = False) -> VersionWriter:
        """Start ``version``; it is queued at once, so chunks go out while later tensors are still written."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights: version must be an integer >= 0, got {version!r}")
        if self._closing:
            raise RuntimeError("weights: publish() after close()")
        layout = self._plan(specs)
        cuda = cuda and torch.cuda.is_available()
        with self._cv:  # a queued version that has not started is replaced: subscribers only want the newest
            replaced, self._pending = self._pending, None
            if replaced is not None:  # (its buffer serves the new version: the pool never grows for it)
                replaced.failed = True
                self._recycle(replaced)
                self.superseded += 1
        base, storage = self._take_storage(version, layout.nbytes, cuda)
        meta = VersionMeta(version, self.src, layout.nbytes, self.chunk_bytes,
                           n_chunks_for(layout.nbytes, self.chunk_bytes), time.time(), self.algo)
        job = _Version(meta, encode_meta(meta), layout, base, base[: layout.nbytes], storage=storage)
        with self._cv:
            self._pending = job
            self._wake_push.send(b"", zmq.NOBLOCK)
        return _Writer(self, job, cuda)

    # -- versions made elsewhere: a relay forwards the learner's ------------------------------------
    def forward(self, frames: list) -> None:
        """Send ``frames`` on PUB from the sender thread (a socket is not thread-safe), in call order
        with :meth:`adopt`. One thread only (e.g. a relay's receiver) calls forward and adopt."""
        with self._cv:
            self._outbox.append(frames)
        self._wake_from_relay()

    def adopt(self, meta: VersionMeta, meta_bytes: bytes, digests: Sequence[bytes], storage, buf_N: torch.Tensor) -> None:
        """Make a version received whole elsewhere (its meta record and chunk digests unchanged, its bytes
        in ``buf_N``, a view of ``storage``'s buffer) the latest: announced, served to late joiners."""
        job = _Version(meta, meta_bytes, None, storage.tensor, buf_N, list(digests), storage=storage, committed=True)
        with self._cv:
            self._outbox.append(job)
        self._wake_from_relay()

    def _wake_from_relay(self) -> None:
        if self._relay_push is None:  # made in (and used only by) the forwarding thread
            self._relay_push = self._ctx.socket(zmq.PUSH)
            self._relay_push.connect(self._wake_addr)
        try:
            self._relay_push.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # thousands of wake-ups pending: the sender thread is awake anyway
            pass

    def _drain_outbox(self) -> None:
        while True:
            with self._cv:
                if not self._outbox:
                    return
                item = self._outbox.popleft()
            if isinstance(item, _Version):
                with self._cv:
                    if self._latest is not None:
                        self._retired.append(self._latest)
                    self._latest = item
                    self.versions_sent += 1
                    self._cv.notify_all()
                self._version_out(item)
                self._beat()
            else:
                self._pub.send_multipart(item)

    @property
    def latest_version(self) -> int | None:
        """The newest version fully handed to ZeroMQ (the one the snapshot endpoint serves)."""
        latest = self._latest
        return latest.meta.version if latest is not None else None

    @property
    def in_flight(self) -> int | None:
        """The version the sender thread is sending now (waiting for its bytes included), if any."""
        with self._cv:
            cur = self._current
            return cur.meta.version if cur is not None and self._sending else None

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
            self._cv.notify_all()
        self._thread.join(timeout_s)
        self._hash_pool.shutdown(wait=True)
        if self._delta_pool is not None:
            self._delta_pool.shutdown(wait=True)
        if not self._thread.is_alive():
            self._drop_monitor()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=int(min(timeout_s, 1.0) * 1000))
        self._close_backend()

    # -- what a backend built on this one changes (ShmPublisher) -------------------------------------
    def _setup_backend(self) -> None:
        """Called once, after the sockets are bound and before the sender starts."""

    def _describe_backend(self) -> str:
        """Appended to the start-up log line."""
        return ""

    def _take_storage(self, version: int, nbytes: int, cuda: bool) -> tuple[torch.Tensor, object | None]:
        """The buffer a new version is written into, and the backend's handle of it."""
        return self._take_buffer(nbytes, pinned=cuda), None

    def _chunk_out(self, job: _Version, seq: int) -> None:
        """Chunk ``seq`` of ``job`` is final and about to go out (sender thread)."""

    def _version_out(self, job: _Version) -> None:
        """``job`` went out whole and is the latest version (sender thread)."""

    def _version_dropped(self, job: _Version) -> None:
        """``job`` was given up by the sender."""

    def _close_backend(self) -> None:
        """Called last by :meth:`close`."""

    # -- buffers -------------------------------------------------------------------------------
    def _take_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A host buffer for a new version. Pinned buffers are few and reused: pinning several GB costs
        seconds, so at most ``host_buffers`` exist (all made at the first version, before training
        starts). When none is free, the oldest retired version's buffer is taken back even though a
        lagging subscriber's queue may still point into it: that subscriber then fails the chunk
        digest and repairs from the snapshot, and the learner never waits."""
        fits = lambda b: nbytes <= b.numel() <= 2 * nbytes + (1 << 16) and b.is_pinned() == pinned  # noqa: E731
        with self._lock:
            self._free.extend(v.base for v in self._released())
            for i, b in enumerate(self._free):
                if fits(b):
                    return self._free.pop(i)
            spares = 0
            if pinned and self._pinned >= self.host_buffers:
                for i, v in enumerate(self._retired):
                    if fits(v.base):
                        self.reclaimed += 1
                        return self._retired.pop(i).base
            if pinned:
                spares = self.host_buffers - 1 if self._pinned == 0 else 0
                self._pinned += 1
        base = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        if spares:  # the first version: pin the others now, not in the middle of training
            t0 = time.perf_counter()
            made = [torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True) for _ in range(spares)]
            with self._lock:
                self._pinned += len(made)
                self._free.extend(made)
            log.info("weights: %d pinned host buffers of %.2f GB ready (%.1fs)", spares + 1, nbytes / 1e9,
                     time.perf_counter() - t0)
        return base

    def _released(self) -> list[_Version]:  # lock held
        """Retired versions whose every frame ZeroMQ has let go of, taken off the retired list."""
        flags = [(v, v.released()) for v in self._retired]
        self._retired = [v for v, done in flags if not done]
        return [v for v, done in flags if done]

    def _recycle(self, job: _Version) -> None:  # lock held: a version that never went out
        self._free_buffer(job.base)

    def _free_buffer(self, base: torch.Tensor) -> None:  # lock held
        pinned = [b for b in [base, *self._free] if b.is_pinned()]
        pageable = [b for b in [base, *self._free] if not b.is_pinned()][:2]
        self._free = pinned + pageable

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

    def _ready_upto(self, job: _Version, end: int, block: bool) -> bool:
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

    def _send(self, job: _Version) -> None:
        base = self._latest
        if (self.delta_max_ratio is not None and base is not None and base.meta.nbytes == job.meta.nbytes
                and base.layout.header == job.layout.header):
            if self._send_delta(job, base):
                return
        self._send_full(job)

    def _send_delta(self, job: _Version, base: _Version) -> bool:
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

    def _committed(self, job: _Version) -> bool:
        """Wait until the caller's commit() (or abort) of ``job``: True when committed."""
        with self._cv:  # the caller may still be inside commit(): wait for it (bytes are all final)
            self._cv.wait_for(lambda: job.committed or job.failed or self._closing)
        return job.committed

    def _finish(self, job: _Version, kind: str, sent: int) -> None:
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

    def _send_full(self, job: _Version) -> None:
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

    def _give_up(self, job: _Version) -> None:
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

