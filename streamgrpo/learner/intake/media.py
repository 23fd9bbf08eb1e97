"""Visuals by reference on the learner: decoded ahead of the step, checked against their digest.

A group whose visuals travel by reference (``rollout.media: reference``, wire schema 3) names each
file, its frame indices, size and decoder, and the digest of the pixels the generator used. The
learner decodes the same frames with the same code (:func:`streamgrpo.data.video.decode_resized`),
checks the digest and trains on them; a missing file or other pixels (the file changed, another
decoder build) make the group a dead letter (``media_missing`` / ``media_mismatch``, the reason names
the file), never a step on other pixels. A path is resolved with ``realpath`` and must lie inside the
learner's media root (``data.media_root``, else the training file's folder), else ``media_outside``:
no reference names any other file, through a symlink or ``/proc``. :class:`MediaWatch` decides when
failures are this learner's own (its media root gone) and it stops.

:class:`MediaResolver` decodes in a small thread pool as groups arrive, through a byte-bounded LRU
keyed by what decides the pixels (file and its stat, decoder, indices, size); :class:`ReadAhead`
reads the next step's groups from the queue as soon as a step has its own, so their decoding runs
while the step trains. Metrics: ``media_cache{result}``, ``media_decode_seconds`` and
``media_wait_seconds`` (time a step waited for decoding: 0 when it is hidden).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from streamgrpo import metrics as M
from streamgrpo.config import DataConfig
from streamgrpo.data.decode import (
    DecodeError,
    FrameCache,
    NotAFile,
    fd_path,
    open_regular,
    size_problem,
    source_size,
)
from streamgrpo.data.records import default_media_root, ref_file
from streamgrpo.data.video import decode_resized
from streamgrpo.wire import ScoredGroup, Visual
from streamgrpo.wire.media import digest_matches, frames_digest

log = logging.getLogger("streamgrpo.learner")


class MediaUnavailable(RuntimeError):
    """This learner cannot resolve references at all: it resolved none for ``learner.media_unavailable_s``
    and its own media root is missing, unreadable or empty. It stops, so that the groups not read yet stay
    queued instead of all becoming dead letters."""


class MediaError(Exception):
    """A referenced visual cannot give the generator's pixels; ``label`` is the dead-letter reason."""

    def __init__(self, label: str, message: str):
        super().__init__(message)
        self.label = label


def by_reference(group: ScoredGroup) -> bool:
    """Whether some visual of ``group`` still has to be decoded from its reference."""
    return any(v.frames is None for v in group.visuals)


def check_media_root(data: DataConfig) -> str | None:
    """One line saying why this machine cannot read the media references point into, or None: the root
    (``data.media_root``, else the training file's folder) is not a directory, not readable, or empty
    (a mount point with nothing mounted)."""
    root = default_media_root(data)
    if not os.path.isdir(root):
        return f"data.media_root {root} is not a directory here"
    if not os.access(root, os.R_OK | os.X_OK):
        return f"data.media_root {root} is not readable by this user"
    try:
        with os.scandir(root) as entries:
            empty = next(entries, None) is None
    except OSError as exc:
        return f"data.media_root {root} cannot be listed: {exc.strerror or exc}"
    return f"data.media_root {root} is empty (not mounted here?)" if empty else None


class MediaWatch:
    """Whether the references this learner cannot resolve are its own fault: then it stops.

    A group whose reference cannot be resolved is dead-lettered and training goes on with the others, so
    a stream holding many bad references (anyone who can write to it may send them) is a stream of dead
    letters, never an off switch. The learner stops (:class:`MediaUnavailable`) only when it has resolved
    no reference for ``after_s`` seconds (``learner.media_unavailable_s``) *and* its own media root,
    checked directly (:func:`check_media_root`, at most once per ``pause_s``), is missing, unreadable or
    empty. While the root is unusable each failure also waits ``pause_s``, so the groups read before the
    learner stops are a few, not the whole backlog."""

    def __init__(self, data: DataConfig, after_s: float = 60.0, clock=time.monotonic, sleep=time.sleep,
                 pause_s: float = 1.0):
        self.data, self.after_s, self.pause_s = data, after_s, pause_s
        self._clock, self._sleep = clock, sleep
        self._failing_since: float | None = None  # the first failure since the last reference resolved
        self._checked_at, self._problem = -1e18, None  # the last direct check of the media root

    def resolved(self) -> None:
        self._failing_since = None

    def root_problem(self) -> str | None:
        """:func:`check_media_root`, checked again when the last check is ``pause_s`` old."""
        now = self._clock()
        if now - self._checked_at >= self.pause_s:
            self._checked_at, self._problem = now, check_media_root(self.data)
        return self._problem

    def failed(self, exc: Exception) -> None:
        """A reference could not be resolved (``exc``, its group already dead-lettered); raises
        :class:`MediaUnavailable` when none was for ``after_s`` and the media root is unusable here."""
        now = self._clock()
        if self._failing_since is None:
            self._failing_since = now
        waited = now - self._failing_since
        problem = self.root_problem()
        if problem is None:
            return  # the root is there: these references name files it does not hold (dead letters)
        if waited < self.after_s:
            self._sleep(self.pause_s)  # the root may come back (a remount): read slowly meanwhile
            return
        label = getattr(exc, "label", type(exc).__name__)
        raise MediaUnavailable(
            f"stopping: no group by reference could be resolved here for {waited:.0f} s "
            f"(learner.media_unavailable_s {self.after_s:g}) and {problem}; the groups not read yet stay queued "
            f"(the last one: {label}: {exc}). Mount the generators' media where data.media_root says, or "
            "have them send rollout.media: inline")


class MediaResolver:
    """Decodes groups' referenced visuals in ``workers`` threads, through a ``cache_mib`` MiB cache.

    Each file is opened once (:func:`~streamgrpo.data.decode.open_regular`: without blocking, a FIFO or a
    device refused as ``media_missing``), and decoded from that descriptor, so nothing swapped in after the
    check is read; its header is read before any frame is decoded, and a native size over
    ``max_source_pixels`` is ``size_mismatch`` (the decode's memory follows the native size, the message
    declares only the resized one)."""

    def __init__(self, data: DataConfig, cache_mib: int = 1024, workers: int = 1,
                 max_source_pixels: int = 7680 * 4320):
        self.data = data
        self.max_source_pixels = int(max_source_pixels)  # learner.max_source_pixels
        self.breaker = None  # a CrashLoopBreaker: decodes are marked, so a death in one is counted for its group
        self.cache = FrameCache(cache_mib << 20)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="media")
        self._pending: dict[str, Future] = {}

    def submit(self, deliveries: list) -> bool:
        """Start decoding the referenced visuals of ``deliveries``; True if any had one."""
        any_ref = False
        for d in deliveries:
            if by_reference(d.group):
                any_ref = True
                self._pending[d.stream_id] = self._pool.submit(self.resolve, d.group)
        return any_ref

    def resolved(self, d) -> ScoredGroup:
        """``d.group`` with its referenced frames decoded and checked (waits for its decode if still
        running; counted in ``media_wait_seconds``). Raises :class:`MediaError`."""
        if not by_reference(d.group):
            return d.group
        fut = self._pending.pop(d.stream_id, None)
        if fut is None:
            fut = self._pool.submit(self.resolve, d.group)
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            M.MEDIA_WAIT_SECONDS.inc(time.perf_counter() - t0)

    def discard(self, stream_id: str) -> None:
        """Forget a delivery's decode (the group was dropped before it was needed)."""
        fut = self._pending.pop(stream_id, None)
        if fut is not None:
            fut.cancel()

    def resolve(self, group: ScoredGroup) -> ScoredGroup:
        """``group`` with every referenced visual's frames decoded and digest-checked (any thread); with a
        crash-loop ``breaker`` set, marked as being read meanwhile (a death here counts for it)."""
        if self.breaker is not None:
            with self.breaker.reading(group.group_id):
                return self._resolve(group)
        return self._resolve(group)

    def _resolve(self, group: ScoredGroup) -> ScoredGroup:
        return replace(group, visuals=[self._frames(v, f"visuals[{i}]") for i, v in enumerate(group.visuals)])

    def _frames(self, v: Visual, where: str) -> Visual:
        if v.frames is not None:
            return v
        ref = v.ref
        try:
            path = ref_file(ref.path, self.data)
        except ValueError as exc:  # outside the media root, a symlink out of it included
            raise MediaError("media_outside", f"{where}: media file {exc}") from None
        try:  # opened once, never blocking (a FIFO), checked on the descriptor, decoded from it
            fd, st = open_regular(path)
        except NotAFile as exc:
            raise MediaError("media_missing", f"{where}: media file {exc}: refused (reference {ref.path!r})") from None
        except FileNotFoundError:
            raise MediaError("media_missing", f"{where}: media file {path} not found on the learner "
                                              f"(reference {ref.path!r}; data.media_root {default_media_root(self.data)})") from None
        except OSError as exc:  # unreadable, or its last component swapped for a symlink (O_NOFOLLOW)
            raise MediaError("media_missing", f"{where}: media file {path}: {exc.strerror or exc}") from None
        try:
            return self._frames_from(v, path, fd, st, where)
        finally:
            os.close(fd)

    def _frames_from(self, v: Visual, path: str, fd: int, st: os.stat_result, where: str) -> Visual:
        ref = v.ref
        indices = [int(i) for i in v.frame_indices] if v.kind == "video" else [0]
        key = (path, st.st_mtime_ns, st.st_size, v.kind, ref.decoder, tuple(indices), ref.height, ref.width)
        frames = self.cache.get(key)
        M.MEDIA_CACHE.labels(result="miss" if frames is None else "hit").inc()
        if frames is None:
            source = fd_path(fd)  # the file opened above, whatever the path names now
            self._check_size(v, path, source, st, indices, where)
            frames = self._decode(v, path, source, indices, where)
            self.cache.put(key, frames)
        if not digest_matches(frames, ref.digest):
            log.debug("%s: %s decodes to %s here, the message says %s", where, path,
                      frames_digest(frames, ref.digest.split(":", 1)[0]), ref.digest)
            raise MediaError("media_mismatch", f"{where}: media file {path} decodes to other pixels than the "
                                               f"generator's (digest {ref.digest}): the file changed since it was "
                                               "sampled, or the decoder build differs (rollout.media: inline avoids "
                                               "re-decoding)")
        return replace(v, frames=frames)

    def _check_size(self, v: Visual, path: str, source: str, st: os.stat_result, indices: list[int],
                    where: str) -> None:
        """The file's own header (nothing decoded) against what the message declares and
        ``learner.max_source_pixels``: a file that lies about its size is ``size_mismatch``."""
        ref = v.ref
        try:
            size = source_size(v.kind, source)
        except DecodeError as exc:
            label = "size_mismatch" if exc.kind == "too_large" else "media_mismatch"
            raise MediaError(label, f"{where}: media file {path} ({st.st_size:,} bytes) not decoded: "
                                    f"{str(exc).replace(source, path)}") from None
        why = size_problem(size, indices, ref.height, ref.width, self.max_source_pixels)
        if why is not None:
            raise MediaError("size_mismatch", f"{where}: media file {path} ({st.st_size:,} bytes) not decoded: {why} "
                                              "(learner.max_source_pixels)")

    def _decode(self, v: Visual, path: str, source: str, indices: list[int], where: str) -> Any:
        ref = v.ref
        readers: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            return decode_resized(v.kind, source, indices, ref.height, ref.width, ref.decoder, readers)
        except Exception as exc:  # noqa: BLE001 - DecodeError, OSError, or a decoder's own: never the learner's crash
            why = str(exc) if isinstance(exc, (DecodeError, OSError)) else f"{type(exc).__name__}: {exc}"
            raise MediaError("media_mismatch", f"{where}: media file {path} cannot be decoded here as the generator "
                                               f"did ({why.replace(source, path)})") from None
        finally:
            for reader in readers.values():
                reader.close()
            M.MEDIA_DECODE_SECONDS.observe(time.perf_counter() - t0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()


class ReadAhead:
    """A queue's ``get`` that, once groups by reference have been seen, reads up to ``ahead`` more
    groups (without waiting) after serving a request, and starts decoding them: the next step's
    frames decode while this step trains. Groups read ahead stay pending for this consumer in Redis,
    like any group held for a step (a restart re-reads them)."""

    def __init__(self, queue, resolver: MediaResolver, ahead: int):
        self.queue, self.resolver, self.ahead = queue, resolver, ahead
        self._buffer: list = []
        self._refs_seen = False

    def get(self, n: int, timeout_s: float) -> list:
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        if len(out) < n:
            fresh = self.queue.get(n - len(out), 0.0 if out else timeout_s)
            self._refs_seen |= self.resolver.submit(fresh)
            out += fresh
        if self._refs_seen and len(self._buffer) < self.ahead:
            more = self.queue.get(self.ahead - len(self._buffer), 0.0)
            self.resolver.submit(more)
            self._buffer += more
        return out

    @property
    def buffered(self) -> int:
        return len(self._buffer)
