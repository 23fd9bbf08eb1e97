"""Same-host weight versions through shared memory (``weights.transport=shm``).

Generators on the learner's host need not receive a version's bytes through a socket at all: the
learner already copies every version into a host buffer before sending it. With ``shm_dir`` (default
``/dev/shm``) those buffers are files there, mapped by both sides. After a version's last chunk is
hashed, the learner sends one small message on its PUB socket::

    [b"s", msgpack {"m": meta record, "d": [chunk digests], "p": file path}]

and a subscriber in shm mode (it subscribes to that topic instead of the chunk topic) maps the
file, copies every chunk into its own memory and verifies the digest of the copy (a thread pool; one
pass over the bytes), and hands out tensors of that copy: what was verified is exactly what is
applied, whatever writes into the shared file later (another process of the same user included).
So that this pass overlaps the learner's writing, the learner also sends ``{"b": 1, "m", "p"}`` when
it starts a version and ``{"c": seq, "s", "v"}`` as each chunk's digest is known (its bytes are final
then); a reader copies and hashes each chunk as it is announced and, at the last message, only what
it has not done yet, then compares every digest with the last message's list.

Each file ends in a 4 KiB trailer page whose last 16 bytes name the version it holds (publisher
id, version), written before any byte of that version. A reader checks it after taking its lock:
chunks hashed before the lock then provably belong to the announced version (a file taken for a
newer one carries the newer stamp). Remote (TCP) subscribers get the same version as
chunks, as before; late joiners use the snapshot endpoint, as before.

Who may overwrite a file: a reader holds a shared ``flock`` on it while it copies and verifies; the
learner takes a file for a new version only with an exclusive ``flock`` it gets without waiting, so a
file someone still copies is never rewritten (the learner makes another one instead, up to
``max_files``). A reader that finds the file locked, or
whose digests do not match (the file was taken for a newer version before it locked it), drops
that announcement: the newer version's own announcement follows. Locks die with their process,
so a reader killed with ``kill -9`` blocks nothing.

Files are named ``streamgrpo-w-<pid>-<publisher id>-<n>``; the learner unlinks them at close, and
sweeps files of dead learner processes at start (a learner killed with ``kill -9`` leaves them).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import torch

from streamgrpo.transport.weights.codec import (
    Completed,
    VersionMeta,
    WeightsFormatError,
    chunk_digest,
    chunk_span,
    decode_meta,
    unpack_map,
)
from streamgrpo.transport.weights.layout import parse_layout

log = logging.getLogger("streamgrpo.transport.weights")

TOPIC_SHM = b"s"
DEFAULT_SHM_DIR = "/dev/shm"
PREFIX = "streamgrpo-w-"
_NAME = re.compile(r"^streamgrpo-w-(\d+)-(\d+)-(\d+)$")


TRAILER = 4096  # bytes after the largest version a file may hold; its last 16 name the version in it
_STAMP = struct.Struct("<QQ")


# ------------------------------------------------------------------------------------ messages
@dataclass(frozen=True)
class Announcement:
    meta: VersionMeta
    meta_bytes: bytes
    digests: list[bytes]
    path: str


def encode_announcement(meta_bytes: bytes, digests: list[bytes], path: str) -> bytes:
    return msgpack.packb({"m": meta_bytes, "d": digests, "p": path}, use_bin_type=True)


def encode_begin(meta_bytes: bytes, path: str) -> bytes:
    return msgpack.packb({"b": 1, "m": meta_bytes, "p": path}, use_bin_type=True)


def encode_chunk(src: int, version: int, seq: int) -> bytes:
    return msgpack.packb({"c": seq, "s": src, "v": version}, use_bin_type=True)


def decode_announcement(raw: bytes, shm_dir: str | os.PathLike) -> Announcement:
    """Parse and check an announcement; the file must be one of ours, directly in ``shm_dir``."""
    d = unpack_map(raw, "weights shm announcement")
    if not isinstance(d.get("m"), bytes) or not isinstance(d.get("p"), str):
        raise WeightsFormatError("weights shm announcement: expected a map with meta bytes 'm' and a path 'p'")
    meta = decode_meta(d["m"])
    digests = d.get("d")
    if not (isinstance(digests, list) and len(digests) == meta.n_chunks and all(isinstance(x, bytes) for x in digests)):
        raise WeightsFormatError(f"weights shm announcement v{meta.version}: expected {meta.n_chunks} chunk digests")
    return Announcement(meta, d["m"], digests, _checked_path(d["p"], shm_dir, meta.version))


def _checked_path(path: str, shm_dir: str | os.PathLike, version: int) -> str:
    """The file must be one of ours, directly in ``shm_dir``."""
    p = Path(path)
    if p.parent != Path(shm_dir) or not _NAME.match(p.name):
        raise WeightsFormatError(f"weights shm announcement v{version}: {path!r} is not a weights file in {shm_dir}")
    return str(p)


# ------------------------------------------------------------------------------------ learner side
class ShmUnavailable(RuntimeError):
    """weights.shm_dir is missing or cannot hold another version file (a one-line error for the user)."""


class ShmFile:
    """One mapped file the learner writes versions into (``tensor``: the whole file as uint8; a
    version's payload starts at 0, the trailer page is the last :data:`TRAILER` bytes)."""

    def __init__(self, path: Path, nbytes: int):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.size = max(1, nbytes) + TRAILER
        try:  # reserve the pages now: a tmpfs that runs out later would kill the writer with SIGBUS
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as exc:
            os.close(self.fd)
            path.unlink(missing_ok=True)
            raise ShmUnavailable(f"weights.shm_dir {str(path.parent)!r} has no room for a {self.size / 1e9:.2f} GB "
                          f"version ({exc.strerror}): give it more (Docker: shm_size) or use weights.transport=ipc") from None
        self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    @property
    def capacity(self) -> int:
        return self.size - TRAILER

    def stamp(self, src: int, version: int) -> None:
        """Name the version this file holds from now on (before any byte of it is written; x86 and
        the syscalls around a reader's lock keep that order visible to readers)."""
        self.map[self.size - _STAMP.size:] = _STAMP.pack(src, version)

    def try_lock(self) -> bool:
        """Exclusive lock without waiting: False while a reader holds it."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)  # the mapping stays valid while any tensor view of it lives


def sweep_stale(shm_dir: str | os.PathLike) -> int:
    """Remove weights files whose learner process is gone; returns how many."""
    removed = 0
    for p in Path(shm_dir).glob(PREFIX + "*"):
        m = _NAME.match(p.name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            p.unlink()
            removed += 1
        except OSError:
            pass
    if removed:
        log.info("weights: removed %d shared-memory file(s) of learners that are gone from %s", removed, shm_dir)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmPool:
    """The learner's files: reused when nobody reads them, a new one otherwise (at most ``max_files``)."""

    def __init__(self, shm_dir: str | os.PathLike, src: int, max_files: int = 4):
        self.dir = Path(shm_dir)
        if not self.dir.is_dir():
            raise ShmUnavailable(f"weights.shm_dir {str(self.dir)!r} is not a directory (weights.transport=shm)")
        sweep_stale(self.dir)
        self.src, self.max_files = src, max_files
        self.files: list[ShmFile] = []
        self.idle: list[ShmFile] = []  # not holding a version the learner still serves
        self._n = 0

    def check_room(self, nbytes: int) -> None:
        """Before the first version: the directory must hold ``max_files`` versions of ``nbytes``, or the
        learner would stop mid-run when readers keep files and a new one does not fit."""
        st = os.statvfs(self.dir)
        free, need = st.f_bavail * st.f_frsize, self.max_files * (max(1, nbytes) + TRAILER)
        if free < need:
            raise ShmUnavailable(
                f"weights.shm_dir {str(self.dir)!r} has {free / 1e9:.2f} GB free and the learner may keep "
                f"{self.max_files} versions of {nbytes / 1e9:.2f} GB there ({need / 1e9:.2f} GB): give it more "
                "(Docker: shm_size), lower weights.host_buffers, or use weights.transport=ipc")

    def take(self, nbytes: int) -> ShmFile:
        """An exclusively locked file of a fitting size (the caller unlocks it when the version is out)."""
        if not self.files:
            self.check_room(nbytes)
        for f in list(self.idle):
            if nbytes <= f.capacity <= 2 * nbytes + (1 << 16) and f.try_lock():
                self.idle.remove(f)
                return f
        if len(self.files) >= self.max_files:  # make room: drop an idle file nobody reads (else grow past the cap)
            for f in list(self.idle):
                if f.try_lock():
                    self.idle.remove(f)
                    self.files.remove(f)
                    f.close()
                    break
            else:
                log.warning("weights: all %d shared-memory files are in use by readers; making one more",
                            len(self.files))
        self._n += 1
        f = ShmFile(self.dir / f"{PREFIX}{os.getpid()}-{self.src}-{self._n}", nbytes)
        f.try_lock()
        self.files.append(f)
        return f

    def give_back(self, f: ShmFile) -> None:
        """The learner no longer serves the version in ``f`` (readers may still hold it)."""
        if f in self.files and f not in self.idle:
            self.idle.append(f)

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files, self.idle = [], []


# ------------------------------------------------------------------------------------ generator side
class Maps:
    """A reader's mappings of the learner's files, kept across versions: the learner reuses a few files,
    and a mapping whose pages are already in this process's page tables costs no page faults the next
    time. Keyed by path and checked by inode (a file replaced under the same name is mapped anew);
    at most ``keep`` (the learner keeps ``host_buffers + 1`` files), least recently used dropped."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._maps: dict[str, tuple[int, int, mmap.mmap]] = {}  # path -> (inode, size, mapping)

    def get(self, path: str, inode: int, size: int) -> mmap.mmap:
        hit = self._maps.pop(path, None)
        if hit is not None and hit[0] == inode and hit[1] == size:
            self._maps[path] = hit  # most recently used last
            return hit[2]
        view = _map_readonly(path, size)
        self._maps[path] = (inode, size, view)
        while len(self._maps) > self.keep:
            self._maps.pop(next(iter(self._maps)))  # dropped: unmapped once no tensor views it
        return view


def _map_readonly(path: str, size: int) -> mmap.mmap:
    """Map ``path`` through its own descriptor: mmap keeps a duplicate of the descriptor it was given,
    and a duplicate of the locked one would keep the shared lock alive after the lease is released.
    MAP_POPULATE faults every page in at once (the digest pass reads them all anyway)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
    finally:
        os.close(fd)


def stamp_of(view: mmap.mmap) -> tuple[int, int]:
    """(publisher id, version) a mapped file says it holds."""
    return _STAMP.unpack(view[len(view) - _STAMP.size:])


def _copy_hash(algo: str, src: memoryview, dst: np.ndarray, meta_bytes: bytes | None) -> bytes:
    """Copy one chunk out of the shared file into private memory and hash the copy: what is verified is
    exactly what will be used, whatever writes into the file afterwards."""
    np.copyto(dst, np.frombuffer(src, dtype=np.uint8))
    return chunk_digest(algo, dst, meta_bytes)


def _private(alloc: Callable[[int], torch.Tensor] | None, nbytes: int) -> torch.Tensor:
    return alloc(nbytes) if alloc is not None else torch.empty(max(nbytes, 1), dtype=torch.uint8)[:nbytes]


def read_version(a: Announcement, pool: Executor | None = None, maps: Maps | None = None,
                 early: EarlyHashes | None = None,
                 alloc: Callable[[int], torch.Tensor] | None = None) -> Completed | str:
    """Copy the announced version out of its file into private memory (``alloc(nbytes)``), verify the
    copy's digests, and return it (or a one-line reason it was dropped). The file is read under a
    shared lock (the learner does not take it for a newer version meanwhile), released before this
    returns: nothing the generator uses afterwards lives in the file. ``early``: chunks already copied
    and hashed while the learner was still writing (see module doc)."""
    try:
        fd = os.open(a.path, os.O_RDONLY)
    except OSError as exc:
        return f"weights version {a.meta.version}: shared-memory file unavailable ({exc.strerror})"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return f"weights version {a.meta.version}: its shared-memory file is being rewritten (superseded)"
    try:
        st = os.fstat(fd)
        if st.st_size < a.meta.nbytes + TRAILER:
            raise WeightsFormatError(f"file has {st.st_size} bytes, the version {a.meta.nbytes} and a trailer")
        view = (maps or Maps()).get(a.path, st.st_ino, st.st_size)
        if stamp_of(view) != (a.meta.src, a.meta.version):
            raise WeightsFormatError("the file now holds another version (rewritten)")
        buf_N, done = early.take(a) if early is not None else (None, {})
        if buf_N is None:
            buf_N = _private(alloc, a.meta.nbytes)
        mv, dst = memoryview(view)[: a.meta.nbytes], buf_N.numpy()
        todo = [q for q in range(a.meta.n_chunks) if q not in done]
        spans = {q: chunk_span(a.meta, q) for q in todo}
        run = pool.map if pool is not None else map
        rest = run(lambda q: _copy_hash(a.meta.algo, mv[spans[q][0]:spans[q][1]], dst[spans[q][0]:spans[q][1]],
                                        a.meta_bytes if q == 0 else None), todo)
        got_by = {**{q: f.result() if hasattr(f, "result") else f for q, f in done.items()}, **dict(zip(todo, rest))}
        got = [got_by[q] for q in range(a.meta.n_chunks)]
        bad = [i for i, (x, y) in enumerate(zip(got, a.digests)) if x != y]
        if bad:
            raise WeightsFormatError(f"digest mismatch ({a.meta.algo}) in chunk {bad[0]}: rewritten or tampered")
        entries = parse_layout(buf_N)
    except (WeightsFormatError, OSError, ValueError) as exc:
        return f"weights version {a.meta.version} (shared memory): {exc}, discarded"
    finally:
        os.close(fd)  # the copy is verified (or dropped): the learner may have its file back
    return Completed(a.meta, buf_N, entries)


class EarlyHashes:
    """A reader's chunk copies and hashes started before a version is complete (the learner's begin and
    chunk messages), so that verifying overlaps the learner's writing. Each announced chunk is copied
    out of the file into the version's private buffer and the copy hashed. Only the version in
    progress is kept; its work is used only if the final announcement names the same (publisher,
    version, file) and the file's stamp, read under the reader's lock, still names it (a chunk
    rewritten after its copy cannot matter: the copy is what is used)."""

    def __init__(self, shm_dir: str | os.PathLike, pool: Executor | None = None, maps: Maps | None = None,
                 alloc: Callable[[int], torch.Tensor] | None = None):
        self.dir, self.pool, self.maps, self.alloc = shm_dir, pool, maps or Maps(), alloc
        self._key: tuple[int, int, str] | None = None
        self._meta: VersionMeta | None = None
        self._meta_bytes = b""
        self._view: memoryview | None = None
        self._buf: torch.Tensor | None = None
        self._futures: dict[int, object] = {}
        self.used = 0  # chunks whose early copy a verified version used

    def begin(self, raw_meta: bytes, path: str) -> None:
        meta = decode_meta(raw_meta)
        path = _checked_path(path, self.dir, meta.version)
        self.reset()
        try:
            st = os.stat(path)
            view = self.maps.get(path, st.st_ino, st.st_size)
        except (OSError, ValueError):
            return  # the final announcement copies and verifies everything instead
        self._key, self._meta, self._meta_bytes = (meta.src, meta.version, path), meta, raw_meta
        self._view = memoryview(view)
        self._buf = _private(self.alloc, meta.nbytes)

    def chunk(self, src: int, version: int, seq: int) -> None:
        meta, view, buf = self._meta, self._view, self._buf
        if meta is None or view is None or buf is None or (src, version) != (meta.src, meta.version) \
                or not 0 <= seq < meta.n_chunks:
            return
        s, e = chunk_span(meta, seq)
        if e > len(view):
            return
        args = (meta.algo, view[s:e], buf.numpy()[s:e], self._meta_bytes if seq == 0 else None)
        self._futures[seq] = self.pool.submit(_copy_hash, *args) if self.pool is not None else _copy_hash(*args)

    def take(self, a: Announcement) -> tuple[torch.Tensor | None, dict[int, object]]:
        """The private buffer and the chunk hashes started for ``a`` (then forgotten); ``(None, {})`` if
        they were for something else."""
        if self._key == (a.meta.src, a.meta.version, a.path):
            out = self._buf, self._futures
            self._buf, self._futures = None, {}  # handed over: the caller waits for them
        else:
            out = None, {}
        self.reset()
        self.used += len(out[1])
        return out

    def reset(self) -> None:
        for f in self._futures.values():  # never leave a worker writing into a buffer we let go of
            if hasattr(f, "result"):
                f.result()
        self._key, self._meta, self._view, self._buf, self._futures = None, None, None, None, {}


def decode_early(raw: bytes) -> dict:
    """A begin (``{"b", "m", "p"}``) or chunk (``{"c", "s", "v"}``) message, type-checked; {} if neither."""
    d = unpack_map(raw, "weights shm message")
    if "b" in d:
        if not (isinstance(d.get("m"), bytes) and isinstance(d.get("p"), str)):
            raise WeightsFormatError("weights shm begin: expected meta bytes 'm' and a path 'p'")
        return d
    if "c" in d:
        if not all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for k in ("c", "s", "v")):
            raise WeightsFormatError("weights shm chunk: expected integers 'c', 's', 'v'")
        return d
    return {}
