"""Pure logic of the weight channel (design.md §4): layout, chunk headers, digest, in-order assembly.

No sockets here. A *version* is one flat byte payload holding every tensor (raw little-endian
bytes, bf16 as 2-byte words, each tensor at a 64-byte aligned offset) plus a *meta* record
(msgpack: version, publisher id, sizes, publish time, digest algorithm and the tensor table
name/dtype/shape/offset/nbytes). On the wire a version is ``n_chunks`` multipart messages
``[b"w", header, payload_chunk]``; the header (msgpack) carries version, publisher id ``src``,
``seq``, ``n_chunks``, the chunk's byte offset and size; chunk 0 also carries the meta bytes and
the last chunk the digest of ``meta_bytes || payload`` (xxh3-128, or sha256 without xxhash), so the
tensor table is covered by the digest and the publisher can hash while it sends.

:class:`Assembler` rebuilds versions from an in-order chunk stream (PUB/SUB and DEALER/ROUTER over
TCP keep order), so any gap means the version is lost: it is discarded, never half-built.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from streamgrpo.metrics import ERRORS

try:  # xxhash ships with `datasets`; sha256 is the (much slower) fallback.
    import xxhash
except ImportError:  # pragma: no cover - exercised only without xxhash
    xxhash = None

log = logging.getLogger("streamgrpo.transport.weights")

FORMAT = 1
TOPIC = b"w"  # version chunks: [TOPIC, header, payload]
TOPIC_BEAT = b"h"  # heartbeat: [TOPIC_BEAT, msgpack {"s": src, "v": latest complete version}]
BEAT_S = 1.0  # heartbeat period (also sent right after each version)
ALIGN = 64
ALGOS: dict[str, Callable] = {"sha256": hashlib.sha256}
if xxhash is not None:
    ALGOS["xxh3_128"] = xxhash.xxh3_128
DEFAULT_ALGO = "xxh3_128" if xxhash is not None else "sha256"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}


class WeightsFormatError(ValueError):
    """A header, meta record or tensor table is malformed (the message says which field)."""


def report_error(msg: str) -> None:
    """Count a weight-channel error (``streamgrpo_errors_total{kind="weights"}``) and log it."""
    ERRORS.labels(kind="weights").inc()
    log.warning("%s", msg)


# ------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: where its raw bytes sit in the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _align(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def plan_layout(named_tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Tensor table and payload size. Tensors that are the same memory (tied weights) share bytes.

    Raises ``TypeError`` naming the tensor for a dtype the wire does not carry.
    """
    entries: list[TensorEntry] = []
    seen: dict[tuple, int] = {}
    total = 0
    for name, t in named_tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"weights: tensor name {name!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        dname = DTYPE_NAMES.get(t.dtype)
        if dname is None:
            raise TypeError(f"weights: tensor {name!r} has dtype {t.dtype}, not one of {sorted(DTYPES)}")
        nbytes = t.numel() * t.element_size()
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if nbytes else None
        if key is not None and key in seen:
            offset = seen[key]
        else:
            offset = total
            total = _align(total + nbytes)
            if key is not None:
                seen[key] = offset
        entries.append(TensorEntry(name, dname, tuple(int(s) for s in t.shape), offset, nbytes))
    return entries, total


def pack_into(
    buf_N: torch.Tensor,
    named_tensors: Mapping[str, torch.Tensor],
    entries: list[TensorEntry],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Copy every tensor's raw bytes into the uint8 buffer at its offset (one copy per tensor).

    ``progress(n)`` is called as the payload's first ``n`` bytes become final (so a sender can
    start on them while later tensors are still being copied); it ends with ``len(buf_N)``.
    """
    done: set[int] = set()
    for e in entries:
        if e.nbytes == 0 or e.offset in done:
            continue
        done.add(e.offset)
        t = named_tensors[e.name].detach()
        src = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        buf_N[e.offset : e.offset + e.nbytes].copy_(src)
        if progress is not None:
            progress(e.offset + e.nbytes)
    if progress is not None:
        progress(buf_N.numel())


def unpack_tensors(buf_N: torch.Tensor, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """Views (no copies) of the tensors of a payload buffer."""
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        raw = buf_N[e.offset : e.offset + e.nbytes]
        out[e.name] = raw.view(DTYPES[e.dtype]).reshape(e.shape)
    return out


# --------------------------------------------------------------------------------------- meta
@dataclass(frozen=True)
class VersionMeta:
    """Everything about a version except its bytes; travels packed in chunk 0."""

    version: int
    src: int
    nbytes: int
    chunk_bytes: int
    n_chunks: int
    published_at: float
    algo: str
    tensors: list[TensorEntry] = field(default_factory=list)


def n_chunks_for(nbytes: int, chunk_bytes: int) -> int:
    return max(1, math.ceil(nbytes / chunk_bytes))


def chunk_span(meta: VersionMeta, seq: int) -> tuple[int, int]:
    """(start, end) byte range of chunk ``seq``."""
    start = seq * meta.chunk_bytes
    return start, min(meta.nbytes, start + meta.chunk_bytes)


def encode_meta(meta: VersionMeta) -> bytes:
    return msgpack.packb(
        {
            "fmt": FORMAT,
            "version": meta.version,
            "src": meta.src,
            "nbytes": meta.nbytes,
            "chunk": meta.chunk_bytes,
            "n": meta.n_chunks,
            "ts": meta.published_at,
            "algo": meta.algo,
            "tensors": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in meta.tensors],
        },
        use_bin_type=True,
    )


def _int(d: Mapping, key: str, where: str, lo: int = 0) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise WeightsFormatError(f"{where}: field {key!r} = {v!r} is not an integer >= {lo}")
    return v


def decode_meta(raw: bytes) -> VersionMeta:
    """Parse and validate a meta record (every tensor inside the payload, sizes consistent)."""
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
    if not isinstance(ts, (int, float)):
        raise WeightsFormatError(f"weights meta v{version}: publish time {ts!r} is not a number")
    table = d.get("tensors")
    if not isinstance(table, list):
        raise WeightsFormatError(f"weights meta v{version}: tensor table missing")
    entries = []
    for row in table:
        if not (isinstance(row, list) and len(row) == 5):
            raise WeightsFormatError(f"weights meta v{version}: bad tensor row {row!r}")
        name, dtype, shape, offset, size = row
        where = f"weights meta v{version} tensor {name!r}"
        if not isinstance(name, str) or dtype not in DTYPES:
            raise WeightsFormatError(f"{where}: bad name or dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise WeightsFormatError(f"{where}: bad shape {shape!r}")
        itemsize = ITEMSIZE[dtype]
        if not isinstance(offset, int) or not isinstance(size, int) or size != math.prod(shape) * itemsize:
            raise WeightsFormatError(f"{where}: size {size!r} does not match shape {shape} x {itemsize} bytes")
        if offset < 0 or offset % ALIGN or offset + size > nbytes:
            raise WeightsFormatError(f"{where}: bytes [{offset}, {offset}+{size}) outside payload of {nbytes}")
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, size))
    return VersionMeta(version, src, nbytes, chunk, n, float(ts), algo, entries)


# ------------------------------------------------------------------------------------ headers
@dataclass(frozen=True)
class ChunkHeader:
    version: int
    src: int
    seq: int
    n_chunks: int
    offset: int
    size: int
    meta: bytes | None = None  # chunk 0 only
    digest: bytes | None = None  # last chunk only
    req: int | None = None  # snapshot replies: the request id


def encode_header(h: ChunkHeader) -> bytes:
    d = {"v": h.version, "s": h.src, "q": h.seq, "n": h.n_chunks, "o": h.offset, "l": h.size}
    if h.meta is not None:
        d["m"] = h.meta
    if h.digest is not None:
        d["d"] = h.digest
    if h.req is not None:
        d["r"] = h.req
    return msgpack.packb(d, use_bin_type=True)


def decode_header(raw: bytes) -> ChunkHeader:
    try:
        d = msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise WeightsFormatError(f"weights chunk header: not msgpack ({exc})") from None
    if not isinstance(d, dict):
        raise WeightsFormatError("weights chunk header: not a map")
    where = "weights chunk header"
    v, s, q = _int(d, "v", where), _int(d, "s", where), _int(d, "q", where)
    n, o, size = _int(d, "n", where, lo=1), _int(d, "o", where), _int(d, "l", where)
    meta, digest, req = d.get("m"), d.get("d"), d.get("r")
    if q >= n:
        raise WeightsFormatError(f"{where} v{v}: seq {q} >= n_chunks {n}")
    if (q == 0) != isinstance(meta, bytes):
        raise WeightsFormatError(f"{where} v{v} seq {q}: meta must travel with chunk 0 exactly")
    if (q == n - 1) != isinstance(digest, bytes):
        raise WeightsFormatError(f"{where} v{v} seq {q}: digest must travel with the last chunk exactly")
    if req is not None and not isinstance(req, int):
        raise WeightsFormatError(f"{where} v{v}: request id {req!r} is not an integer")
    return ChunkHeader(v, s, q, n, o, size, meta, digest, req)


def make_header(meta: VersionMeta, seq: int, meta_bytes: bytes, digest: bytes | None, req: int | None = None) -> ChunkHeader:
    start, end = chunk_span(meta, seq)
    last = seq == meta.n_chunks - 1
    return ChunkHeader(
        meta.version, meta.src, seq, meta.n_chunks, start, end - start,
        meta_bytes if seq == 0 else None, digest if last else None, req,
    )


def new_hasher(algo: str):
    return ALGOS[algo]()


def payload_digest(meta_bytes: bytes, payload, algo: str = DEFAULT_ALGO) -> bytes:
    h = new_hasher(algo)
    h.update(meta_bytes)
    h.update(payload)
    return h.digest()


def build_version(
    version: int, named_tensors: Mapping[str, torch.Tensor], chunk_bytes: int, src: int = 0,
    published_at: float = 0.0, algo: str = DEFAULT_ALGO,
) -> tuple[VersionMeta, bytes, torch.Tensor]:
    """(meta, meta_bytes, payload) of a version, in one go (the publisher does the same in steps)."""
    entries, nbytes = plan_layout(named_tensors)
    buf_N = torch.empty(nbytes, dtype=torch.uint8)
    pack_into(buf_N, named_tensors, entries)
    meta = VersionMeta(version, src, nbytes, chunk_bytes, n_chunks_for(nbytes, chunk_bytes), published_at, algo, entries)
    return meta, encode_meta(meta), buf_N


def iter_chunks(meta: VersionMeta, meta_bytes: bytes, buf_N: torch.Tensor, req: int | None = None):
    """Yield ``(header, payload)`` per chunk, hashing as it goes (the digest rides on the last one)."""
    mv = memoryview(buf_N.numpy())
    hasher = new_hasher(meta.algo)
    hasher.update(meta_bytes)
    for seq in range(meta.n_chunks):
        start, end = chunk_span(meta, seq)
        hasher.update(mv[start:end])
        digest = hasher.digest() if seq == meta.n_chunks - 1 else None
        yield make_header(meta, seq, meta_bytes, digest, req), mv[start:end]


# ---------------------------------------------------------------------------------- assembly
@dataclass
class Completed:
    """A whole, digest-verified version: its meta and its payload buffer (uint8 tensor)."""

    meta: VersionMeta
    buf_N: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return unpack_tensors(self.buf_N, self.meta.tensors)


@dataclass
class _Partial:
    meta: VersionMeta
    buf_N: torch.Tensor
    hasher: object
    next_seq: int = 0

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


def endpoint(host: str, port: int | str) -> str:
    """ZeroMQ TCP endpoint; IPv6 hosts get brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Assembler:
    """Rebuilds versions from an in-order chunk stream. ``feed`` returns ``(completed, dropped)``.

    ``dropped`` is a one-line reason when a version was discarded (gap, bad size, digest mismatch,
    malformed meta, superseded while incomplete); each version is reported at most once, and the
    rest of a broken version's chunks are ignored silently. ``alloc(nbytes)`` gives the buffer of
    a new version (a CPU uint8 tensor); ``release(buf)`` takes back the buffer of a dropped one.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor], release: Callable[[torch.Tensor], None] | None = None):
        self._alloc = alloc
        self._release = release or (lambda buf: None)
        self._cur: _Partial | None = None
        self._broken: tuple[int, int] | None = None

    @property
    def in_progress(self) -> tuple[tuple[int, int], int] | None:
        """``((src, version), next_seq)`` of the version being built, if any."""
        return (key_of(self._cur.meta), self._cur.next_seq) if self._cur is not None else None

    def reset(self) -> None:
        """Forget the version being built without reporting it (its buffer is released)."""
        if self._cur is not None:
            self._release(self._cur.buf_N)
        self._cur = None

    def _fail(self, key: tuple[int, int], reason: str) -> str:
        if self._cur is not None:
            self._release(self._cur.buf_N)
        self._cur = None
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
            hasher = new_hasher(meta.algo)
            hasher.update(h.meta)
            self._cur = _Partial(meta, self._alloc(meta.nbytes), hasher)
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
        if len(mv):
            np.copyto(cur.array_N[start:end], np.frombuffer(mv, dtype=np.uint8))
            cur.hasher.update(mv)
        cur.next_seq += 1
        if cur.next_seq < meta.n_chunks:
            return None, None
        if cur.hasher.digest() != h.digest:
            return None, self._fail(key_of(h), f"digest mismatch ({meta.algo}): payload corrupt or tampered, discarded")
        self._cur = None
        return Completed(meta, cur.buf_N), None


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
