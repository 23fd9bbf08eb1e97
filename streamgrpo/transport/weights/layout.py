"""The payload of a weight version: a safetensors file image, planned, written and parsed (pure).

::

    u64 header length | JSON header (padded with spaces) | tensor bytes

The JSON header maps each tensor name to ``{"dtype": "BF16", "shape": [...], "data_offsets": [b, e]}``
(the safetensors format, dtype codes from :mod:`streamgrpo.wire.dtypes`); tensor bytes are ordered by
element size (largest first) so every tensor is aligned to its element size, and the data starts at
a multiple of 64 bytes. Tied tensors (the same memory under two names) travel once; the other names
are listed in ``__metadata__["streamgrpo.aliases"]``. So a received version can be written to disk
and opened with ``safetensors`` as it is.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from streamgrpo.wire import dtypes

ALIGN = 64  # the data section starts at a multiple of this
ALIASES_KEY = "streamgrpo.aliases"
_LEN = struct.Struct("<Q")


class WeightsFormatError(ValueError):
    """A header, meta record or tensor table is malformed (the message says which field)."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be sent, known by its name, shape and dtype before its bytes exist (ZeRO-3)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    share: tuple | None = None  # same key = same bytes (tied weights): sent once


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: where its raw bytes sit in the payload (absolute offset)."""

    name: str
    dtype: str  # table name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Where every tensor goes: ``entries`` in the caller's order, ``data`` the distinct ones in byte order."""

    entries: list[TensorEntry]
    data: list[TensorEntry]
    header: bytes  # u64 length + JSON, padded: payload[:len(header)]
    nbytes: int


def specs_of(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """Specs of live tensors; floating tensors become ``dtype`` when given (e.g. fp32 master -> bf16).

    Raises ``TypeError`` naming the tensor for a name that is not a string, a non-tensor, or a dtype
    the payload cannot carry.
    """
    out = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"weights: tensor name {name!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        row = dtypes.of_torch(t.dtype)
        if row is None or row.st is None:
            carried = sorted(d.name for d in dtypes.TABLE if d.st is not None)
            raise TypeError(f"weights: tensor {name!r} has dtype {t.dtype}, not one of {carried}")
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        share = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape),
                 tuple(t.stride())) if t.numel() else None
        out.append(TensorSpec(name, tuple(int(s) for s in t.shape), target, share))
    return out


def plan_layout(specs: Sequence[TensorSpec]) -> Layout:
    """The safetensors image of ``specs``: header bytes, tensor offsets, total size."""
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    distinct: list[TensorSpec] = []
    for s in specs:
        key = None if s.share is None else (s.share, s.dtype)
        if key is not None and key in first:
            aliases[s.name] = first[key]
            continue
        if key is not None:
            first[key] = s.name
        distinct.append(s)
    rows = {s.name: dtypes.of_torch(s.dtype) for s in distinct}
    for name, row in rows.items():
        if row is None or row.st is None:
            raise TypeError(f"weights: tensor {name!r}: dtype not carried by safetensors")
    order = sorted(range(len(distinct)), key=lambda i: -rows[distinct[i].name].itemsize)  # stable: keeps caller order
    rel: dict[str, tuple[int, int]] = {}
    pos = 0
    for i in order:
        s = distinct[i]
        n = math.prod(s.shape) * rows[s.name].itemsize
        rel[s.name] = (pos, pos + n)
        pos += n
    table: dict = {"__metadata__": {"format": "pt"}}
    if aliases:
        table["__metadata__"][ALIASES_KEY] = json.dumps(aliases, separators=(",", ":"))
    for s in distinct:
        table[s.name] = {"dtype": rows[s.name].st, "shape": list(s.shape), "data_offsets": list(rel[s.name])}
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + _LEN.size) % ALIGN)
    header = _LEN.pack(len(text)) + text
    base = len(header)
    by_name = {s.name: TensorEntry(s.name, rows[s.name].name, s.shape, base + rel[s.name][0],
                                   rel[s.name][1] - rel[s.name][0]) for s in distinct}
    entries = [replace(by_name[aliases.get(s.name, s.name)], name=s.name) for s in specs]
    data = [by_name[distinct[i].name] for i in order]
    return Layout(entries, data, header, base + pos)


class LayoutMemo:
    """The last layout planned, reused while the specs stay equal: a model keeps its names, shapes,
    dtypes and storages from step to step, so only the first version pays for planning."""

    def __init__(self) -> None:
        self._specs: list[TensorSpec] | None = None
        self._layout: Layout | None = None

    def __call__(self, specs: Sequence[TensorSpec]) -> Layout:
        specs = list(specs)
        if self._layout is None or specs != self._specs:
            self._layout, self._specs = plan_layout(specs), specs
        return self._layout


_MAX_DIM = 1 << 48
_MAX_NDIM = 32


def parse_layout(buf) -> list[TensorEntry]:
    """Tensor table of a payload (bytes-like or uint8 tensor), validated: every tensor inside it, sizes
    consistent, the data section covered without gaps or overlaps (as safetensors requires). Anything
    malformed raises :class:`WeightsFormatError` and nothing else."""
    try:
        return _parse_layout(buf)
    except WeightsFormatError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise WeightsFormatError(f"weights payload: malformed tensor table ({type(exc).__name__}: {exc})") from None


def _parse_layout(buf) -> list[TensorEntry]:
    mv = memoryview(buf.numpy() if isinstance(buf, torch.Tensor) else buf).cast("B")
    table, base = _header_table(mv)
    meta = table.pop("__metadata__", {}) or {}
    entries = {name: _tensor_entry(name, d, base, len(mv)) for name, d in table.items()}
    _check_tiling(entries.values(), base, len(mv))
    aliases = _alias_table(meta, entries)
    out = list(entries.values())
    out += [TensorEntry(a, entries[t].dtype, entries[t].shape, entries[t].offset, entries[t].nbytes) for a, t in aliases.items()]
    return out


def _header_table(mv: memoryview) -> tuple[dict, int]:
    """The payload's JSON header as a dict, and where its data section starts."""
    if len(mv) < _LEN.size:
        raise WeightsFormatError(f"weights payload: {len(mv)} bytes, too short for a safetensors header")
    (hlen,) = _LEN.unpack(mv[: _LEN.size])
    if hlen > len(mv) - _LEN.size:
        raise WeightsFormatError(f"weights payload: header of {hlen} bytes runs past the payload ({len(mv)} bytes)")
    try:
        table = json.loads(bytes(mv[_LEN.size : _LEN.size + hlen]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WeightsFormatError(f"weights payload: header is not JSON ({exc})") from None
    if not isinstance(table, dict):
        raise WeightsFormatError("weights payload: header is not a JSON object")
    return table, _LEN.size + hlen


def _tensor_entry(name: str, d: Any, base: int, size: int) -> TensorEntry:
    """One header entry, validated: known dtype, sane shape, offsets of that many bytes, aligned and
    inside the payload of ``size`` bytes whose data section starts at ``base``."""
    where = f"weights payload tensor {name!r}"
    if not isinstance(d, dict) or not isinstance(d.get("dtype"), str) or d["dtype"] not in dtypes.BY_ST:
        raise WeightsFormatError(f"{where}: bad entry or dtype {d.get('dtype') if isinstance(d, dict) else d!r}")
    shape, span = d.get("shape"), d.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < _MAX_DIM for s in shape):
        raise WeightsFormatError(f"{where}: bad shape {shape!r}")
    if not (isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span)):
        raise WeightsFormatError(f"{where}: bad data_offsets {span!r}")
    row = dtypes.BY_ST[d["dtype"]]
    b, e = span
    if e - b != math.prod(shape) * row.itemsize:
        raise WeightsFormatError(f"{where}: {e - b} bytes do not match shape {shape} x {row.itemsize} bytes")
    if b < 0 or base + e > size:
        raise WeightsFormatError(f"{where}: bytes [{b}, {e}) outside the payload's data section")
    if (base + b) % row.itemsize:
        raise WeightsFormatError(f"{where}: offset {base + b} is not aligned to {row.itemsize} bytes")
    return TensorEntry(name, row.name, tuple(shape), base + b, e - b)


def _check_tiling(entries: Iterable[TensorEntry], base: int, size: int) -> None:
    """The tensors cover ``[base, size)`` exactly: no gap, no overlap, nothing after them."""
    pos = base
    for e in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if e.offset != pos:
            raise WeightsFormatError(f"weights payload: tensor {e.name!r} at {e.offset}, expected {pos} (gap or overlap)")
        pos += e.nbytes
    if pos != size:
        raise WeightsFormatError(f"weights payload: tensors end at {pos}, payload has {size} bytes")


def _alias_table(meta: Any, entries: Mapping[str, TensorEntry]) -> dict[str, str]:
    """The metadata's alias table (alias name -> sent tensor name), validated."""
    raw_aliases = meta.get(ALIASES_KEY, "{}") if isinstance(meta, dict) else None
    try:
        aliases = json.loads(raw_aliases) if isinstance(raw_aliases, str) else None
    except ValueError:
        aliases = None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) and v in entries
                                                for k, v in aliases.items()):
        raise WeightsFormatError("weights payload: bad alias table (names must point at sent tensors)")
    return aliases


def view_of(buf_N: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """A tensor viewing ``e``'s bytes in the payload buffer (no copy)."""
    raw = buf_N[e.offset : e.offset + e.nbytes]
    t = raw.view(dtypes.torch_dtype(e.dtype)) if e.nbytes else torch.empty(0, dtype=dtypes.torch_dtype(e.dtype))
    return t.reshape(e.shape)


def unpack_tensors(buf_N: torch.Tensor, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """Views (no copies) of the tensors of a payload buffer."""
    return {e.name: view_of(buf_N, e) for e in entries}


def pack_into(buf_N: torch.Tensor, tensors: Mapping[str, torch.Tensor], layout: Layout,
              progress: Callable[[int], None] | None = None) -> None:
    """Write the header and every tensor (cast to its entry's dtype) into the uint8 buffer, in byte order.

    ``progress(n)`` is called as the payload's first ``n`` bytes become final (a sender can start on
    them while later tensors are still being copied); it ends with ``len(buf_N)``.
    """
    buf_N[: len(layout.header)].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
    for e in layout.data:
        if e.nbytes:
            view_of(buf_N, e).copy_(tensors[e.name].detach())
        if progress is not None:
            progress(e.offset + e.nbytes)
    if progress is not None:
        progress(buf_N.numel())
