"""The one dtype table of the project: names on our wires, safetensors codes, numpy and torch dtypes.

Every row is a dtype some wire carries. ``name`` is what travels in a ScoredGroup (``wire.py``) and
what configs say (``bfloat16``); ``st`` is the safetensors code the weight channel's payload uses
(``BF16``), or None where safetensors has none. numpy has no bfloat16 or float8, so their ``np``
is None (callers handle them through torch). torch is imported only when a torch dtype is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # wire/config name, e.g. "bfloat16"
    st: str | None  # safetensors code, e.g. "BF16"
    itemsize: int
    np: np.dtype | None  # little-endian numpy dtype; None for bfloat16 / float8

    @property
    def torch(self):
        """The torch dtype (None where torch has none, e.g. uint32 on old torch)."""
        return _torch_dtypes().get(self.name)


def _le(name: str) -> np.dtype:
    return np.dtype(name).newbyteorder("<")


TABLE: tuple[DType, ...] = (
    DType("bool", "BOOL", 1, _le("bool")),
    DType("uint8", "U8", 1, _le("uint8")),
    DType("int8", "I8", 1, _le("int8")),
    DType("uint16", "U16", 2, _le("uint16")),
    DType("int16", "I16", 2, _le("int16")),
    DType("uint32", "U32", 4, _le("uint32")),
    DType("int32", "I32", 4, _le("int32")),
    DType("uint64", "U64", 8, _le("uint64")),
    DType("int64", "I64", 8, _le("int64")),
    DType("float16", "F16", 2, _le("float16")),
    DType("float32", "F32", 4, _le("float32")),
    DType("float64", "F64", 8, _le("float64")),
    DType("complex64", "C64", 8, _le("complex64")),
    DType("complex128", None, 16, _le("complex128")),
    DType("bfloat16", "BF16", 2, None),
    DType("float8_e4m3fn", "F8_E4M3", 1, None),
    DType("float8_e5m2", "F8_E5M2", 1, None),
)
BY_NAME: dict[str, DType] = {d.name: d for d in TABLE}
BY_ST: dict[str, DType] = {d.st: d for d in TABLE if d.st is not None}
NUMPY_NAMES: tuple[str, ...] = tuple(d.name for d in TABLE if d.np is not None)
"""The dtypes numpy holds natively (the wire carries these plus bfloat16)."""


@lru_cache(maxsize=1)
def _torch_dtypes() -> dict:
    import torch

    return {d.name: getattr(torch, d.name) for d in TABLE if isinstance(getattr(torch, d.name, None), torch.dtype)}


@lru_cache(maxsize=1)
def _of_torch() -> dict:
    return {t: BY_NAME[name] for name, t in _torch_dtypes().items()}


def of_torch(dtype) -> DType | None:
    """The row of a torch dtype, or None when no wire carries it."""
    return _of_torch().get(dtype)


def torch_dtype(name: str):
    """torch dtype of a table name (``"bfloat16"`` -> ``torch.bfloat16``); KeyError for an unknown one."""
    return _torch_dtypes()[name]
