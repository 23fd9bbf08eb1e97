"""The ScoredGroup contract, one rule set for both directions: :func:`validate` names the first field that
breaks it (e.g. ``completions[3].logprobs: 7 values but token_ids has 8``), :func:`normalized` casts a
producer's arrays and scalars to the contract's dtypes first, :func:`inline` drops visual references.

The message itself: :mod:`.message`; its bytes: :mod:`.codec`; the format in prose: docs/protocol.md.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, NoReturn

import numpy as np

from streamgrpo.wire.arrays import _NATIVE, WireError, _is_torch
from streamgrpo.wire.media import MAX_FRAMES, check_ref
from streamgrpo.wire.message import LOGPROB_MAX, LOGPROB_MIN, SCHEMAS, Completion, ScoredGroup, Source, Visual

_MAX_VERSION = 2**31 - 1  # versions travel as int32
_MAX_INDEX = 2**63 - 1  # a data source's numbers travel as msgpack ints (int64 at most)


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


# ------------------------------------------------------------------------------------ normalization
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
