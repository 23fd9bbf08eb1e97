"""What goes into vLLM and what comes out, without vLLM (pure, unit-tested without it): a
:class:`~.base.PromptRequest` as a vLLM prompt dict (videos as ``(frames, metadata)``, the processor's resize
and frame sampling turned off), our :class:`~.base.SamplingParams` as ``vllm.SamplingParams`` keyword
arguments, and vLLM's ``RequestOutput``s as :class:`~.base.SampledCompletion`s (checked against our
processor's prompt; the API: :mod:`.vllm`'s docstring).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from streamgrpo.engines.base import PromptRequest, SampledCompletion, SamplingParams
from streamgrpo.metrics import ERRORS
from streamgrpo.wire import Visual

# The processor must not resize or re-sample: the frames are already what the message carries.
MM_PROCESSOR_KWARGS: dict[str, dict[str, bool]] = {
    "images_kwargs": {"do_resize": False},
    "videos_kwargs": {"do_resize": False, "do_sample_frames": False},
}


class EngineError(RuntimeError):
    """vLLM did something the trainer cannot use (the message names the request)."""


def engine_error(msg: str) -> EngineError:
    """An :class:`EngineError` to raise, counted as ``errors{kind=engine}``."""
    ERRORS.labels(kind="engine").inc()
    return EngineError(msg)


# ------------------------------------------------------------------------------ requests (pure)
def video_item(v: Visual) -> tuple[np.ndarray, dict[str, Any]]:
    """``(frames, metadata)`` as vLLM's Qwen-VL video parser takes it; the same numbers
    :func:`streamgrpo.data.prompts.processor_inputs` gives the HF processor."""
    frames = np.ascontiguousarray(v.frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"video frames must be uint8 T x H x W x 3, got {frames.dtype} {frames.shape}")
    idx = np.asarray(v.frame_indices, dtype=np.int64).reshape(-1)
    if idx.size != frames.shape[0]:
        raise ValueError(f"video has {frames.shape[0]} frames but {idx.size} frame indices")
    fps = float(v.fps) if v.fps > 0 else 24.0
    total = int(idx.max()) + 1
    return frames, {
        "fps": fps,
        "frames_indices": [int(i) for i in idx],
        "total_num_frames": total,
        "duration": total / fps,
        "height": int(frames.shape[1]),
        "width": int(frames.shape[2]),
        "video_backend": "streamgrpo",
        "do_sample_frames": False,
    }


def image_item(v: Visual) -> np.ndarray:
    """The single frame of an image visual, H x W x 3 uint8."""
    frames = np.asarray(v.frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] != 1 or frames.shape[-1] != 3:
        raise ValueError(f"image must be uint8 1 x H x W x 3, got {frames.dtype} {frames.shape}")
    return np.ascontiguousarray(frames[0])


def build_request(req: PromptRequest) -> dict[str, Any]:
    """One vLLM prompt dict: the chat-templated text, its videos/images in placeholder order, and
    the processor kwargs that keep vLLM's processor from resizing or re-sampling them."""
    videos = [video_item(v) for v in req.visuals if v.kind == "video"]
    images = [image_item(v) for v in req.visuals if v.kind == "image"]
    other = {v.kind for v in req.visuals} - {"video", "image"}
    if other:
        raise ValueError(f"request {req.request_id!r}: unknown visual kind(s) {sorted(other)}")
    prompt: dict[str, Any] = {"prompt": req.prompt_text}
    mm: dict[str, Any] = {}
    if videos:
        mm["video"] = videos
    if images:
        mm["image"] = images
    if mm:
        prompt["multi_modal_data"] = mm
        prompt["mm_processor_kwargs"] = {k: dict(v) for k, v in MM_PROCESSOR_KWARGS.items()}
    return prompt


def sampling_kwargs(sampling: SamplingParams, *, suppress_ids: Iterable[int] = (),
                    stop_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for our :class:`SamplingParams`.

    Temperature 0 is greedy: one sequence per prompt (the engine copies it n times, as the HF
    engine does). ``logprobs=0`` asks for the sampled token's log-prob only.
    """
    greedy = sampling.temperature == 0
    kw: dict[str, Any] = {
        "n": 1 if greedy else int(sampling.n),
        "temperature": 0.0 if greedy else float(sampling.temperature),
        "top_p": 1.0 if greedy else float(sampling.top_p),
        "top_k": 0 if greedy or sampling.top_k <= 0 else int(sampling.top_k),
        "max_tokens": int(sampling.max_tokens),
        "logprobs": 0,
        "flat_logprobs": True,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,  # the HF engine's text keeps the stop string too
    }
    if sampling.stop:
        kw["stop"] = list(sampling.stop)
    stop_ids = sorted({int(i) for i in stop_ids})
    if stop_ids:
        kw["stop_token_ids"] = stop_ids
    if sampling.seed is not None:
        kw["seed"] = int(sampling.seed)
    suppress = sorted({int(i) for i in suppress_ids})
    if suppress:
        kw["logit_bias"] = {i: float("-inf") for i in suppress}
    return kw


# ------------------------------------------------------------------------------- outputs (pure)
def completion_logprobs(comp: Any) -> np.ndarray:
    """One float32 log-prob per generated token of a vLLM ``CompletionOutput``.

    ``FlatLogprobs`` (``flat_logprobs=True``, ``logprobs=0``) is read as one array; the older
    list-of-dicts form is read per position (the sampled token's entry).
    """
    ids = list(comp.token_ids)
    lps = comp.logprobs
    if lps is None:
        raise engine_error("vLLM returned no logprobs (SamplingParams.logprobs must be 0)")
    flat = getattr(lps, "logprobs", None)
    starts = getattr(lps, "start_indices", None)
    if flat is not None and starts is not None:
        values = np.asarray(flat, dtype=np.float32)
        if len(values) == len(ids):  # exactly one entry (the sampled token) per position
            return values
        first = np.asarray(starts, dtype=np.int64)[: len(ids)]  # vLLM puts the sampled token first
        if len(first) == len(ids) and np.array_equal(np.asarray(lps.token_ids)[first], ids):
            return values[first]
    return _per_position(lps, ids)


def _per_position(lps: Sequence[Mapping[int, Any]], ids: Sequence[int]) -> np.ndarray:
    out = np.empty(len(ids), dtype=np.float32)
    for i, (pos, t) in enumerate(zip(lps, ids)):
        entry = pos[t]
        out[i] = getattr(entry, "logprob", entry)
    return out


def parse_outputs(outputs: Sequence[Any], n: int, *, greedy: bool = False,
                  prompt_ids: Sequence[Sequence[int]] | None = None,
                  request_ids: Sequence[str] | None = None) -> list[list[SampledCompletion]]:
    """``RequestOutput``s (one per request, in order) -> n :class:`SampledCompletion` each.

    ``prompt_ids``: our processor's token ids per request; a request whose vLLM prompt differs is
    an :class:`EngineError` (the behaviour log-probs would belong to another prompt). Greedy
    outputs hold one sequence, copied n times. ``finish_reason`` other than stop/length (abort,
    error) is an :class:`EngineError`.
    """
    results: list[list[SampledCompletion]] = []
    for i, out in enumerate(outputs):
        rid = request_ids[i] if request_ids else str(i)
        if prompt_ids is not None:
            ours = np.asarray(prompt_ids[i]).reshape(-1)
            theirs = np.asarray(out.prompt_token_ids if out.prompt_token_ids is not None else [])
            if not np.array_equal(ours, theirs):
                raise engine_error(f"request {rid!r}: vLLM's prompt ({len(theirs)} tokens) differs from the processor's "
                            f"({len(ours)} tokens); check that vLLM and the trainer use the same processor")
        seqs = sorted(out.outputs, key=lambda c: c.index)
        if len(seqs) != (1 if greedy else n):
            raise engine_error(f"request {rid!r}: vLLM returned {len(seqs)} completions, expected {1 if greedy else n}")
        group = []
        for j in range(n):
            c = seqs[0 if greedy else j]
            if c.finish_reason not in ("stop", "length"):
                raise engine_error(f"request {rid!r}, completion {j}: vLLM finish_reason {c.finish_reason!r}")
            ids = np.asarray(c.token_ids, dtype=np.int32)
            lps = completion_logprobs(c)
            if len(lps) != len(ids):
                raise engine_error(f"request {rid!r}, completion {j}: {len(ids)} tokens but {len(lps)} logprobs")
            group.append(SampledCompletion(ids.copy(), lps.copy(), c.text, c.finish_reason,
                                           {"stop_reason": c.stop_reason} if c.stop_reason is not None else {}))
        results.append(group)
    return results


class CollectedOutput:
    """A request's final outputs gathered from a stepwise run (what :func:`parse_outputs` reads)."""

    def __init__(self, prompt_token_ids, outputs):
        self.prompt_token_ids, self.outputs = prompt_token_ids, outputs
