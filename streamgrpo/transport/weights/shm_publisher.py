"""The learner side of ``weights.transport=shm``: ZeroMQ publishing (TCP for other hosts, ipc:// for
this one) whose version buffers are shared-memory files that same-host generators map, announced on
the PUB socket instead of being received (the protocol: :mod:`.shm`)."""

from __future__ import annotations

import os

import torch

from streamgrpo.transport.weights import shm as shm_wire
from streamgrpo.transport.weights.outgoing import OutgoingVersion
from streamgrpo.transport.weights.publisher import WeightPublisher
from streamgrpo.transport.weights.shm import ShmFile, ShmPool


class ShmPublisher(WeightPublisher):
    """:class:`~.publisher.WeightPublisher` with each version in a file under ``shm_dir`` (a tmpfs).

    Remote subscribers still get chunks over TCP and late joiners the snapshot endpoint; same-host
    subscribers (:class:`~.shm_subscriber.ShmSubscriber`) read the file. A file a generator still
    reads is never rewritten (it holds a shared lock; the learner makes another file instead).
    """

    def __init__(self, *args, shm_dir: str | os.PathLike = shm_wire.DEFAULT_SHM_DIR, **kw):
        self._shm_dir = shm_dir
        super().__init__(*args, **kw)

    # -- the hooks of WeightPublisher ---------------------------------------------------------------
    def _setup_backend(self) -> None:
        self._shm = ShmPool(self._shm_dir, self.src, max_files=max(2, self.host_buffers) + 1)

    def _describe_backend(self) -> str:
        return f", versions in shared memory under {self._shm.dir}"

    def _take_storage(self, version: int, nbytes: int, cuda: bool) -> tuple[torch.Tensor, ShmFile]:
        """A shared-memory file for a new version, locked for writing; files of retired versions that
        ZeroMQ has let go of are reusable (unless a generator still reads them: see ShmPool.take)."""
        with self._lock:
            for v in self._released():
                self._shm.give_back(v.storage)
            f = self._shm.take(nbytes)
        f.stamp(self.src, version)  # before any byte of this version (readers check it)
        return f.tensor, f

    def take_file(self, nbytes: int) -> ShmFile:
        """A file for a version written by someone else (a relay receiving it), locked for writing."""
        with self._lock:
            for v in self._released():
                self._shm.give_back(v.storage)
            return self._shm.take(nbytes)

    def give_back_file(self, f: ShmFile) -> None:
        """A :meth:`take_file` file whose version will not be adopted."""
        f.unlock()
        with self._lock:
            self._shm.give_back(f)

    def _recycle(self, job: OutgoingVersion) -> None:  # lock held: a version that never went out
        job.storage.unlock()
        self._shm.give_back(job.storage)

    def _chunk_out(self, job: OutgoingVersion, seq: int) -> None:
        """Same-host readers hash this chunk now, while later ones are written."""
        if seq == 0:
            self._pub.send_multipart([shm_wire.TOPIC_SHM, shm_wire.encode_begin(job.meta_bytes, str(job.storage.path))])
        self._pub.send_multipart([shm_wire.TOPIC_SHM, shm_wire.encode_chunk(job.meta.src, job.meta.version, seq)])

    def _version_out(self, job: OutgoingVersion) -> None:
        """Readers may lock the file now; then tell same-host generators where it is."""
        job.storage.unlock()
        self._pub.send_multipart([shm_wire.TOPIC_SHM, shm_wire.encode_announcement(job.meta_bytes, job.digests,
                                                                                    str(job.storage.path))])

    def _version_dropped(self, job: OutgoingVersion) -> None:
        job.storage.unlock()

    def _close_backend(self) -> None:
        self._shm.close()
