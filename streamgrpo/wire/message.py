"""ScoredGroup: the message a generator sends the learner, and its codec (the format in prose: docs/protocol.md).

Frame layout (all integers little-endian)::

    b"SGRP"  u32 header_len  u64 body_len  header (msgpack map)  zero padding to 8  body (raw array bytes)

A visual travels as its frames or, schema 3, as a reference (``Visual.ref``, a
:class:`~streamgrpo.wire.media.MediaRef`: file, decoder, size and the digest of the pixels; the
learner decodes it again and checks the digest). Schema 2 messages (every visual inline) still decode.

The header holds every scalar, string and list of the group. Each array in it is a msgpack
extension (code 1) whose payload is ``msgpack([dtype, shape, offset, nbytes])`` pointing into the
body; every array starts at a multiple of 8 bytes. :func:`decode` therefore never copies array
data: arrays are ``np.frombuffer`` views of the message (read-only when the message is ``bytes``).

Array dtypes travel as names (``uint8``, ``int32``, ``float32``, ``bfloat16`` ...). numpy has no
bfloat16, so a ``bfloat16`` array decodes as a ``torch.bfloat16`` tensor (torch is imported only
then); :func:`encode` accepts numpy arrays, torch tensors (any supported dtype, bfloat16 included)
and ``ml_dtypes.bfloat16`` arrays. The fixed fields of a ScoredGroup use uint8/int32/float32; other
arrays may travel in ``meta``. No pickle: msgpack and raw bytes only.

Validation (one rule set for both directions, :func:`validate`) names the field, e.g.
``completions[3].logprobs: 7 values but token_ids has 8``. Any malformed input to :func:`decode`
raises :class:`WireError` and nothing else.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import msgpack
import numpy as np

from streamgrpo.wire.arrays import (
    _ALIGN,
    _HEAD,
    _NATIVE,
    _PAD,
    WireError,
    _ArrayRef,
    _Body,
    _is_torch,
    _parse_ref,
    _resolve,
    _resolve_tree,
)
from streamgrpo.wire.media import MAX_FRAMES, MediaRef, check_ref, ref_from_wire, ref_to_wire

LOGPROB_MIN = -1000.0  # below any sampler's reach: the smallest positive float64 is e^-745
LOGPROB_MAX = 1e-3  # a log-probability is at most 0 (this much rounding above it is allowed)
SCHEMA_VERSION = 3  # 2: per-token policy versions (Completion.versions); 3: visuals by reference (Visual.ref)
SCHEMAS = (2, 3)  # versions this build reads (a schema-2 message is a schema-3 one without references)
MAGIC = b"SGRP"
DEFAULT_MAX_BYTES = 256 << 20  # queue.max_message_mib default
_MAX_VERSION = 2**31 - 1  # versions travel as int32
_MAX_INDEX = 2**63 - 1  # a data source's numbers travel as msgpack ints (int64 at most)
__all__ = ["DEFAULT_MAX_BYTES", "MAGIC", "SCHEMA_VERSION", "Completion", "MediaRef", "ScoredGroup", "Source", "Visual",
           "WireError", "decode", "encode", "encode_parts", "inline", "normalized", "validate"]


@dataclass
class Visual:
    """One video or image exactly as the generator fed it to the model (already resized).

    It travels as its pixels (``frames``) or, with ``ref`` set, as a reference the learner decodes
    again and checks against the digest (:mod:`streamgrpo.wire.media`); a visual with both travels
    by reference. A decoded reference visual has ``frames`` None until the learner resolves it.
    """

    kind: str  # "video" | "image"
    frames: np.ndarray | None  # uint8, T x H x W x 3 (images: T == 1); None: by reference, not resolved yet
    fps: float = 0.0  # source frames per second the frames were sampled at (0 for images)
    frame_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # int32 (T,)
    ref: MediaRef | None = None  # where the frames come from (schema 3)

    @property
    def nframes(self) -> int:
        """T, whether the frames are here or referenced."""
        if self.frames is not None:
            return int(self.frames.shape[0])
        return len(self.frame_indices) if self.kind == "video" else 1

    @property
    def pixel_bytes(self) -> int:
        """Bytes of the T x H x W x 3 frames (here, or once a reference is resolved)."""
        if self.frames is not None:
            return int(self.frames.nbytes)
        return self.nframes * self.ref.height * self.ref.width * 3 if self.ref is not None else 0


@dataclass
class Completion:
    token_ids: np.ndarray  # int32 (L,)
    logprobs: np.ndarray  # float32 (L,): behaviour log-prob of each sampled token
    text: str
    finish_reason: str  # "stop" | "length"
    rewards: dict[str, float]  # per reward function
    reward: float  # weighted total
    versions: np.ndarray | None = None
    """int32 (L,): the policy version each token was sampled under (non-decreasing, none older than the
    group's ``policy_version``; several with in-flight weight updates). None when building a message:
    every token at the group's ``policy_version``; a decoded message always has it."""


@dataclass(frozen=True)
class Source:
    """Where a group's prompt came from: shard ``shard`` of ``num_shards`` (generator K of N), at ``position``
    of that shard's order in pass ``epoch`` (:func:`streamgrpo.data.dataset.iter_positions`). Optional on
    the wire: the learner keeps the furthest one it consumed per shard, the data cursor a restarted
    generator continues from (docs/data.md)."""

    num_shards: int
    shard: int
    epoch: int
    position: int

    @property
    def key(self) -> str:
        """``"N/K"``: the shard it counts for (a cursor of another shard count is another key)."""
        return f"{self.num_shards}/{self.shard}"

    @property
    def at(self) -> tuple[int, int]:
        """``(epoch, position)``: ordered as the shard is read."""
        return self.epoch, self.position


@dataclass
class ScoredGroup:
    prompt_id: str
    generator_id: str
    policy_version: int  # the oldest version any token was sampled under (staleness counts from it)
    model_id: str
    prompt_ids: np.ndarray  # int32 (P,): the exact prompt token ids the engine used
    visuals: list[Visual]
    answer: str
    completions: list[Completion]
    prompt_text: str = ""  # the chat-templated prompt (lets the learner re-process the visuals)
    meta: dict[str, Any] = field(default_factory=dict)  # small extras: record kind, sampling temperature
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    schema: int = SCHEMA_VERSION
    source: Source | None = None  # where the prompt came from (optional: external producers need not say)

    @property
    def nbytes(self) -> int:
        """Bytes of array data in the group (frames dominate)."""
        return int(
            self.prompt_ids.nbytes
            + sum((0 if v.frames is None else v.frames.nbytes) + v.frame_indices.nbytes for v in self.visuals)
            + sum(c.token_ids.nbytes + c.logprobs.nbytes + (0 if c.versions is None else c.versions.nbytes)
                  for c in self.completions)
        )


# ------------------------------------------------------------------------------------ validation
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fail(path: str, msg: str) -> NoReturn:
    raise WireError(f"{path}: {msg}")


def _tname(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"{x.dtype} array of shape {x.shape}"
    return type(x).__name__


def _check_str(x: Any, path: str, *, nonempty: bool = False, choices: tuple[str, ...] = ()) -> None:
    if not isinstance(x, str):
        _fail(path, f"expected a string, got {_tname(x)}")
    if nonempty and not x:
        _fail(path, "must not be empty")
    if choices and x not in choices:
        _fail(path, f"{x!r} is not one of {', '.join(choices)}")


def _check_num(x: Any, path: str, *, lo: float | None = None) -> None:
    if not _is_num(x):
        _fail(path, f"expected a number, got {_tname(x)}")
    if not math.isfinite(x):
        _fail(path, f"must be finite, got {x!r}")
    if lo is not None and x < lo:
        _fail(path, f"must be >= {lo}, got {x!r}")


def _check_array(x: Any, path: str, dtype: str, ndim: int) -> None:
    if not isinstance(x, np.ndarray):
        _fail(path, f"expected a {dtype} array, got {_tname(x)}")
    if x.dtype != _NATIVE[dtype]:
        _fail(path, f"expected dtype {dtype}, got {x.dtype}")
    if x.ndim != ndim:
        _fail(path, f"expected {ndim} dimension(s), got shape {x.shape}")


def _all_values_ok(completions: list[Completion], policy_version: int) -> bool:
    """No negative token id, no log-prob that is not finite or not in [LOGPROB_MIN, LOGPROB_MAX], and token versions that never go back and start no
    earlier than ``policy_version``, in any completion (arrays already well-typed)."""
    ids = [c.token_ids for c in completions if c.token_ids.size]
    lps = [c.logprobs for c in completions]
    if ids and int(np.concatenate(ids).min()) < 0:
        return False
    vs = [c.versions for c in completions if c.versions.size]
    if vs:
        v = np.concatenate(vs)
        starts = np.cumsum([len(x) for x in vs])[:-1]  # where one completion's versions follow another's
        if int(v.min()) < policy_version or not np.isin(np.flatnonzero(np.diff(v) < 0) + 1, starts).all():
            return False
    x = np.concatenate(lps) if lps else np.zeros(0, np.float32)
    return bool(np.isfinite(x).all()) and (not x.size or (float(x.max()) <= LOGPROB_MAX and float(x.min()) >= LOGPROB_MIN))


def _arrays_well_typed(completions: list[Any]) -> bool:
    i32, f32 = _NATIVE["int32"], _NATIVE["float32"]
    return all(
        isinstance(c, Completion) and type(c.token_ids) is np.ndarray and c.token_ids.dtype == i32
        and c.token_ids.ndim == 1 and type(c.logprobs) is np.ndarray and c.logprobs.dtype == f32
        and c.logprobs.ndim == 1 and len(c.logprobs) == len(c.token_ids)
        and type(c.versions) is np.ndarray and c.versions.dtype == i32 and c.versions.ndim == 1
        and len(c.versions) == len(c.token_ids)
        for c in completions
    )


def _check_schema(schema: Any) -> None:
    reads = " and ".join(map(str, SCHEMAS))
    if _is_int(schema) and schema == 1:
        _fail("schema", "version 1 comes from a streamgrpo older than per-token policy versions; "
                        f"upgrade the generator that sent it (this build reads {reads})")
    if not (_is_int(schema) and schema in SCHEMAS):
        _fail("schema", f"version {schema!r} is not supported (this build reads {reads})")


def _normalized_completion(c: Completion, i: int, policy_version: Any) -> Completion:
    """``c`` with contract dtypes; versions None -> every token at the group's version (a bad
    ``policy_version`` or ``token_ids`` is left for :func:`validate` to name)."""
    token_ids = _coerce(c.token_ids, f"completions[{i}].token_ids", "int32")
    if c.versions is not None:
        versions = _coerce(c.versions, f"completions[{i}].versions", "int32")
    else:
        pv = _scalar(policy_version)
        n = token_ids.shape[0] if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1 else 0
        versions = np.full(n, pv if _is_int(pv) and 0 <= pv <= _MAX_VERSION else 0, dtype=np.int32)
    return Completion(token_ids, _coerce(c.logprobs, f"completions[{i}].logprobs", "float32"), c.text,
                      c.finish_reason,
                      {k: _scalar(v) for k, v in c.rewards.items()} if isinstance(c.rewards, dict) else c.rewards,
                      _scalar(c.reward), versions)


def _check_visual(v: Any, p: str, schema: int) -> None:
    if not isinstance(v, Visual):
        _fail(p, f"expected a Visual, got {_tname(v)}")
    _check_str(v.kind, f"{p}.kind", choices=("video", "image"))
    _check_num(v.fps, f"{p}.fps", lo=0.0)
    _check_array(v.frame_indices, f"{p}.frame_indices", "int32", 1)
    if v.ref is not None:
        _check_ref_visual(v, p, schema)
    elif v.frames is None:
        _fail(f"{p}.frames", "missing (a visual carries its frames, or a ref to them)")
    if v.frames is None:
        return
    _check_array(v.frames, f"{p}.frames", "uint8", 4)
    t, h, w, c = v.frames.shape
    if not (t >= 1 and h >= 1 and w >= 1 and c == 3):
        _fail(f"{p}.frames", f"expected T x H x W x 3 with T, H, W >= 1, got {v.frames.shape}")
    if len(v.frame_indices) not in (0, t):
        _fail(f"{p}.frame_indices", f"{len(v.frame_indices)} indices for {t} frames")
    if v.ref is not None and (h, w) != (v.ref.height, v.ref.width):
        _fail(f"{p}.frames", f"{h} x {w} frames but the ref says {v.ref.height} x {v.ref.width}")


def _check_ref_visual(v: Visual, p: str, schema: int) -> None:
    """A visual by reference: schema 3, a valid ref, the frame indices that say which frames."""
    if schema < 3:
        _fail(f"{p}.ref", f"visuals by reference need schema 3 (this message says {schema})")
    check_ref(v.ref, f"{p}.ref")
    n = len(v.frame_indices)
    if v.kind == "video" and n == 0:
        _fail(f"{p}.frame_indices", "a video by reference needs the indices of its sampled frames")
    if v.kind == "image" and n:
        _fail(f"{p}.frame_indices", f"an image has no frame indices, got {n}")
    if n > MAX_FRAMES:
        _fail(f"{p}.frame_indices", f"{n} frames by reference, over the {MAX_FRAMES} a video may have")
    if n and int(v.frame_indices.min()) < 0:
        _fail(f"{p}.frame_indices", f"negative frame index {int(v.frame_indices.min())}")


def _check_completion(c: Any, p: str, policy_version: int, arrays: bool = True) -> None:
    """``arrays=False``: the arrays' types and values were already checked for all completions at once."""
    if not isinstance(c, Completion):
        _fail(p, f"expected a Completion, got {_tname(c)}")
    if arrays:
        _check_completion_arrays(c, p, policy_version)
    _check_str(c.text, f"{p}.text")
    _check_str(c.finish_reason, f"{p}.finish_reason")
    if not isinstance(c.rewards, dict):
        _fail(f"{p}.rewards", f"expected a mapping, got {_tname(c.rewards)}")
    for k, r in c.rewards.items():
        _check_str(k, f"{p}.rewards key")
        _check_num(r, f"{p}.rewards[{k!r}]")
    _check_num(c.reward, f"{p}.reward")


def _check_completion_arrays(c: Completion, p: str, policy_version: int) -> None:
    _check_array(c.token_ids, f"{p}.token_ids", "int32", 1)
    _check_array(c.logprobs, f"{p}.logprobs", "float32", 1)
    if len(c.logprobs) != len(c.token_ids):
        _fail(f"{p}.logprobs", f"{len(c.logprobs)} values but token_ids has {len(c.token_ids)}")
    if c.token_ids.size and int(c.token_ids.min()) < 0:
        _fail(f"{p}.token_ids", f"negative token id {int(c.token_ids.min())}")
    if not np.isfinite(c.logprobs).all():
        bad = int(np.flatnonzero(~np.isfinite(c.logprobs))[0])
        _fail(f"{p}.logprobs", f"behaviour log-prob {c.logprobs[bad]!r} at token {bad} is not finite")
    out = (c.logprobs > LOGPROB_MAX) | (c.logprobs < LOGPROB_MIN)
    if out.any():
        bad = int(np.flatnonzero(out)[0])
        _fail(f"{p}.logprobs", f"behaviour log-prob {float(c.logprobs[bad])!r} at token {bad} is outside what a sampler "
                               f"can produce ([{LOGPROB_MIN:g}, 0]: a sampled token has probability above 0 and at most 1)")
    if c.versions is None:  # not normalised yet: every token at the group's version
        return
    _check_array(c.versions, f"{p}.versions", "int32", 1)
    if len(c.versions) != len(c.token_ids):
        _fail(f"{p}.versions", f"{len(c.versions)} values but token_ids has {len(c.token_ids)}")
    if c.versions.size and int(c.versions.min()) < policy_version:
        _fail(f"{p}.versions", f"token version {int(c.versions.min())} is older than the group's policy_version "
                               f"{policy_version} (which must be the oldest)")
    back = np.flatnonzero(np.diff(c.versions) < 0)
    if back.size:
        i = int(back[0]) + 1
        _fail(f"{p}.versions", f"token {i} has version {int(c.versions[i])} after version {int(c.versions[i - 1])} "
                               "(versions never go back within a completion)")


def validate(group: ScoredGroup) -> None:
    """Raise :class:`WireError` naming the first field of ``group`` that breaks the contract."""
    if not isinstance(group, ScoredGroup):
        _fail("message", f"expected a ScoredGroup, got {_tname(group)}")
    _check_schema(group.schema)
    _check_str(group.group_id, "group_id", nonempty=True)
    if len(group.group_id) > 128:
        _fail("group_id", f"longer than 128 characters ({len(group.group_id)})")
    for name in ("prompt_id", "generator_id", "model_id", "answer", "prompt_text"):
        _check_str(getattr(group, name), name)
    if not (_is_int(group.policy_version) and 0 <= group.policy_version <= _MAX_VERSION):
        _fail("policy_version", f"expected an integer in [0, 2**31 - 1], got {group.policy_version!r}")
    _check_num(group.created_at, "created_at")
    _check_array(group.prompt_ids, "prompt_ids", "int32", 1)
    if not isinstance(group.visuals, list):
        _fail("visuals", f"expected a list, got {_tname(group.visuals)}")
    for i, v in enumerate(group.visuals):
        _check_visual(v, f"visuals[{i}]", group.schema)
    if not (isinstance(group.completions, list) and group.completions):
        _fail("completions", f"expected a non-empty list, got {_tname(group.completions)}")
    # Value checks over all completions at once (two reductions instead of two per completion); a
    # failure is then located completion by completion, so the error names the first bad one.
    checked = _arrays_well_typed(group.completions) and _all_values_ok(group.completions, group.policy_version)
    for i, c in enumerate(group.completions):
        _check_completion(c, f"completions[{i}]", group.policy_version, arrays=not checked)
    if not (isinstance(group.meta, dict) and all(isinstance(k, str) for k in group.meta)):
        _fail("meta", "expected a mapping with string keys")
    if group.source is not None:
        _check_source(group.source)


def _check_source(src: Any) -> None:
    if not isinstance(src, Source):
        _fail("source", f"expected a Source, got {_tname(src)}")
    for name in ("num_shards", "shard", "epoch", "position"):
        x = getattr(src, name)
        if not (_is_int(x) and 0 <= x <= _MAX_INDEX):
            _fail(f"source.{name}", f"expected an integer in [0, 2**63 - 1], got {x!r}")
    if src.num_shards < 1 or src.shard >= src.num_shards:
        _fail("source.shard", f"shard {src.shard} of {src.num_shards} is not a shard (0 <= shard < num_shards)")


def inline(group: ScoredGroup) -> ScoredGroup:
    """``group`` with every visual travelling as its pixels (references dropped; the frames must be here)."""
    if not any(v.ref is not None for v in group.visuals):
        return group
    return replace(group, visuals=[replace(v, ref=None) for v in group.visuals])


# -------------------------------------------------------------------------------------- encode
def _coerce(x: Any, path: str, dtype: str) -> Any:
    """Arrays of the contract dtype pass through; torch tensors, lists and safe integer/float casts convert."""
    target = _NATIVE[dtype]
    if isinstance(x, np.ndarray) and x.dtype == target:
        return x
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    try:
        arr = np.asarray(x)
    except Exception:
        return x  # validate() names the field
    if arr.dtype.kind in "iu" and target.kind in "iu":
        info = np.iinfo(target)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise WireError(f"{path}: values outside the {dtype} range")
        return arr.astype(target)
    if arr.dtype.kind == "f" and target.kind == "f":
        return arr.astype(target)
    return arr if arr.dtype != object else x


def _scalar(x: Any) -> Any:
    return x.item() if isinstance(x, np.generic) else x


def normalized(group: ScoredGroup) -> ScoredGroup:
    """A copy of ``group`` with arrays cast to the contract dtypes (int64 ids -> int32 ...), numpy scalars unboxed."""
    if not isinstance(group, ScoredGroup):
        raise WireError(f"message: expected a ScoredGroup, got {_tname(group)}")
    visuals = group.visuals
    if isinstance(visuals, list):
        visuals = [
            Visual(v.kind, None if v.frames is None else _coerce(v.frames, f"visuals[{i}].frames", "uint8"),
                   _scalar(v.fps), _coerce(v.frame_indices, f"visuals[{i}].frame_indices", "int32"), v.ref)
            if isinstance(v, Visual) else v
            for i, v in enumerate(visuals)
        ]
    completions = group.completions
    if isinstance(completions, list):
        completions = [_normalized_completion(c, i, group.policy_version) if isinstance(c, Completion) else c
                       for i, c in enumerate(completions)]
    return ScoredGroup(
        prompt_id=group.prompt_id, generator_id=group.generator_id, policy_version=_scalar(group.policy_version),
        model_id=group.model_id, prompt_ids=_coerce(group.prompt_ids, "prompt_ids", "int32"), visuals=visuals,
        answer=group.answer, completions=completions, prompt_text=group.prompt_text, meta=group.meta,
        group_id=group.group_id, created_at=_scalar(group.created_at), schema=group.schema,
        source=_normalized_source(group.source),
    )


def _normalized_source(src: Any) -> Any:
    """numpy integers unboxed (a bad source is left for :func:`validate` to name)."""
    if not isinstance(src, Source):
        return src
    return Source(*(_scalar(getattr(src, n)) for n in ("num_shards", "shard", "epoch", "position")))


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
