"""A reference encoder of the weight channel's wire, for tests: a whole version's meta record, payload
and chunks in one go (the publisher does the same in steps, overlapped with the copies)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from streamgrpo.transport.weights.codec import (
    DEFAULT_ALGO,
    VersionMeta,
    chunk_digest,
    chunk_span,
    encode_meta,
    make_header,
    n_chunks_for,
)
from streamgrpo.transport.weights.layout import pack_into, plan_layout, specs_of


def build_version(version: int, tensors: Mapping[str, torch.Tensor], chunk_bytes: int, src: int = 0,
                  published_at: float = 0.0, algo: str = DEFAULT_ALGO,
                  dtype: torch.dtype | None = None) -> tuple[VersionMeta, bytes, torch.Tensor]:
    """(meta, meta_bytes, payload) of a version, in one go (the publisher does the same in steps)."""
    layout = plan_layout(specs_of(tensors, dtype))
    buf_N = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_into(buf_N, tensors, layout)
    meta = VersionMeta(version, src, layout.nbytes, chunk_bytes, n_chunks_for(layout.nbytes, chunk_bytes),
                       published_at, algo)
    return meta, encode_meta(meta), buf_N


def iter_chunks(meta: VersionMeta, meta_bytes: bytes, buf_N: torch.Tensor, req: int | None = None):
    """Yield ``(header, payload)`` per chunk, each with its digest."""
    mv = memoryview(buf_N.numpy())
    for seq in range(meta.n_chunks):
        start, end = chunk_span(meta, seq)
        chunk = mv[start:end]
        digest = chunk_digest(meta.algo, chunk, meta_bytes if seq == 0 else None)
        yield make_header(meta, seq, meta_bytes, digest, req), chunk
