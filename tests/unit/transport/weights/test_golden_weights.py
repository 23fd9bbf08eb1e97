"""Golden weight chunks: a version as the learner's PUB socket sends it (docs/protocol.md, "The weight
channel"), for each digest algorithm, beside its decoded JSON in ``tests/golden/weights/``. Both
ways: the frames decode and verify to the JSON's meta, headers and tensors; the JSON's tensors and
meta encode to the frames, bit for bit. Remake on purpose with ``STREAMGRPO_REGEN_GOLDEN=1``."""

from __future__ import annotations

import base64
import json
import os

import msgpack
import pytest
import torch

from streamgrpo.transport.weights.codec import (
    TOPIC,
    VersionMeta,
    chunk_digest,
    chunk_span,
    decode_header,
    decode_meta,
    encode_header,
    encode_meta,
    make_header,
    n_chunks_for,
)
from streamgrpo.transport.weights.layout import pack_into, parse_layout, plan_layout, specs_of, unpack_tensors
from tests.paths import GOLDEN

GOLDEN = GOLDEN / "weights"
ALGOS = ("xxh3_128", "sha256")


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "model.language_model.embed_tokens.weight": (torch.arange(32, dtype=torch.float32) / 7).reshape(4, 8)
        .to(torch.bfloat16),
        "model.language_model.norm.weight": torch.linspace(-1, 1, 8),
        "model.visual.patch_embed.proj.weight": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 3,
    }


def frames_of(tensors: dict[str, torch.Tensor], version: int, src: int, ts: float, algo: str,
              chunk_bytes: int = 128) -> list[list[bytes]]:
    """The PUB messages ``[b"w", header, chunk]`` of one version, built with the publisher's own codec."""
    layout = plan_layout(specs_of(tensors))
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    pack_into(buf, tensors, layout)
    payload = buf.numpy().tobytes()
    meta = VersionMeta(version, src, len(payload), chunk_bytes, n_chunks_for(len(payload), chunk_bytes), ts, algo)
    meta_bytes = encode_meta(meta)
    out = []
    for seq in range(meta.n_chunks):
        start, end = chunk_span(meta, seq)
        chunk = payload[start:end]
        digest = chunk_digest(algo, chunk, meta_bytes if seq == 0 else None)
        out.append([TOPIC, encode_header(make_header(meta, seq, meta_bytes, digest)), chunk])
    return out


def _arr(t: torch.Tensor) -> dict:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "base64": base64.b64encode(raw).decode()}


def to_json(frames: list[list[bytes]]) -> dict:
    """What a subscriber reads from the frames: meta, headers, and the verified tensors."""
    headers = [decode_header(f[1]) for f in frames]
    meta = decode_meta(headers[0].meta)
    payload = b"".join(f[2] for f in frames)
    for h, f in zip(headers, frames):
        assert chunk_digest(meta.algo, f[2], h.meta if h.seq == 0 else None) == h.digest, f"chunk {h.seq}"
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    tensors = unpack_tensors(buf, parse_layout(buf))
    return {
        "meta": {"version": meta.version, "src": meta.src, "nbytes": meta.nbytes, "chunk": meta.chunk_bytes,
                 "n": meta.n_chunks, "ts": meta.published_at, "algo": meta.algo},
        "headers": [{"v": h.version, "s": h.src, "q": h.seq, "n": h.n_chunks, "o": h.offset, "l": h.size,
                     "d": h.digest.hex(), **({"m": h.meta.hex()} if h.meta is not None else {})} for h in headers],
        "tensors": {name: _arr(t) for name, t in tensors.items()},
    }


def from_json(doc: dict) -> list[list[bytes]]:
    tensors = {}
    for name, a in doc["tensors"].items():
        dtype = getattr(torch, a["dtype"])
        tensors[name] = torch.frombuffer(bytearray(base64.b64decode(a["base64"])), dtype=dtype).reshape(a["shape"])
    m = doc["meta"]
    return frames_of(tensors, m["version"], m["src"], m["ts"], m["algo"], m["chunk"])


def _golden(algo: str) -> list[list[bytes]]:
    return frames_of(_tensors(), version=7, src=123456789012345, ts=1795000000.5, algo=algo)


if os.environ.get("STREAMGRPO_REGEN_GOLDEN"):
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for _algo in ALGOS:
        (GOLDEN / f"v7_{_algo}.msgpack").write_bytes(msgpack.packb(_golden(_algo), use_bin_type=True))
        (GOLDEN / f"v7_{_algo}.json").write_text(json.dumps(to_json(_golden(_algo)), indent=1) + "\n")


@pytest.mark.parametrize("algo", ALGOS)
def test_golden_weight_chunks_decode_to_their_json_and_encode_back(algo):
    frames = msgpack.unpackb((GOLDEN / f"v7_{algo}.msgpack").read_bytes(), raw=True)
    doc = json.loads((GOLDEN / f"v7_{algo}.json").read_text())
    assert len(frames) == doc["meta"]["n"] > 1 and all(f[0] == b"w" for f in frames)
    assert to_json(frames) == doc
    assert from_json(doc) == frames
    assert _golden(algo) == frames  # what this release sends for the same tensors
    sent = _tensors()
    got = from_json(doc)
    assert to_json(got)["tensors"] == {k: _arr(v) for k, v in sent.items()}  # names, dtypes, shapes, bytes
