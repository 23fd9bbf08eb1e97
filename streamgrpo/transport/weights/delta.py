"""Lossless deltas between two weight versions (pure; numpy only).

Between two RL steps at typical learning rates most bfloat16 weights do not change: an update of
~1e-6 is far below half a bf16 step of a typical weight. A *delta* is the list of the 16-bit words of
the payload (the safetensors image, header included) that differ from the previous version's, as
positions and new values; applying it to the previous payload gives the new one bit for bit. It is
dtype-agnostic (a float32 tensor's changes are 16-bit word changes too) and needs both payloads to
have the same length (a changed tensor table is sent whole).

Byte layout (little-endian)::

    b"SGD1" | u64 nbytes (the full payload) | u64 n_changed | u64 len(gaps)
    gaps:   n_changed unsigned LEB128 varints, each (index - previous index - 1), the first from -1
    values: n_changed x u16, the new words in index order
    tail:   the payload's last byte when nbytes is odd (always sent)

Positions cost ~1 byte each at the ~1% of words that change per step (a gap below 128 words), values
2 bytes: ~3 bytes per changed word against 2 bytes per word of the full version.
"""

from __future__ import annotations

import struct

import numpy as np

from streamgrpo.transport.weights.layout import WeightsFormatError

MAGIC = b"SGD1"
_HEAD = struct.Struct("<4sQQQ")
BLOCK_WORDS = 1 << 24
_LANE_SHIFTS = np.array([0, 16, 32, 48], np.uint64)  # words compared at a time (32 MiB of each payload): bounds the temporaries


def _words(buf: np.ndarray) -> np.ndarray:
    return buf[: buf.size // 2 * 2].view("<u2")


def _changed_block(a: np.ndarray, b: np.ndarray, start: int, end: int) -> np.ndarray:
    """Changed word indices in words [start, end) (``start`` a multiple of 4): compared 64 bits at a time,
    then the 4 words of each differing 64-bit lane (its XOR read back as 4 little-endian words)."""
    n4 = (end - start) // 4 * 4
    a4 = a[start:start + n4].view("<u8")
    b4 = b[start:start + n4].view("<u8")
    lanes = np.flatnonzero(a4 != b4)
    x = (a4[lanes] ^ b4[lanes]).view("<u2")  # word k of lane i at 4 i + k
    hit = np.flatnonzero(x)
    found = start + lanes[hit >> 2] * 4 + (hit & 3)
    rest = np.flatnonzero(a[start + n4:end] != b[start + n4:end]) + start + n4
    return np.concatenate((found, rest)) if rest.size else found


def changed_words(prev: np.ndarray, cur: np.ndarray, block: int = BLOCK_WORDS, executor=None) -> np.ndarray:
    """Indices (int64, increasing) of the 16-bit words where ``cur`` differs from ``prev`` (uint8 arrays of
    one length); blocks in parallel on ``executor`` (numpy drops the GIL while it compares)."""
    a, b = _words(prev), _words(cur)
    spans = [(i, min(i + block, a.size)) for i in range(0, a.size, block)]
    if executor is not None and len(spans) > 1:
        parts = list(executor.map(lambda s: _changed_block(a, b, *s), spans))
    else:
        parts = [_changed_block(a, b, *s) for s in spans]
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.empty(0, np.int64)


def varint_encode(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 of each value (uint64 array) -> uint8 array, vectorised."""
    v = values.astype(np.uint64, copy=False)
    n = np.ones(v.size, np.int64)
    for k in range(1, 10):
        n += v >= np.uint64(1 << (7 * k))
    out = np.empty(int(n.sum()), np.uint8)
    starts = np.cumsum(n) - n
    for k in range(int(n.max()) if n.size else 0):
        sel = np.flatnonzero(n > k)
        byte = ((v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        out[starts[sel] + k] = byte | ((n[sel] > k + 1).astype(np.uint8) << 7)
    return out


def varint_decode(data: np.ndarray, count: int) -> np.ndarray:
    """``count`` unsigned LEB128 values from ``data`` (uint8), which must hold exactly them."""
    if data.size == 0:
        if count:
            raise WeightsFormatError(f"weights delta: {count} positions announced, none sent")
        return np.empty(0, np.uint64)
    ends = (data & 0x80) == 0
    if int(ends.sum()) != count or not ends[-1]:
        raise WeightsFormatError(f"weights delta: the position list does not hold {count} whole varints")
    group = np.cumsum(ends) - ends  # the value each byte belongs to
    first = np.flatnonzero(np.concatenate(([True], ends[:-1])))  # each value's first byte
    pos = np.arange(data.size) - first[group]
    if pos.max() > 9:
        raise WeightsFormatError("weights delta: a position varint is longer than 10 bytes")
    out = np.zeros(count, np.uint64)
    low = (data & 0x7F).astype(np.uint64)
    for k in range(int(pos.max()) + 1):
        sel = pos == k
        out[group[sel]] |= low[sel] << np.uint64(7 * k)
    return out


def _encode_block(a: np.ndarray, b: np.ndarray, start: int, end: int):
    """One block's part of a delta from words ``a`` to words ``b``: (changed words, first index, last
    index, varints of the gaps inside the block, the new values)."""
    idx = _changed_block(a, b, start, end)
    if idx.size == 0:
        return 0, -1, -1, b"", b""
    inner = varint_encode((np.diff(idx) - 1).astype(np.uint64))
    return idx.size, int(idx[0]), int(idx[-1]), inner.tobytes(), b[idx].astype("<u2", copy=False).tobytes()


def encode_delta(prev: np.ndarray, cur: np.ndarray, executor=None, max_bytes: int | None = None) -> bytes | None:
    """The delta turning payload ``prev`` into ``cur`` (uint8 arrays of one length), block by block (memory:
    a few blocks' temporaries and the delta itself); None as soon as it would exceed ``max_bytes``."""
    if prev.size != cur.size:
        raise ValueError(f"weights delta: payloads of {prev.size} and {cur.size} bytes (a delta needs one layout)")
    a, b = _words(prev), _words(cur)
    spans = [(i, min(i + BLOCK_WORDS, a.size)) for i in range(0, a.size, BLOCK_WORDS)]
    window = 2 * max(1, getattr(executor, "_max_workers", 1)) if executor is not None else 1
    pos: list[bytes] = []
    vals: list[bytes] = []
    count, last, size = 0, -1, _HEAD.size + cur.size % 2
    for w in range(0, len(spans), window):
        batch = spans[w:w + window]
        parts = (list(executor.map(lambda sp: _encode_block(a, b, *sp), batch)) if executor is not None
                 else [_encode_block(a, b, *sp) for sp in batch])
        for n, first, end_idx, inner, values in parts:
            if n == 0:
                continue
            head = varint_encode(np.array([first - last - 1], np.uint64)).tobytes()
            pos += [head, inner]
            vals.append(values)
            count, last = count + n, end_idx
            size += len(head) + len(inner) + len(values)
        if max_bytes is not None and size > max_bytes:
            return None
    npos = sum(len(x) for x in pos)
    tail = cur[-1:].tobytes() if cur.size % 2 else b""
    return b"".join([_HEAD.pack(MAGIC, cur.size, count, npos), *pos, *vals, tail])


def delta_size(raw) -> tuple[int, int]:
    """(full payload bytes, changed words) of a delta, from its head (validated)."""
    mv = memoryview(raw).cast("B")
    if len(mv) < _HEAD.size:
        raise WeightsFormatError(f"weights delta: {len(mv)} bytes, shorter than its {_HEAD.size}-byte head")
    magic, nbytes, n_changed, n_pos = _HEAD.unpack_from(mv)
    if magic != MAGIC:
        raise WeightsFormatError(f"weights delta: magic {magic!r}, expected {MAGIC!r}")
    if len(mv) != _HEAD.size + n_pos + 2 * n_changed + nbytes % 2:
        raise WeightsFormatError(f"weights delta: {len(mv)} bytes, its head announces "
                                 f"{_HEAD.size + n_pos + 2 * n_changed + nbytes % 2}")
    if n_changed > nbytes // 2:
        raise WeightsFormatError(f"weights delta: {n_changed} changed words in a {nbytes}-byte payload")
    return nbytes, n_changed


def _positions(data: np.ndarray, count: int, words: int, window: int):
    """The changed word indices of a delta's position varints, window by window (each an int64 array,
    increasing); raises WeightsFormatError for a list that does not hold ``count`` positions inside
    ``words``."""
    if data.size and (data[-1] & 0x80):
        raise WeightsFormatError(f"weights delta: the position list does not hold {count} whole varints")
    cursor, seen, last = 0, 0, -1
    while cursor < data.size:
        win = data[cursor:cursor + window]
        ends = np.flatnonzero((win & 0x80) == 0)
        if ends.size == 0:
            raise WeightsFormatError("weights delta: a position varint is longer than 10 bytes")
        cut = int(ends[-1]) + 1
        gaps = varint_decode(win[:cut], ends.size)
        if seen + ends.size > count:
            raise WeightsFormatError(f"weights delta: the position list does not hold {count} whole varints")
        if int(gaps.max()) >= words:
            raise WeightsFormatError(f"weights delta: a position gap of {int(gaps.max())} words in a {words}-word payload")
        idx = last + np.cumsum(gaps.astype(np.int64) + 1)
        if int(idx[-1]) >= words or int(idx[0]) < 0 or (idx.size > 1 and int(np.diff(idx).min()) < 1):
            raise WeightsFormatError(f"weights delta: positions run past the payload's {words} words")
        yield idx
        cursor, seen, last = cursor + cut, seen + ends.size, int(idx[-1])
    if seen != count:
        raise WeightsFormatError(f"weights delta: the position list does not hold {count} whole varints")


def apply_delta(buf: np.ndarray, raw, window: int = 1 << 24) -> int:
    """Apply delta ``raw`` to payload ``buf`` (uint8, the base version; changed in place); returns the
    number of words changed. Positions are decoded ``window`` bytes at a time (memory: one window's
    arrays). A malformed delta raises WeightsFormatError; when its positions fit one window (up to ~16M
    changed words by default) ``buf`` is untouched then, else it may be partly changed (callers drop it)."""
    nbytes, n_changed = delta_size(raw)
    if buf.size != nbytes:
        raise WeightsFormatError(f"weights delta: for a {nbytes}-byte payload, the base has {buf.size}")
    data = np.frombuffer(raw, np.uint8)
    _, _, _, n_pos = _HEAD.unpack_from(data)
    pos = data[_HEAD.size:_HEAD.size + n_pos]
    if int(np.count_nonzero((pos & 0x80) == 0)) != n_changed:  # cheap, before any write
        raise WeightsFormatError(f"weights delta: the position list does not hold {n_changed} whole varints")
    values = data[_HEAD.size + n_pos:_HEAD.size + n_pos + 2 * n_changed].view("<u2")
    target, done = _words(buf), 0
    for idx in _positions(pos, n_changed, nbytes // 2, window):
        target[idx] = values[done:done + idx.size]
        done += idx.size
    if nbytes % 2:
        buf[-1] = data[-1]
    return n_changed
