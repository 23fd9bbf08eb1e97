"""Pure logic of the weight channel: meta records, chunk headers, digests, in-order assembly.

No sockets here. A *version* is one byte payload, a safetensors file image (its layout:
:mod:`.layout`). Beside the payload, a small *meta* record (msgpack: version, publisher id,
sizes, publish time, digest algorithm) travels in chunk 0. On the wire a version is ``n_chunks`` multipart messages
``[b"w", header, payload_chunk]``; every chunk header carries the digest of its own bytes (chunk 0's
covers the meta record too), so both sides hash chunks in parallel, off the sending/receiving path.

:class:`Assembler` rebuilds versions from an in-order chunk stream (PUB/SUB and DEALER/ROUTER keep
order), so any gap means the version is lost: it is discarded, never half-built.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from streamgrpo.metrics import ERRORS
from streamgrpo.transport.weights.layout import (
    TensorEntry,
    WeightsFormatError,
    parse_layout,
    unpack_tensors,
)

try:  # xxhash ships with `datasets`; sha256 is the (much slower) fallback.
    import xxhash
except ImportError:  # pragma: no cover - exercised only without xxhash
    xxhash = None

log = logging.getLogger("streamgrpo.transport.weights")

FORMAT = 2
TOPIC = b"w"  # version chunks: [TOPIC, header, payload]
TOPIC_BEAT = b"h"  # heartbeat: [TOPIC_BEAT, msgpack {"s": src, "v": latest complete version}]
TOPIC_DELTA = b"d"  # a version as a delta to the previous one: [TOPIC_DELTA, header, delta payload chunk]
BEAT_S = 1.0  # heartbeat period (also sent right after each version)
ALGOS: dict[str, Callable] = {"sha256": hashlib.sha256}
if xxhash is not None:
    ALGOS["xxh3_128"] = xxhash.xxh3_128
DEFAULT_ALGO = "xxh3_128" if xxhash is not None else "sha256"


def default_hash_threads() -> int:
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def report_error(msg: str) -> None:
    """Count a weight-channel error (``streamgrpo_errors_total{kind="weights"}``) and log it."""
    ERRORS.labels(kind="weights").inc()
    log.warning("%s", msg)


# --------------------------------------------------------------------------------------- meta
@dataclass(frozen=True)
class VersionMeta:
    """Everything about a version except its bytes (the tensor table is in the payload); chunk 0 carries it."""

    version: int
    src: int
    nbytes: int
    chunk_bytes: int
    n_chunks: int
    published_at: float
    algo: str


def n_chunks_for(nbytes: int, chunk_bytes: int) -> int:
    return max(1, math.ceil(nbytes / chunk_bytes))


def chunk_span(meta: VersionMeta, seq: int) -> tuple[int, int]:
    """(start, end) byte range of chunk ``seq``."""
    start = seq * meta.chunk_bytes
    return start, min(meta.nbytes, start + meta.chunk_bytes)


def encode_meta(meta: VersionMeta) -> bytes:
    return msgpack.packb({"fmt": FORMAT, "version": meta.version, "src": meta.src, "nbytes": meta.nbytes,
                          "chunk": meta.chunk_bytes, "n": meta.n_chunks, "ts": meta.published_at, "algo": meta.algo},
                         use_bin_type=True)


def _int(d: Mapping, key: str, where: str, lo: int = 0) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise WeightsFormatError(f"{where}: field {key!r} = {v!r} is not an integer >= {lo}")
    return v


def decode_meta(raw: bytes) -> VersionMeta:
    """Parse and validate a meta record (sizes consistent, digest algorithm known)."""
    try:
        d = msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise WeightsFormatError(f"weights meta: not msgpack ({exc})") from None
    if not isinstance(d, dict) or d.get("fmt") != FORMAT:
        raise WeightsFormatError(f"weights meta: unknown format {d.get('fmt') if isinstance(d, dict) else d!r}")
    version, src = _int(d, "version", "weights meta"), _int(d, "src", "weights meta")
    nbytes, chunk = _int(d, "nbytes", "weights meta"), _int(d, "chunk", "weights meta", lo=1)
    n = _int(d, "n", "weights meta", lo=1)
    if n != n_chunks_for(nbytes, chunk):
        raise WeightsFormatError(f"weights meta v{version}: n_chunks {n} does not fit {nbytes} bytes in chunks of {chunk}")
    algo, ts = d.get("algo"), d.get("ts")
    if algo not in ALGOS:
        raise WeightsFormatError(f"weights meta v{version}: digest algorithm {algo!r} not one of {sorted(ALGOS)}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise WeightsFormatError(f"weights meta v{version}: publish time {ts!r} is not a number")
    return VersionMeta(version, src, nbytes, chunk, n, float(ts), algo)


@dataclass(frozen=True)
class DeltaInfo:
    """What a delta's meta record adds: the version it applies to, and the full version it makes (its meta
    record and chunk digests, checked after applying)."""

    base: int
    full: VersionMeta
    full_meta: bytes
    digests: list[bytes]


def encode_delta_meta(meta: VersionMeta, base: int, full_meta: bytes, digests: list[bytes]) -> bytes:
    """The meta record of a delta payload: a version meta (its sizes are the delta's) plus ``delta``."""
    d = msgpack.unpackb(encode_meta(meta), raw=False)
    d["delta"] = {"base": base, "full": full_meta, "digests": list(digests)}
    return msgpack.packb(d, use_bin_type=True)


def decode_delta_meta(raw: bytes) -> DeltaInfo:
    """The ``delta`` part of a delta's meta record, validated against the full version it describes."""
    d = unpack_map(raw, "weights delta meta")
    delta = d.get("delta")
    if not isinstance(delta, dict):
        raise WeightsFormatError("weights delta meta: no 'delta' map")
    base = _int(delta, "base", "weights delta meta")
    full_meta, digests = delta.get("full"), delta.get("digests")
    if not isinstance(full_meta, bytes):
        raise WeightsFormatError("weights delta meta: no full meta record")
    full = decode_meta(full_meta)
    if full.version != d.get("version") or full.src != d.get("src") or base >= full.version:
        raise WeightsFormatError(f"weights delta meta: v{base} -> v{full.version} does not fit its header")
    if (not isinstance(digests, list) or len(digests) != full.n_chunks
            or not all(isinstance(x, bytes) for x in digests)):
        raise WeightsFormatError(f"weights delta meta v{full.version}: needs {full.n_chunks} chunk digests")
    return DeltaInfo(base, full, full_meta, digests)


# ------------------------------------------------------------------------------------ headers
@dataclass(frozen=True)
class ChunkHeader:
    version: int
    src: int
    seq: int
    n_chunks: int
    offset: int
    size: int
    digest: bytes  # of this chunk's bytes (chunk 0: of meta bytes + its bytes)
    meta: bytes | None = None  # chunk 0 only
    req: int | None = None  # snapshot replies: the request id


def encode_header(h: ChunkHeader) -> bytes:
    d = {"v": h.version, "s": h.src, "q": h.seq, "n": h.n_chunks, "o": h.offset, "l": h.size, "d": h.digest}
    if h.meta is not None:
        d["m"] = h.meta
    if h.req is not None:
        d["r"] = h.req
    return msgpack.packb(d, use_bin_type=True)


def unpack_map(raw: bytes, where: str) -> dict:
    """A msgpack map from untrusted bytes, or WeightsFormatError naming ``where``."""
    try:
        d = msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise WeightsFormatError(f"{where}: not msgpack ({exc})") from None
    if not isinstance(d, dict):
        raise WeightsFormatError(f"{where}: not a map")
    return d


def decode_header(raw: bytes) -> ChunkHeader:
    where = "weights chunk header"
    d = unpack_map(raw, where)
    v, s, q = _int(d, "v", where), _int(d, "s", where), _int(d, "q", where)
    n, o, size = _int(d, "n", where, lo=1), _int(d, "o", where), _int(d, "l", where)
    meta, digest, req = d.get("m"), d.get("d"), d.get("r")
    if q >= n:
        raise WeightsFormatError(f"{where} v{v}: seq {q} >= n_chunks {n}")
    if (q == 0) != isinstance(meta, bytes):
        raise WeightsFormatError(f"{where} v{v} seq {q}: meta must travel with chunk 0 exactly")
    if not isinstance(digest, bytes):
        raise WeightsFormatError(f"{where} v{v} seq {q}: no chunk digest")
    if req is not None and (not isinstance(req, int) or isinstance(req, bool)):
        raise WeightsFormatError(f"{where} v{v}: request id {req!r} is not an integer")
    return ChunkHeader(v, s, q, n, o, size, digest, meta, req)


def make_header(meta: VersionMeta, seq: int, meta_bytes: bytes, digest: bytes, req: int | None = None) -> ChunkHeader:
    start, end = chunk_span(meta, seq)
    return ChunkHeader(meta.version, meta.src, seq, meta.n_chunks, start, end - start, digest,
                       meta_bytes if seq == 0 else None, req)


def chunk_digest(algo: str, chunk, meta_bytes: bytes | None = None) -> bytes:
    """Digest of one chunk (xxh3 releases the GIL: chunks hash in parallel threads)."""
    h = ALGOS[algo]()
    if meta_bytes is not None:
        h.update(meta_bytes)
    h.update(chunk)
    return h.digest()


# ---------------------------------------------------------------------------------- assembly
@dataclass
class Completed:
    """A whole, digest-verified version: its meta, tensor table and payload buffer (uint8 tensor)."""

    meta: VersionMeta
    buf_N: torch.Tensor
    entries: list[TensorEntry] = field(default_factory=list)
    raw_meta: bytes = b""  # the meta record as sent (a delta's carries its DeltaInfo)

    def tensors(self) -> dict[str, torch.Tensor]:
        return unpack_tensors(self.buf_N, self.entries)


@dataclass
class _Partial:
    meta: VersionMeta
    meta_bytes: bytes
    buf_N: torch.Tensor
    next_seq: int = 0
    checks: list = field(default_factory=list)  # per chunk: Future or bool (digest matched)

    def __post_init__(self) -> None:
        self.array_N = self.buf_N.numpy()


def key_of(h: ChunkHeader | VersionMeta) -> tuple[int, int]:
    """Identity of a version: (publisher id, version number)."""
    return (h.src, h.version)


def newer(a, b) -> bool:
    """``a`` supersedes ``b`` (metas, headers or keys): a higher version, or any version of a different
    (restarted) publisher; anything supersedes None."""
    if b is None:
        return True
    ka = a if isinstance(a, tuple) else key_of(a)
    kb = b if isinstance(b, tuple) else key_of(b)
    return ka[0] != kb[0] or ka[1] > kb[1]


def _copy_and_check(dst: np.ndarray, payload, algo: str, digest: bytes, meta_bytes: bytes | None) -> bool:
    src = np.frombuffer(payload, dtype=np.uint8)
    np.copyto(dst, src)  # numpy drops the GIL for the copy, xxh3 for the hash
    return chunk_digest(algo, src, meta_bytes) == digest


class Assembler:
    """Rebuilds versions from an in-order chunk stream. ``feed`` returns ``(completed, dropped)``.

    ``dropped`` is a one-line reason when a version was discarded (gap, bad size, digest mismatch,
    malformed meta or tensor table, superseded while incomplete); each version is reported at most
    once, and the rest of a broken version's chunks are ignored silently. ``alloc(nbytes)`` gives
    the buffer of a new version (a CPU uint8 tensor); ``release(buf)`` takes back the buffer of a
    dropped one. With an ``executor`` each chunk is copied and hashed in a worker thread (the chunk's
    frame must stay valid until then: pyzmq frames do), and digests are checked when the last chunk
    is in.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor], release: Callable[[torch.Tensor], None] | None = None,
                 executor: Executor | None = None, tensor_table: bool = True):
        self._tensor_table = tensor_table  # False: payloads that are not safetensors images (deltas)
        self._alloc = alloc
        self._release = release or (lambda buf: None)
        self._executor = executor
        self._cur: _Partial | None = None
        self._broken: tuple[int, int] | None = None

    @property
    def in_progress(self) -> tuple[tuple[int, int], int] | None:
        """``((src, version), next_seq)`` of the version being built, if any."""
        return (key_of(self._cur.meta), self._cur.next_seq) if self._cur is not None else None

    def last_chunk_ok(self) -> bool:
        """Whether the last chunk fed to the version being built matched its digest (without an executor,
        known at once; with one, True until the version completes)."""
        last = self._cur.checks[-1] if self._cur is not None and self._cur.checks else True
        return last if isinstance(last, bool) else True

    def reset(self) -> None:
        """Forget the version being built without reporting it (its buffer is released)."""
        if self._cur is not None:
            self._settle(self._cur)
            self._release(self._cur.buf_N)
        self._cur = None

    @staticmethod
    def _settle(cur: _Partial) -> list[bool]:
        """Wait for the chunk copies in flight (a buffer is never released while a worker writes to it)."""
        return [c.result() if isinstance(c, Future) else c for c in cur.checks]

    def _fail(self, key: tuple[int, int], reason: str) -> str:
        self.reset()
        self._broken = key
        return f"weights version {key[1]}: {reason}"

    def feed(self, h: ChunkHeader, payload) -> tuple[Completed | None, str | None]:
        key = key_of(h)
        note = None
        if h.seq == 0:
            if self._cur is not None:
                c = self._cur
                note = f"weights version {c.meta.version}: incomplete ({c.next_seq}/{c.meta.n_chunks} chunks), discarded"
                self.reset()
            self._broken = None
            try:
                meta = decode_meta(h.meta)
            except WeightsFormatError as exc:
                return None, _join(note, self._fail(key, f"malformed meta ({exc})"))
            if key_of(meta) != key or meta.n_chunks != h.n_chunks:
                return None, _join(note, self._fail(key, "chunk 0 header disagrees with its meta record"))
            try:
                buf = self._alloc(meta.nbytes)
            except (RuntimeError, MemoryError, ValueError) as exc:  # e.g. a meta record asking for absurd sizes
                return None, _join(note, self._fail(key, f"cannot allocate {meta.nbytes} bytes ({exc})"))
            self._cur = _Partial(meta, h.meta, buf)
        elif self._broken == key:
            return None, None
        elif self._cur is None or key_of(self._cur.meta) != key:
            return None, self._fail(key, f"chunk {h.seq}/{h.n_chunks} arrived without the start of its version")
        elif h.seq != self._cur.next_seq:
            return None, self._fail(key, f"missing chunks {self._cur.next_seq}..{h.seq - 1} of {h.n_chunks}")
        done, why = self._process(h, payload)
        return done, _join(note, why)

    def _process(self, h: ChunkHeader, payload) -> tuple[Completed | None, str | None]:
        cur = self._cur
        assert cur is not None
        meta = cur.meta
        mv = memoryview(payload).cast("B")
        start, end = chunk_span(meta, h.seq)
        if h.n_chunks != meta.n_chunks or h.offset != start or h.size != end - start or len(mv) != end - start:
            return None, self._fail(
                key_of(h), f"chunk {h.seq} has {len(mv)} bytes at offset {h.offset}, expected {end - start} at {start}"
            )
        args = (cur.array_N[start:end], mv, meta.algo, h.digest, cur.meta_bytes if h.seq == 0 else None)
        cur.checks.append(self._executor.submit(_copy_and_check, *args) if self._executor else _copy_and_check(*args))
        cur.next_seq += 1
        if cur.next_seq < meta.n_chunks:
            return None, None
        bad = [i for i, ok in enumerate(self._settle(cur)) if not ok]
        if bad:
            return None, self._fail(key_of(h), f"digest mismatch ({meta.algo}) in chunk {bad[0]}: payload corrupt or "
                                               "tampered, discarded")
        try:
            entries = parse_layout(cur.buf_N) if self._tensor_table else []
        except WeightsFormatError as exc:
            return None, self._fail(key_of(h), f"malformed tensor table ({exc})")
        self._cur = None
        return Completed(meta, cur.buf_N, entries, cur.meta_bytes), None


def _join(a: str | None, b: str | None) -> str | None:
    return "; ".join(x for x in (a, b) if x) or None


def select_chunks(headers: list[ChunkHeader], in_progress: tuple[tuple[int, int], int] | None) -> list[int]:
    """Indices of a drained, in-order batch worth assembling: skip versions a newer one supersedes.

    Keeps the newest version that is complete within the batch (or completes the one in progress,
    ``in_progress = ((src, version), next_seq)``) and everything after it (the newest version still
    arriving). Skipped versions cost nothing: no copy, no hashing.
    """
    segments: list[tuple[int, int]] = []  # [start, end) index ranges of one version each
    for i, h in enumerate(headers):
        if i == 0 or h.seq == 0 or key_of(h) != key_of(headers[i - 1]):
            segments.append((i, i + 1))
        else:
            segments[-1] = (segments[-1][0], i + 1)

    def complete(seg: tuple[int, int]) -> bool:
        first = headers[seg[0]]
        expect = 0
        if first.seq != 0 and in_progress is not None and seg[0] == 0 and in_progress[0] == key_of(first):
            expect = in_progress[1]
        for j in range(seg[0], seg[1]):
            if headers[j].seq != expect:
                return False
            expect += 1
        return expect == first.n_chunks

    keep_from = 0
    for seg in reversed(segments):
        if complete(seg):
            keep_from = seg[0]
            break
    else:
        keep_from = segments[-1][0] if segments else 0
    return list(range(keep_from, len(headers)))
