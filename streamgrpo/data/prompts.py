"""Chat messages, the think/no_think instruction, and the processor inputs of one prompt.

The generator calls :func:`build_prompt_text` and :func:`processor_inputs`; the learner calls
:func:`processor_inputs` again with the prompt text and the frames from the message and must get
the same ``input_ids`` and pixel values. That holds because the frames are already resized to
multiples of the processor's ``patch_size * merge_size`` (the processor's own resize is turned
off), no frame sampling happens in the processor, and the video metadata (source fps, sampled
indices, frame count) is derived from the :class:`~streamgrpo.wire.Visual` alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from streamgrpo.config import DataConfig
from streamgrpo.data.records import PLACEHOLDER_RE, Record
from streamgrpo.wire import Visual

THINK_INSTRUCTION = (
    "Output the thinking process in <{think}> </{think}> and the final answer in <{answer}> </{answer}> tags, "
    "i.e., <{think}> reasoning process here </{think}> <{answer}> answer here </{answer}>."
)
NO_THINK_INSTRUCTION = "Output the final answer in <{answer}> </{answer}> tags, i.e., <{answer}> answer here </{answer}>."


def instruction(cfg: DataConfig) -> str:
    """The format instruction appended to every question (``prompt_format``, tag names)."""
    template = THINK_INSTRUCTION if cfg.prompt_format == "think" else NO_THINK_INSTRUCTION
    return template.format(think=cfg.think_tag, answer=cfg.answer_tag)


def user_content(question: str, suffix: str = "") -> list[dict[str, Any]]:
    """Qwen content items: one ``{"type": "video"|"image"}`` per placeholder, text in between, in order."""
    content: list[dict[str, Any]] = []
    pos = 0
    for m in PLACEHOLDER_RE.finditer(question):
        text = question[pos : m.start()].strip()
        if text:
            content.append({"type": "text", "text": text})
        content.append({"type": m.group()[1:-1]})
        pos = m.end()
    tail = question[pos:].strip()
    if suffix:
        tail = f"{tail} {suffix}" if tail else suffix
    if tail:
        content.append({"type": "text", "text": tail})
    return content


def build_messages(record: Record, cfg: DataConfig) -> list[dict[str, Any]]:
    """System (when configured) + user turn with the media in placeholder order and the instruction."""
    messages: list[dict[str, Any]] = []
    if cfg.system_prompt:
        messages.append({"role": "system", "content": cfg.system_prompt})
    messages.append({"role": "user", "content": user_content(record.question, instruction(cfg))})
    return messages


def build_prompt_text(processor, record: Record, cfg: DataConfig) -> str:
    """The chat-templated prompt (generation prompt added), one vision block per placeholder."""
    messages = build_messages(record, cfg)
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def vision_factors(processor) -> tuple[int, int]:
    """``(factor, temporal_patch)`` of a Qwen processor: ``patch_size * merge_size`` and the temporal patch."""
    vp = getattr(processor, "video_processor", None) or processor.image_processor
    return int(vp.patch_size) * int(vp.merge_size), int(vp.temporal_patch_size)


def _video_metadata(v: Visual) -> dict[str, Any]:
    idx = np.asarray(v.frame_indices, dtype=np.int64)
    if idx.size != v.frames.shape[0]:
        raise ValueError(f"video has {v.frames.shape[0]} frames but {idx.size} frame indices")
    return {
        "fps": float(v.fps) if v.fps > 0 else 24.0,
        "frames_indices": [int(i) for i in idx],
        "total_num_frames": int(idx.max()) + 1,
        "height": int(v.frames.shape[1]),
        "width": int(v.frames.shape[2]),
    }


def processor_inputs(processor, prompt_text: str, visuals: list[Visual]):
    """The processor's ``BatchFeature`` for one prompt and its visuals (no resize, no frame sampling).

    Keys for Qwen2.5-VL: ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (when the
    processor returns it), ``pixel_values_videos``/``video_grid_thw``/``second_per_grid_ts`` and
    ``pixel_values``/``image_grid_thw``; Qwen3-VL the same without ``second_per_grid_ts``.
    """
    factor, _tp = vision_factors(processor)
    images, videos, metadata = [], [], []
    for v in visuals:
        frames = np.asarray(v.frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"{v.kind} frames must be uint8 T x H x W x 3, got {frames.dtype} {frames.shape}")
        if frames.shape[1] % factor or frames.shape[2] % factor:
            raise ValueError(f"{v.kind} frames {frames.shape[1]}x{frames.shape[2]} are not multiples of {factor}")
        if not frames.flags.writeable:  # zero-copy views of a wire message; torch wants writable memory
            frames = frames.copy()
        if v.kind == "image":
            images.append(frames[0])
        else:
            videos.append(frames)
            metadata.append(_video_metadata(v))
    n_img = prompt_text.count(getattr(processor, "image_token", None) or "<|image_pad|>")
    n_vid = prompt_text.count(getattr(processor, "video_token", None) or "<|video_pad|>")
    if (n_img, n_vid) != (len(images), len(videos)):
        raise ValueError(f"prompt has {n_vid} video and {n_img} image blocks but {len(videos)} videos and "
                         f"{len(images)} images were given")
    kwargs: dict[str, Any] = {"text": [prompt_text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = images
        kwargs["images_kwargs"] = {"do_resize": False}
    if videos:
        kwargs["videos"] = videos
        vkw: dict[str, Any] = {"do_resize": False, "do_sample_frames": False, "video_metadata": metadata}
        if hasattr(processor.video_processor, "cap_pixels_per_frame"):
            vkw["cap_pixels_per_frame"] = False  # irrelevant without resize; silences a warning
        kwargs["videos_kwargs"] = vkw
    return processor(**kwargs)
