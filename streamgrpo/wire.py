"""ScoredGroup: the message a generator sends the learner (design.md §2), and its msgpack codec.

(Data classes are the contract; encode/decode are filled in by the queue/wire work.)
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 1


class WireError(ValueError):
    """A message could not be encoded or decoded; the message names the field."""


@dataclass
class Visual:
    """One video or image exactly as the generator fed it to the model (already resized)."""

    kind: str  # "video" | "image"
    frames: np.ndarray  # uint8, T x H x W x 3 (images: T == 1)
    fps: float = 0.0  # source frames per second the frames were sampled at (0 for images)
    frame_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # int32 (T,)


@dataclass
class Completion:
    token_ids: np.ndarray  # int32 (L,)
    logprobs: np.ndarray  # float32 (L,): behaviour log-prob of each sampled token
    text: str
    finish_reason: str  # "stop" | "length"
    rewards: dict[str, float]  # per reward function
    reward: float  # weighted total


@dataclass
class ScoredGroup:
    prompt_id: str
    generator_id: str
    policy_version: int
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
