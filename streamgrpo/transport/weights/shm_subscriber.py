"""The generator side of ``weights.transport=shm``: versions read from the learner's shared-memory
files (announced on its ipc:// PUB socket) instead of received (the protocol: :mod:`.shm`)."""

from __future__ import annotations

import os

from streamgrpo.transport.weights.codec import decode_meta, newer
from streamgrpo.transport.weights.shm import (
    DEFAULT_SHM_DIR,
    TOPIC_SHM,
    EarlyHashes,
    Maps,
    decode_announcement,
    decode_early,
    read_version,
)
from streamgrpo.transport.weights.subscriber import WeightSubscriber


class ShmSubscriber(WeightSubscriber):
    """:class:`~.subscriber.WeightSubscriber` (with ``ipc_dir``) that reads each new version from its file
    under ``shm_dir`` instead of receiving it: one pass copies every chunk into this process's memory
    and verifies the copy's digest (no socket, no second copy), so what is applied is what was
    verified; snapshots (late joiners, repairs) still arrive as chunks."""

    _data_topic = TOPIC_SHM

    def __init__(self, *args, shm_dir: str | os.PathLike = DEFAULT_SHM_DIR, **kw):
        self.shm_dir = shm_dir
        super().__init__(*args, **kw)

    def _setup_backend(self) -> None:
        self._maps = Maps()  # the learner's files, mapped once each
        # chunks copied and hashed while the learner still writes the version
        self._early = EarlyHashes(self.shm_dir, self._pool, self._maps, alloc=self._alloc)
        self.stats["from_shm"] = 0

    def _side_message(self, frames: list) -> bool:
        if frames[0].bytes != TOPIC_SHM or len(frames) != 2:
            return False
        self._read_shm(frames[1].bytes)
        return True

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
        got = read_version(a, self._pool, self._maps, self._early, alloc=self._alloc)
        self.stats["shm_early_chunks"] = self._early.used
        if isinstance(got, str):  # superseded while we looked, or rewritten: the newer one follows
            self._dropped(got, repair=False)
            return
        self._offer(got, "shm")
