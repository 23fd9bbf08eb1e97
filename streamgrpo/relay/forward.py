"""A relay's receiving side: the learner's versions land straight in shared-memory files, chunk by chunk.

:class:`RelayReceiver` is a :class:`~streamgrpo.transport.weights.subscriber.WeightSubscriber` (the same
PUB, snapshot, CURVE, delta and repair logic) whose receive buffers are the files of the host's
:class:`~streamgrpo.transport.weights.shm_publisher.ShmPublisher`. Each chunk from the learner is copied
into the file (and its digest checked) on arrival, and at once announced to the host's generators
(the shared-memory channel's early-chunk messages), so they copy and hash it while later chunks are
still on the wire: the relay cuts through instead of storing and forwarding. A whole, verified version
is then adopted by the host's publisher with the learner's own meta record and digests: generators
check the learner's digests end to end, and a relay restart changes nothing they see. Versions that
arrive as deltas or snapshots are announced whole.
"""

from __future__ import annotations

import torch

from streamgrpo import metrics as M
from streamgrpo.transport.weights.codec import (
    Assembler,
    Completed,
    chunk_digest,
    chunk_span,
    key_of,
)
from streamgrpo.transport.weights.shm import TOPIC_SHM, ShmFile, ShmUnavailable, encode_begin, encode_chunk
from streamgrpo.transport.weights.subscriber import WeightSubscriber


class RelayReceiver(WeightSubscriber):
    def __init__(self, local, *args, **kw):
        self.local = local  # the host's ShmPublisher
        self._files: dict[int, ShmFile] = {}  # data_ptr of a receive buffer -> its file
        self._incoming: tuple[int, int] | None = None  # (src, version) whose chunk 0 is being fed from PUB
        self._pub_file: ShmFile | None = None  # the file of the version arriving on PUB
        self._digests: list[bytes] = []  # its chunk digests so far
        self._intact = True  # every chunk of it so far matched its digest
        self._delta_digests: list[bytes] | None = None
        self.fatal: str | None = None  # why the relay cannot go on (its loop exits with it)
        super().__init__(*args, **kw)

    def _setup_backend(self) -> None:
        # copies on the receiving thread: a chunk is in the file when feed() returns, and may be announced
        self._pub_asm = Assembler(self._alloc, self._release, None)

    # -- buffers are shared-memory files -------------------------------------------------------------
    def _alloc(self, nbytes: int) -> torch.Tensor:
        try:
            f = self.local.take_file(nbytes)
        except ShmUnavailable as exc:  # no room in shm_dir: nothing will ever fit, so the relay stops
            self.fatal = str(exc)
            raise MemoryError(str(exc)) from None
        if self._incoming is not None:  # named before any byte of it is written (early readers check it)
            f.stamp(*self._incoming)
            self._pub_file, self._incoming = f, None
        buf = f.tensor[:nbytes]
        self._files[buf.data_ptr()] = f
        return buf

    def _release(self, buf: torch.Tensor) -> None:
        f = self._files.pop(buf.data_ptr(), None)
        if f is not None:
            self.local.give_back_file(f)

    # -- chunks announced as they land; whole versions adopted ---------------------------------------
    def _assemble(self, batch: list) -> None:
        for i in self._worth_assembling(batch):
            h, frame = batch[i]
            if h.seq == 0:
                self._incoming, self._digests, self._intact = key_of(h), [], True
            done, why = self._pub_asm.feed(h, frame.buffer)
            self._incoming = None
            if why:
                self._dropped(why, repair=True)
            building = self._pub_asm.in_progress
            landed = done is not None or (building is not None and building == (key_of(h), h.seq + 1))
            self._intact = self._intact and (done is not None or self._pub_asm.last_chunk_ok())
            if landed and self._intact and self._pub_file is not None:  # never announce a chunk that failed
                self._digests.append(h.digest)
                if h.seq == 0:
                    self.local.forward([TOPIC_SHM, encode_begin(h.meta, str(self._pub_file.path))])
                self.local.forward([TOPIC_SHM, encode_chunk(h.src, h.version, h.seq)])
            if done is not None:
                self._offer(done, "pub")

    def _offer(self, done: Completed, source: str) -> None:
        super()._offer(done, source)
        with self._cv:
            ready, self._ready = self._ready, None
            if ready is not None:
                self._last = ready.meta
        if ready is None:
            return
        meta = ready.meta
        f = self._files.pop(ready.buf_N.data_ptr())
        if source == "pub" and len(self._digests) == meta.n_chunks:
            digests = self._digests
        elif source == "delta" and self._delta_digests is not None:
            digests = self._delta_digests
        else:  # a snapshot: hash it here (late joins and repairs only)
            mv = memoryview(ready.buf_N.numpy())
            digests = list(self._pool.map(lambda i: chunk_digest(meta.algo, mv[slice(*chunk_span(meta, i))],
                                                                 ready.raw_meta if i == 0 else None),
                                          range(meta.n_chunks)))
        if source != "pub":
            f.stamp(meta.src, meta.version)  # nobody read it early
        self._digests, self._delta_digests, self._pub_file = [], None, None
        self.local.adopt(meta, ready.raw_meta, digests, f, ready.buf_N)
        M.RELAY_VERSIONS.inc()
