"""The generator side of ``weights.transport=shm``: versions read from the learner's shared-memory
files (announced on its ipc:// PUB socket) instead of received (the protocol: :mod:`.shm`)."""

from __future__ import annotations

import os

import torch

from streamgrpo.transport.weights.codec import decode_meta, newer
from streamgrpo.transport.weights.shm import (
    DEFAULT_SHM_DIR,
    TOPIC_SHM,
    EarlyHashes,
    Lease,
    Maps,
    decode_announcement,
    decode_early,
    read_version,
)
from streamgrpo.transport.weights.subscriber import WeightSubscriber


class ShmSubscriber(WeightSubscriber):
    """:class:`~.subscriber.WeightSubscriber` (with ``ipc_dir``) that maps each new version's file under
    ``shm_dir``, verifies every chunk digest in one pass, and hands out views of the mapping: nothing is
    copied. The file stays locked for this generator until :meth:`mark_applied` releases it; snapshots
    (late joiners, repairs) still arrive as chunks."""

    _data_topic = TOPIC_SHM

    def __init__(self, *args, shm_dir: str | os.PathLike = DEFAULT_SHM_DIR, **kw):
        self.shm_dir = shm_dir
        super().__init__(*args, **kw)

    def _setup_backend(self) -> None:
        self._leases: dict[int, Lease] = {}  # data_ptr of a version's buffer -> its file lock
        self._maps = Maps()  # the learner's files, mapped once each
        self._early = EarlyHashes(self.shm_dir, self._pool, self._maps)  # chunks hashed while the learner writes
        self.stats["from_shm"] = 0

    def _side_message(self, frames: list) -> bool:
        if frames[0].bytes != TOPIC_SHM or len(frames) != 2:
            return False
        self._read_shm(frames[1].bytes)
        return True

    def _release(self, buf: torch.Tensor) -> None:
        with self._cv:
            lease = self._leases.pop(buf.data_ptr(), None)
        if lease is not None:  # a shared-memory version: let the learner have its file back
            lease.release()
            return
        super()._release(buf)

    def _read_shm(self, raw: bytes) -> None:
        """A version announced in shared memory: map, verify and offer it (a malformed announcement
        raises WeightsFormatError for the caller to count)."""
        early = decode_early(raw)
        if "b" in early:
            if newer(decode_meta(early["m"]), self._have):
                self._early.begin(early["m"], early["p"])
            return
        if "c" in early:
            self._early.chunk(early["s"], early["v"], early["c"])
            return
        a = decode_announcement(raw, self.shm_dir)
        if not newer(a.meta, self._have):
            self._early.reset()
            return
        got = read_version(a, self._pool, self._maps, self._early)
        self.stats["shm_early_chunks"] = self._early.used
        if isinstance(got, str):  # superseded while we looked, or rewritten: the newer one follows
            self._dropped(got, repair=False)
            return
        done, lease = got
        with self._cv:
            self._leases[done.buf_N.data_ptr()] = lease
        self._offer(done, "shm")
