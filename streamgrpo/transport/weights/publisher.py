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

The module's parts: the version being written and its writer (:mod:`.outgoing`), the sender thread
(:mod:`.broadcast`), and here the sockets, the caller's side and the host buffers.

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
from pathlib import Path

import torch
import zmq

from streamgrpo.transport.weights.base import VersionWriter, WeightSync
from streamgrpo.transport.weights.broadcast import Broadcaster
from streamgrpo.transport.weights.codec import (
    DEFAULT_ALGO,
    VersionMeta,
    default_hash_threads,
    encode_meta,
    n_chunks_for,
)
from streamgrpo.transport.weights.keys import authorised_dir, server_keys
from streamgrpo.transport.weights.layout import LayoutMemo, TensorSpec
from streamgrpo.transport.weights.outgoing import OutgoingVersion, OutgoingWriter
from streamgrpo.transport.weights.sockets import bind_tcp, endpoint, ipc_endpoints

log = logging.getLogger(__name__)
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


# ------------------------------------------------------------------------------------ publisher
class WeightPublisher(Broadcaster, WeightSync):
    """Learner side: PUB socket for new versions plus a ROUTER serving the latest complete one (the thread that
    sends on both: :class:`~.broadcast.Broadcaster`)."""

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
        self._ipc: tuple[str, str] | None = None
        if ipc_dir is not None:
            Path(ipc_dir).mkdir(parents=True, exist_ok=True)
            self._ipc = ipc_endpoints(ipc_dir)  # (a path too long for a socket: one line before any socket)
        self._ctx = zmq.Context(io_threads=max(1, io_threads))
        self._ctx.linger = 0  # every socket: a term() never waits on messages nobody will take
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
        self._pub_monitor = self._pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.subscribers = 0  # connections on PUB now (counted from its monitor)
        self._router = self._socket(zmq.ROUTER, 100_000)
        try:
            if tcp:  # (a relay serves its host over ipc:// only: no other user reaches it)
                self.pub_port = bind_tcp(self._pub, bind_host, pub_port, "weights.pub_port")
                self.snapshot_port = bind_tcp(self._router, bind_host, snapshot_port, "weights.snapshot_port")
            else:
                self.pub_port = self.snapshot_port = None
            if self._ipc is not None:
                self._pub.bind(self._ipc[0])
                self._router.bind(self._ipc[1])
        except BaseException:  # a port in use, a socket file that cannot be made: nothing left open
            self._drop_monitor()  # (a context left to the garbage collector can hang its term())
            if self._auth is not None:
                self._auth.stop()
            self._ctx.destroy(linger=0)
            raise
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
        self._pending: OutgoingVersion | None = None
        self._sending = False
        self._current: OutgoingVersion | None = None  # the version the sender works on
        self._latest: OutgoingVersion | None = None
        self._retired: list[OutgoingVersion] = []
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
            self._drop_monitor()
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

    def _drop_monitor(self) -> None:
        if self._pub_monitor is not None:
            self._pub.disable_monitor()
            self._pub_monitor.close(linger=0)
            self._pub_monitor = None

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
        job = OutgoingVersion(meta, encode_meta(meta), layout, base, base[: layout.nbytes], storage=storage)
        with self._cv:
            self._pending = job
            self._wake_push.send(b"", zmq.NOBLOCK)
        return OutgoingWriter(self, job, cuda)

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
        job = OutgoingVersion(meta, meta_bytes, None, storage.tensor, buf_N, list(digests), storage=storage, committed=True)
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
            if isinstance(item, OutgoingVersion):
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

    def _chunk_out(self, job: OutgoingVersion, seq: int) -> None:
        """Chunk ``seq`` of ``job`` is final and about to go out (sender thread)."""

    def _version_out(self, job: OutgoingVersion) -> None:
        """``job`` went out whole and is the latest version (sender thread)."""

    def _version_dropped(self, job: OutgoingVersion) -> None:
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

    def _released(self) -> list[OutgoingVersion]:  # lock held
        """Retired versions whose every frame ZeroMQ has let go of, taken off the retired list."""
        flags = [(v, v.released()) for v in self._retired]
        self._retired = [v for v, done in flags if not done]
        return [v for v, done in flags if done]

    def _recycle(self, job: OutgoingVersion) -> None:  # lock held: a version that never went out
        self._free_buffer(job.base)

    def _free_buffer(self, base: torch.Tensor) -> None:  # lock held
        pinned = [b for b in [base, *self._free] if b.is_pinned()]
        pageable = [b for b in [base, *self._free] if not b.is_pinned()][:2]
        self._free = pinned + pageable
