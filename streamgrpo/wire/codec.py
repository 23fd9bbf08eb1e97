"""The bytes of a ScoredGroup: :func:`encode` / :func:`encode_parts` (normalized and validated first, see
:mod:`.contract`) and :func:`decode` (any malformed input raises :class:`~.arrays.WireError` and nothing else).

Frame layout (all integers little-endian; the message: :mod:`.message`; in prose: docs/protocol.md)::

    b"SGRP"  u32 header_len  u64 body_len  header (msgpack map)  zero padding to 8  body (raw array bytes)

:func:`decode` never copies array data: arrays are ``np.frombuffer`` views of the message.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from streamgrpo.wire.arrays import (
    _ALIGN,
    _HEAD,
    _PAD,
    WireError,
    _ArrayRef,
    _Body,
    _is_torch,
    _parse_ref,
    _resolve,
    _resolve_tree,
)
from streamgrpo.wire.contract import _check_schema, _fail, _tname, normalized, validate
from streamgrpo.wire.media import ref_from_wire, ref_to_wire
from streamgrpo.wire.message import DEFAULT_MAX_BYTES, MAGIC, Completion, ScoredGroup, Source, Visual


# -------------------------------------------------------------------------------------- encode
def encode(group: ScoredGroup, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Serialise a ScoredGroup (validated first); raises :class:`WireError` naming the field, or if over ``max_bytes``."""
    return b"".join(encode_parts(group, max_bytes=max_bytes))


def encode_parts(group: ScoredGroup, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Any]:
    """:func:`encode` as a list of buffers (the arrays' own memory, not copied) whose concatenation is the message.

    For senders that can write a message in pieces (the queue's XADD) and so skip one copy.
    """
    g = normalized(group)
    validate(g)
    body = _Body()

    def default(x: Any) -> Any:
        if isinstance(x, np.ndarray) or _is_torch(x):
            return body.ext(x)
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, tuple):
            return list(x)
        raise TypeError(f"cannot serialise {type(x).__name__}")

    header = {
        "schema": g.schema, "group_id": g.group_id, "prompt_id": g.prompt_id, "generator_id": g.generator_id,
        "policy_version": g.policy_version, "created_at": float(g.created_at), "model_id": g.model_id,
        "prompt_ids": body.ext(g.prompt_ids), "answer": g.answer, "prompt_text": g.prompt_text,
        "visuals": [
            {"kind": v.kind, **({"ref": ref_to_wire(v.ref)} if v.ref is not None else {"frames": body.ext(v.frames)}),
             "fps": float(v.fps), "frame_indices": body.ext(v.frame_indices)}
            for v in g.visuals
        ],
        "completions": [
            {"token_ids": body.ext(c.token_ids), "logprobs": body.ext(c.logprobs),
             "versions": body.ext(c.versions), "text": c.text,
             "finish_reason": c.finish_reason, "rewards": {k: float(r) for k, r in c.rewards.items()},
             "reward": float(c.reward)}
            for c in g.completions
        ],
        "meta": g.meta,
    }
    if g.source is not None:  # optional: a message without it is as before (and an older learner ignores it)
        header["source"] = {"num_shards": g.source.num_shards, "shard": g.source.shard, "epoch": g.source.epoch,
                            "position": g.source.position}
    try:
        head = msgpack.packb(header, default=default, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"meta: not serialisable: {exc}") from None
    pad = -(len(head) + _HEAD.size) % _ALIGN
    total = _HEAD.size + len(head) + pad + body.size
    if total > max_bytes:
        raise WireError(f"message: {total} bytes, over the limit of {max_bytes} bytes (queue.max_message_mib)")
    return [_HEAD.pack(MAGIC, len(head), body.size), head, _PAD[:pad], *body.parts]


# -------------------------------------------------------------------------------------- decode
_FIELDS = ("schema", "group_id", "prompt_id", "generator_id", "policy_version", "created_at", "model_id",
           "prompt_ids", "answer", "prompt_text", "visuals", "completions", "meta")


def _get(d: Any, key: str, path: str) -> Any:
    if not isinstance(d, dict):
        _fail(path or "header", f"expected a mapping, got {_tname(d)}")
    if key not in d:
        _fail(f"{path}.{key}" if path else key, "missing")
    return d[key]


def _arr(x: Any, body: memoryview, path: str) -> Any:
    if not isinstance(x, _ArrayRef):
        _fail(path, f"expected an array, got {_tname(x)}")
    return _resolve(x, body, path)


def _list(x: Any, path: str) -> list:
    if not isinstance(x, list):
        _fail(path, f"expected a list, got {_tname(x)}")
    return x


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> ScoredGroup:
    """Parse one message; arrays are zero-copy views of ``data``. Any malformed input raises :class:`WireError`."""
    try:
        return _decode(data, max_bytes)
    except WireError:
        raise
    except RecursionError:
        raise WireError("header: nested too deeply") from None
    except Exception as exc:  # a decoder must never raise anything else
        raise WireError(f"message: cannot decode ({type(exc).__name__}: {exc})") from None


def _decode(data: Any, max_bytes: int) -> ScoredGroup:
    head, body = _split_frame(data, max_bytes)
    h = _parse_header(head)
    schema = _get(h, "schema", "")
    _check_schema(schema)
    for key in _FIELDS:
        _get(h, key, "")
    visuals = [_visual(v, body, f"visuals[{i}]") for i, v in enumerate(_list(h["visuals"], "visuals"))]
    completions = [_completion(c, body, f"completions[{i}]")
                   for i, c in enumerate(_list(h["completions"], "completions"))]
    group = ScoredGroup(
        prompt_id=h["prompt_id"], generator_id=h["generator_id"], policy_version=h["policy_version"],
        model_id=h["model_id"], prompt_ids=_arr(h["prompt_ids"], body, "prompt_ids"), visuals=visuals,
        answer=h["answer"], completions=completions, prompt_text=h["prompt_text"],
        meta=_resolve_tree(h["meta"], body, "meta"), group_id=h["group_id"], created_at=h["created_at"],
        schema=schema, source=_source(h["source"]) if "source" in h else None,
    )
    validate(group)
    expands = sum(v.pixel_bytes for v in visuals if v.frames is None)
    if expands > max_bytes:
        _fail("visuals", f"references expand to {expands} bytes of pixels, over the limit of {max_bytes} bytes "
                         "(queue.max_message_mib: what the message could hold inline)")
    return group


def _split_frame(data: Any, max_bytes: int) -> tuple[memoryview, memoryview]:
    """Check one message's frame (size limit, frame head, magic, the lengths it promises); its msgpack
    header and its array body, as views of ``data``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        _fail("message", f"expected bytes, got {_tname(data)}")
    mv = memoryview(data).cast("B")
    if len(mv) > max_bytes:
        _fail("message", f"{len(mv)} bytes, over the limit of {max_bytes} bytes (queue.max_message_mib)")
    if len(mv) < _HEAD.size:
        _fail("message", f"truncated: {len(mv)} bytes is shorter than the {_HEAD.size}-byte frame head")
    magic, hlen, blen = _HEAD.unpack_from(mv)
    if magic != MAGIC:
        _fail("message", f"bad magic {bytes(magic)!r} (not a streamgrpo ScoredGroup)")
    if _HEAD.size + hlen > len(mv):
        _fail("header", f"truncated: needs {hlen} bytes, message has {len(mv) - _HEAD.size}")
    body_start = _HEAD.size + hlen + (-(_HEAD.size + hlen) % _ALIGN)
    if body_start + blen != len(mv):
        _fail("body", f"message is {len(mv)} bytes but its frame head promises {body_start + blen} (truncated or padded)")
    return mv[_HEAD.size:_HEAD.size + hlen], mv[body_start:]


def _parse_header(head: memoryview) -> dict:
    """The msgpack header, a mapping (array references still unresolved)."""
    try:
        h = msgpack.unpackb(head, raw=False, ext_hook=_parse_ref, strict_map_key=True)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"header: not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(h, dict):
        _fail("header", f"expected a mapping, got {_tname(h)}")
    return h


def _visual(v: Any, body: memoryview, p: str) -> Visual:
    """One visual of the header at path ``p``: its frames inline (an array of the body) or a reference."""
    if isinstance(v, dict) and "ref" in v:
        if "frames" in v:
            _fail(p, "has both frames and a ref (a visual travels one way)")
        frames, ref = None, ref_from_wire(v["ref"], f"{p}.ref")
    else:
        frames, ref = _arr(_get(v, "frames", p), body, f"{p}.frames"), None
    return Visual(
        kind=_get(v, "kind", p), frames=frames, fps=_get(v, "fps", p),
        frame_indices=_arr(_get(v, "frame_indices", p), body, f"{p}.frame_indices"), ref=ref,
    )


def _source(s: Any) -> Source:
    """The optional ``source`` map of the header (its values checked by :func:`validate`)."""
    return Source(*(_get(s, k, "source") for k in ("num_shards", "shard", "epoch", "position")))


def _completion(c: Any, body: memoryview, p: str) -> Completion:
    """One completion of the header at path ``p``, its arrays views of the body."""
    return Completion(
        token_ids=_arr(_get(c, "token_ids", p), body, f"{p}.token_ids"),
        logprobs=_arr(_get(c, "logprobs", p), body, f"{p}.logprobs"),
        versions=_arr(_get(c, "versions", p), body, f"{p}.versions"),
        text=_get(c, "text", p), finish_reason=_get(c, "finish_reason", p),
        rewards=_get(c, "rewards", p), reward=_get(c, "reward", p),
    )
