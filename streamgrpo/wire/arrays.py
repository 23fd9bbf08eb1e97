"""The array part of the wire format (:mod:`streamgrpo.wire`): dtype names, the aligned body that
carries array bytes, and the msgpack extension that points into it. Generic: nothing here knows
what a ScoredGroup is."""

from __future__ import annotations

import math
import struct
import warnings
from typing import Any

import msgpack
import numpy as np

from streamgrpo.wire.dtypes import BY_NAME, NUMPY_NAMES

_EXT_ARRAY = 1
_ALIGN = 8
_MAX_NDIM = 32
_PAD = bytes(_ALIGN)
_HEAD = struct.Struct("<4sIQ")  # magic, header length, body length

# dtype name on the wire -> little-endian numpy dtype (bfloat16 is handled apart); one table: streamgrpo.wire.dtypes
_DTYPES: dict[str, np.dtype] = {name: BY_NAME[name].np for name in NUMPY_NAMES}
_BF16 = "bfloat16"
_NAME_OF = {dt: name for name, dt in _DTYPES.items()}  # dtype.name is slow; look dtypes up instead
_NATIVE = {name: np.dtype(name) for name in _DTYPES}


def _wire_name(dt: np.dtype) -> str | None:
    name = _NAME_OF.get(dt)
    if name is None and dt.byteorder == ">":
        name = _NAME_OF.get(dt.newbyteorder("<"))
    if name is None and dt.name == _BF16:
        name = _BF16
    return name


class WireError(ValueError):
    """A message could not be encoded or decoded; the message names the field."""


# ------------------------------------------------------------------------------ arrays (generic)
def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_numpy(x: Any) -> tuple[str, np.ndarray]:
    """(wire dtype name, C-contiguous little-endian numpy array) of an array-like; bf16 as uint16 bits."""
    if type(x) is np.ndarray and x.flags.c_contiguous:  # the common case, without the lookups below
        name = _NAME_OF.get(x.dtype)
        if name is not None:
            return name, x
    if _is_torch(x):
        import torch

        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return _BF16, t.view(torch.int16).numpy().view(np.uint16)
        x = t.numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"not an array: {type(x).__name__}")
    name = _wire_name(x.dtype)
    if name == _BF16:  # ml_dtypes.bfloat16
        return _BF16, x.astype(x.dtype, order="C", copy=False).view(np.uint16)
    if name is None:
        raise TypeError(f"dtype {x.dtype} is not supported on the wire (supported: {', '.join([*_DTYPES, _BF16])})")
    return name, x.astype(_DTYPES[name], order="C", copy=False)  # keeps 0-d arrays 0-d


class _Body:
    """Collects array buffers for one message, each at an 8-byte aligned offset."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def ext(self, x: Any) -> msgpack.ExtType:
        name, arr = _to_numpy(x)
        offset = self.size
        if arr.nbytes:
            self.parts.append(arr.reshape(-1).view(np.uint8))
            self.size += arr.nbytes
            pad = -self.size % _ALIGN
            if pad:
                self.parts.append(_PAD[:pad])
                self.size += pad
        return msgpack.ExtType(_EXT_ARRAY, msgpack.packb([name, list(arr.shape), offset, arr.nbytes]))


class _ArrayRef:
    """Where one array lives in the body (a plain slotted class: a message holds ~20, parsed per message)."""

    __slots__ = ("dtype", "shape", "offset", "nbytes")

    def __init__(self, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int):
        self.dtype, self.shape, self.offset, self.nbytes = dtype, shape, offset, nbytes


def _parse_ref(code: int, data: bytes) -> _ArrayRef:
    if code != _EXT_ARRAY:
        raise WireError(f"header: unknown msgpack extension type {code}")
    try:
        ref = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise WireError(f"header: corrupt array reference ({type(exc).__name__})") from None
    if type(ref) is not list or len(ref) != 4:
        raise WireError("header: array reference is not [dtype, shape, offset, nbytes]")
    dtype, shape, offset, nbytes = ref
    if dtype not in _DTYPES and dtype != _BF16:
        raise WireError(f"header: unknown array dtype {dtype!r}")
    # type(x) is int: msgpack yields exact ints (bools are their own type), so this is _is_int, faster
    if type(shape) is not list or len(shape) > _MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError(f"header: bad array shape {shape!r}")
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise WireError(f"header: bad array offset/nbytes {offset!r}/{nbytes!r}")
    return _ArrayRef(dtype, tuple(shape), offset, nbytes)


def _resolve(ref: _ArrayRef, body: memoryview, path: str) -> Any:
    itemsize = 2 if ref.dtype == _BF16 else _DTYPES[ref.dtype].itemsize
    count = math.prod(ref.shape)
    if count * itemsize != ref.nbytes:
        raise WireError(f"{path}: shape {ref.shape} of {ref.dtype} needs {count * itemsize} bytes, header says {ref.nbytes}")
    if ref.offset + ref.nbytes > len(body):
        raise WireError(f"{path}: array bytes [{ref.offset}, {ref.offset + ref.nbytes}) run past the body ({len(body)} bytes)")
    if count == 0:
        if ref.dtype != _BF16:
            return np.zeros(ref.shape, dtype=_DTYPES[ref.dtype])
    if ref.dtype == _BF16:
        import torch

        if count == 0:
            return torch.empty(ref.shape, dtype=torch.bfloat16)
        with warnings.catch_warnings():  # read-only message buffer: torch warns, we never write to it
            warnings.simplefilter("ignore")
            return torch.frombuffer(body, dtype=torch.bfloat16, count=count, offset=ref.offset).view(ref.shape)
    arr = np.frombuffer(body, dtype=_DTYPES[ref.dtype], count=count, offset=ref.offset)
    return arr.reshape(ref.shape)


def _resolve_tree(x: Any, body: memoryview, path: str) -> Any:
    """Replace array references anywhere inside plain msgpack data (used for ``meta``)."""
    if isinstance(x, _ArrayRef):
        return _resolve(x, body, path)
    if isinstance(x, dict):
        return {k: _resolve_tree(v, body, f"{path}.{k}") for k, v in x.items()}
    if isinstance(x, list):
        return [_resolve_tree(v, body, f"{path}[{i}]") for i, v in enumerate(x)]
    return x

