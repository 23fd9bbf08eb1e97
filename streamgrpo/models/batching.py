"""Training batches for Qwen-VL GRPO: G completions of one prompt (with its videos/images) per group.

A :class:`GroupInputs` holds ONE prompt as the processor returned it (token ids, patchified pixels,
grids, ``mm_token_type_ids``) and the G sampled completion token ids. :func:`build_batch` lays
several groups out as one right-padded batch, one row per completion::

    row b = [prompt of its group | completion b | pad ... pad]        (right padding)

and builds everything a forward needs without re-running the processor: ``attention_mask``,
explicit m-RoPE ``position_ids`` (3, B, L), ``mm_token_type_ids`` and, for the loss, the
completion tokens in a (B, T) layout with ``completion_mask`` (1 on completion tokens only).

Positions are computed once per group (not per row) with the model's own ``get_rope_index`` on the
unpadded prompt. Completion token i of a row gets ``last prompt position + 1 + i`` on each m-RoPE
axis: exactly the rule ``generate`` uses while decoding (and what ``get_rope_index`` gives for the
whole row, since completions are text), so recomputed log-probs match the sampling-time ones.
Caveat: for Qwen2.5-VL, when a video's temporal extent exceeds the text after it, the largest
prompt position is larger than the last one; engines that continue at ``max + 1`` (vLLM's mrope
``rope_deltas``, the original Qwen code) then disagree with transformers 5.x.

Padding never influences real tokens: right padding plus a causal mask, so pad positions only
ever come after the tokens that matter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from streamgrpo.metrics import ERRORS
from streamgrpo.models.capabilities import capabilities

log = logging.getLogger(__name__)

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen's vision placeholder tokens; none of them may appear in a completion."""

_VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


class BatchError(ValueError):
    """A group cannot be turned into a training batch (the message names the group and row)."""


def unwrap_model(model: Any) -> torch.nn.Module:
    """The transformers ``*ForConditionalGeneration`` inside DeepSpeed/DDP/peft wrappers.

    peft injects LoRA layers in place, so calling the unwrapped modules still uses the adapters
    (and honours ``disable_adapter()``).
    """
    m = model
    for _ in range(8):
        if callable(getattr(m, "get_base_model", None)):  # peft
            m = m.get_base_model()
        elif isinstance(getattr(m, "module", None), torch.nn.Module) and not hasattr(m, "lm_head"):  # DeepSpeed, DDP
            m = m.module
        else:
            break
    if not (hasattr(m, "model") and hasattr(m, "lm_head")):
        raise TypeError(f"{type(m).__name__} is not a transformers Qwen-VL *ForConditionalGeneration model")
    return m


# ------------------------------------------------------------------------------- vision inputs


def _fail(msg: str) -> BatchError:
    ERRORS.labels(kind="batch").inc()
    return BatchError(msg)


# --------------------------------------------------------------------------------- pure helpers
def truncate_at_eos(ids: Any, eos_id: int | Iterable[int]) -> Any:
    """Cut ``ids`` after the first end token, keeping the end token itself (it is trained on).

    ``ids`` may be a list/tuple of ints, a 1-D tensor or a 1-D numpy array; the same kind comes back.
    ``eos_id`` is one id or several (any of them ends the completion). No end token: unchanged.
    """
    eos = {int(eos_id)} if isinstance(eos_id, int) else {int(e) for e in eos_id}
    if isinstance(ids, Tensor):
        hit = torch.isin(ids, torch.tensor(sorted(eos), dtype=ids.dtype, device=ids.device)).nonzero()
        return ids[: int(hit[0, 0]) + 1] if hit.numel() else ids
    for i, t in enumerate(ids.tolist() if hasattr(ids, "tolist") else ids):
        if int(t) in eos:
            return ids[: i + 1]
    return ids


def pad_right(seqs: Sequence[Any], pad_value: float | int, *, length: int | None = None,
              dtype: torch.dtype | None = None) -> Tensor:
    """Stack variable-length 1-D sequences into (N, length) with right padding (``length`` >= max)."""
    rows = [torch.as_tensor(s) for s in seqs]
    if dtype is None:
        dtype = rows[0].dtype if rows else torch.long
    n = max((len(r) for r in rows), default=0) if length is None else length
    out = torch.full((len(rows), n), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r) > n:
            raise ValueError(f"pad_right: row {i} has {len(r)} items, more than length={n}")
        out[i, : len(r)] = r.to(dtype)
    return out


def vision_token_ids(source: Any) -> list[int]:
    """Ids of Qwen's vision special tokens, to suppress when sampling (``suppress_tokens``).

    ``source`` is a processor, a tokenizer, a model or a model config. With a tokenizer the five
    tokens of :data:`VISION_TOKENS` that exist in its vocabulary are returned; with a config the
    ids it names (image/video pad, vision start/end).
    """
    tok = getattr(source, "tokenizer", source)
    if hasattr(tok, "convert_tokens_to_ids") and hasattr(tok, "get_vocab"):
        vocab = tok.get_vocab()
        return sorted({vocab[t] for t in VISION_TOKENS if t in vocab})
    cfg = getattr(source, "config", source)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    ids = {getattr(cfg, n, None) for n in names} - {None}
    if not ids:
        raise TypeError(f"vision_token_ids: {type(source).__name__} is neither a tokenizer/processor nor a Qwen-VL config")
    return sorted(int(i) for i in ids)


# ------------------------------------------------------------------------------------ groups
@dataclass
class GroupInputs:
    """One prompt (processor outputs, batch dimension removed) and its G completions.

    Shapes: ``prompt_ids`` (P,); ``mm_token_type_ids`` (P,) (0 text, 1 image, 2 video) or None;
    ``pixel_values`` (n_image_patches, C*t*p*p) with ``image_grid_thw`` (n_images, 3);
    ``pixel_values_videos`` / ``video_grid_thw`` likewise, ``second_per_grid_ts`` (n_videos,)
    (Qwen2.5-VL); ``completion_ids``: G 1-D tensors of any length, already cut at the end token.
    ``prompt_position_ids`` (3, P) caches the m-RoPE positions (filled by :func:`build_batch`).
    """

    prompt_ids: Tensor
    completion_ids: list[Tensor]
    mm_token_type_ids: Tensor | None = None
    pixel_values: Tensor | None = None
    image_grid_thw: Tensor | None = None
    pixel_values_videos: Tensor | None = None
    video_grid_thw: Tensor | None = None
    second_per_grid_ts: Tensor | None = None
    prompt_position_ids: Tensor | None = None

    @classmethod
    def from_processor(cls, features: Mapping[str, Any], completion_ids: Sequence[Any]) -> GroupInputs:
        """From the processor's output for ONE prompt (batch size 1, no padding) and the completions."""
        ids = torch.as_tensor(features["input_ids"])
        if ids.ndim == 2:
            if ids.shape[0] != 1:
                raise _fail(f"GroupInputs.from_processor: expected one prompt, got input_ids of shape {tuple(ids.shape)}")
            mask = features.get("attention_mask")
            if mask is not None and not bool(torch.as_tensor(mask).all()):
                raise _fail("GroupInputs.from_processor: the prompt is padded; process one prompt without padding")
            ids = ids[0]
        mm = features.get("mm_token_type_ids")
        if mm is not None:
            mm = torch.as_tensor(mm)
            mm = mm[0] if mm.ndim == 2 else mm
        kw = {k: torch.as_tensor(features[k]) for k in _VISUAL_KEYS if features.get(k) is not None}
        comps = [torch.as_tensor(c, dtype=torch.long).reshape(-1) for c in completion_ids]
        return cls(prompt_ids=ids.long(), completion_ids=comps, mm_token_type_ids=mm, **kw)

    @property
    def num_completions(self) -> int:
        return len(self.completion_ids)

    def visual_kwargs(self) -> dict[str, Tensor]:
        """The visual tensors present, by the model's forward argument names."""
        return {k: getattr(self, k) for k in _VISUAL_KEYS if getattr(self, k) is not None}

    def to(self, device: torch.device | str) -> GroupInputs:
        moved = {f.name: _move(getattr(self, f.name), device) for f in fields(self)}
        return replace(self, **moved)


def _move(x: Any, device: torch.device | str) -> Any:
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, list):
        return [_move(v, device) for v in x]
    return x


def _vl_config(model: Any) -> Any:
    return unwrap_model(model).config


def validate_group(group: GroupInputs, config: Any, where: str = "group") -> None:
    """Raise :class:`BatchError` (counted as ``errors_total{kind="batch"}``) if ``group`` is unusable.

    Checks: 1-D prompt, placeholder counts equal to the visual grids, completions free of vision
    tokens and inside the vocabulary.
    """
    if group.prompt_ids.ndim != 1 or group.prompt_ids.numel() == 0:
        raise _fail(f"{where}: prompt_ids must be a non-empty 1-D tensor, got shape {tuple(group.prompt_ids.shape)}")
    merge = int(config.vision_config.spatial_merge_size) ** 2
    for kind, grid, tok in (("image", group.image_grid_thw, config.image_token_id),
                            ("video", group.video_grid_thw, config.video_token_id)):
        n_tok = int((group.prompt_ids == tok).sum())
        n_feat = 0 if grid is None else int(grid.prod(-1).sum()) // merge
        if n_tok != n_feat:
            raise _fail(f"{where}: prompt has {n_tok} {kind} placeholder tokens but the {kind} grids give {n_feat}")
    banned = torch.tensor(vision_token_ids(config), dtype=torch.long, device=group.prompt_ids.device)
    vocab = int(getattr(config, "text_config", config).vocab_size)
    for i, c in enumerate(group.completion_ids):
        if c.ndim != 1:
            raise _fail(f"{where}, completion {i}: token ids must be 1-D, got shape {tuple(c.shape)}")
        if c.numel() and bool(torch.isin(c, banned.to(c.device)).any()):
            raise _fail(f"{where}, completion {i}: contains a vision token (ids {banned.tolist()}); "
                        "suppress them when sampling (models.batching.vision_token_ids)")
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= vocab):
            raise _fail(f"{where}, completion {i}: token id outside [0, {vocab})")


def mm_token_types(prompt_ids: Tensor, config: Any) -> Tensor:
    """``mm_token_type_ids`` from the placeholder tokens: 0 text, 1 image, 2 video."""
    out = torch.zeros_like(prompt_ids, dtype=torch.long)
    out[prompt_ids == config.image_token_id] = 1
    out[prompt_ids == config.video_token_id] = 2
    return out


def prompt_positions(model: Any, group: GroupInputs) -> Tensor:
    """m-RoPE positions (3, P) of the group's prompt from the model's own ``get_rope_index``."""
    hf = unwrap_model(model)
    inner = getattr(hf, "model", hf)
    if not hasattr(inner, "get_rope_index"):
        raise TypeError(f"{type(hf).__name__} has no get_rope_index: not a Qwen-VL model")
    caps = capabilities(hf)
    if not caps.rope_index:
        raise TypeError(f"{type(inner).__name__}.get_rope_index takes no mm_token_type_ids on transformers "
                        f"{caps.release}: install a release in pyproject.toml's range")
    mm = group.mm_token_type_ids if group.mm_token_type_ids is not None else mm_token_types(group.prompt_ids, hf.config)
    cpu = torch.device("cpu")
    kw = {k: v.to(cpu) for k, v in group.visual_kwargs().items() if k.endswith("_thw") or k == "second_per_grid_ts"}
    with torch.no_grad():
        pos, _ = inner.get_rope_index(group.prompt_ids.to(cpu)[None], mm_token_type_ids=mm.to(cpu)[None], **kw)
    return pos[:, 0].long()


# ------------------------------------------------------------------------------------- batch
@dataclass
class TrainBatch:
    """Right-padded batch of B = sum(G) rows (group-major), each ``prompt | completion | pad``.

    Shapes: ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (B, L); ``position_ids``
    (3, B, L), None until :func:`prepare_batch` has seen the model; ``completion_ids``,
    ``completion_mask`` (bool), ``logit_index`` (B, T) with T the longest completion:
    ``logit_index[b, t]`` is the sequence position whose logits predict completion token t
    (``prompt_len - 1 + t``; 0 where masked). ``row_group`` (B,) maps rows to ``groups``, whose
    visual tensors are used once per group. ``validated``: the groups passed :func:`validate_group`.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor | None
    mm_token_type_ids: Tensor | None
    completion_ids: Tensor
    completion_mask: Tensor
    logit_index: Tensor
    prompt_lens: Tensor
    completion_lens: Tensor
    row_group: Tensor
    groups: list[GroupInputs]
    validated: bool = False
    vision_cache: dict | None = field(default=None, repr=False, compare=False)
    """A dict to keep a frozen vision trunk's outputs in for every forward of this batch
    (:mod:`streamgrpo.models.vision_trunk`); None: none kept. The learner gives each micro-batch one."""
    head_chunks: int = 0
    """The LM head's calls every forward of this batch makes at least (:func:`~streamgrpo.models.logprobs.
    chunked_token_logprobs`' ``min_chunks``): under DeepSpeed ZeRO-3 on several ranks, the most any rank's
    micro-batch needs; 0: as many as its own tokens need."""
    one_vision_call: bool = False
    """The batch's images and videos through the vision encoder in one call (:func:`~streamgrpo.models.
    vision_inputs.encode_once`): under DeepSpeed ZeRO-3 on several ranks every rank then calls it once a forward,
    whichever kinds its micro-batch holds; False: a call per kind."""
    vision_stand_in: bool = False
    """No visual in this batch while another rank's micro-batch has one (DeepSpeed ZeRO-3 on several ranks): the
    encoder runs over a stand-in, joined to the embeddings times zero (:func:`~streamgrpo.models.vision_inputs.
    encode_once`)."""

    padding_side = "right"

    @property
    def completion_mask_BT(self) -> Tensor:  # noqa: N802 (shape suffix)
        return self.completion_mask

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in the batch."""
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        """A copy on ``device`` (visual tensors of the groups included)."""
        moved = {f.name: _move(getattr(self, f.name), device) for f in fields(self)
                 if f.name not in ("groups", "vision_cache")}
        cache = None if self.vision_cache is None else {}  # what was kept is on the old device
        return replace(self, groups=[g.to(device) for g in self.groups], vision_cache=cache, **moved)


def build_batch(groups: Sequence[GroupInputs], pad_token_id: int, model: Any = None) -> TrainBatch:
    """Lay ``groups`` out as one right-padded :class:`TrainBatch` (rows group-major).

    With ``model`` (the policy, any wrapper) the groups are validated against its config and the
    m-RoPE positions computed right away (:func:`prepare_batch`); without it that happens on the
    first :func:`~streamgrpo.models.logprobs.completion_logprobs` call. Completions must already be
    cut at the end token (:func:`truncate_at_eos`).
    """
    if not groups:
        raise _fail("build_batch: no groups")
    rows, row_group, p_lens, c_lens = [], [], [], []
    for gi, g in enumerate(groups):
        for c in g.completion_ids:
            rows.append((g, c.long().cpu()))
            row_group.append(gi)
            p_lens.append(g.prompt_ids.numel())
            c_lens.append(c.numel())
    if not rows:
        raise _fail("build_batch: the groups have no completions")
    B = len(rows)
    L = max(p + c for p, c in zip(p_lens, c_lens))
    T = max(c_lens)
    input_ids = torch.full((B, L), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    with_mm = any(g.mm_token_type_ids is not None for g in groups)
    mm_types = torch.zeros((B, L), dtype=torch.long) if with_mm else None
    t_idx = torch.arange(T)
    for b, (g, c) in enumerate(rows):
        P, C = p_lens[b], c_lens[b]
        input_ids[b, :P] = g.prompt_ids
        input_ids[b, P : P + C] = c
        attention_mask[b, : P + C] = 1
        if mm_types is not None and g.mm_token_type_ids is not None:
            mm_types[b, :P] = g.mm_token_type_ids
    c_lens_t = torch.tensor(c_lens, dtype=torch.long)
    p_lens_t = torch.tensor(p_lens, dtype=torch.long)
    completion_mask = t_idx[None, :] < c_lens_t[:, None]
    completion_ids = pad_right([c for _, c in rows], int(pad_token_id), length=T, dtype=torch.long)
    logit_index = torch.where(completion_mask, p_lens_t[:, None] - 1 + t_idx[None, :], torch.zeros((), dtype=torch.long))
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=None,
        mm_token_type_ids=mm_types,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logit_index=logit_index,
        prompt_lens=p_lens_t,
        completion_lens=c_lens_t,
        row_group=torch.tensor(row_group, dtype=torch.long),
        groups=list(groups),
    )
    if model is not None or all(g.prompt_position_ids is not None for g in groups):
        prepare_batch(batch, model)
    return batch


def prepare_batch(batch: TrainBatch, model: Any = None) -> TrainBatch:
    """Validate the groups against ``model``'s config and fill ``batch.position_ids``, in place; idempotent.

    Each group's prompt positions come from the model's own ``get_rope_index`` once (cached on the
    group as ``prompt_position_ids``); completion token i of a row gets ``last prompt position +
    1 + i`` on each axis, as in ``generate``. Raises :class:`BatchError` naming the bad group.
    """
    if not batch.validated and model is not None:
        config = _vl_config(model)
        for gi, g in enumerate(batch.groups):
            validate_group(g, config, where=f"group {gi}")
        batch.validated = True
    if batch.position_ids is not None:
        return batch
    B, L = batch.input_ids.shape
    position_ids = torch.zeros((3, B, L), dtype=torch.long)
    for gi, g in enumerate(batch.groups):
        if g.prompt_position_ids is None:
            if model is None:
                raise _fail(f"group {gi} has no prompt_position_ids; pass the model to compute them")
            g.prompt_position_ids = prompt_positions(model, g)
        if tuple(g.prompt_position_ids.shape) != (3, g.prompt_ids.numel()):
            raise _fail(f"group {gi}: prompt_position_ids shape {tuple(g.prompt_position_ids.shape)} "
                        f"!= (3, {g.prompt_ids.numel()})")
    for b, gi in enumerate(batch.row_group.tolist()):
        pos = batch.groups[gi].prompt_position_ids.cpu()
        P = pos.shape[1]
        position_ids[:, b, :P] = pos
        # completion (and trailing pad) positions: last prompt position + 1 + i per axis, as in generate
        position_ids[:, b, P:] = pos[:, -1:] + 1 + torch.arange(L - P)[None, :]
    batch.position_ids = position_ids.to(batch.input_ids.device)
    return batch
