"""A version on its way out of the :class:`~.publisher.WeightPublisher`: its host buffer with the marks of
the bytes known final (:class:`OutgoingVersion`), and the :class:`~.base.VersionWriter` the learner fills it
with (:class:`OutgoingWriter`).

The writer casts and copies CUDA tensors device-to-host on the publisher's side stream, tensor by tensor,
and records a CUDA event every ``chunk_bytes``; the publisher's sender thread (:mod:`.broadcast`) sends a
chunk once the event covering it has fired.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from streamgrpo.metrics import POLICY_VERSION
from streamgrpo.transport.weights.base import VersionWriter
from streamgrpo.transport.weights.codec import VersionMeta
from streamgrpo.transport.weights.layout import Layout, view_of


@dataclass
class OutgoingVersion:
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


class OutgoingWriter(VersionWriter):
    """Fills a version's buffer in byte order (any write order; the final prefix is what may go out)."""

    def __init__(self, pub: Any, job: OutgoingVersion, cuda: bool):  # pub: the WeightPublisher
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
