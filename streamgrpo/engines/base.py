"""The rollout engine interface: one small abstract class, one subclass per backend (hf.py, vllm.py).

An engine turns prompt requests into G sampled completions each, with the log-probability of every
sampled token under the distribution it was actually sampled from (after temperature), and takes new
weights between generation calls. Engines know nothing about rewards, queues or configs beyond
:class:`SamplingParams`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamgrpo.wire import Visual


@dataclass(frozen=True)
class SamplingParams:
    n: int = 8  # G completions per prompt
    temperature: float = 1.0  # 0 = greedy (argmax; the n completions are identical)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @classmethod
    def from_config(cls, rollout, seed: int | None = None) -> SamplingParams:
        return cls(
            n=rollout.num_generations, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
            max_tokens=rollout.max_completion_length, stop=tuple(rollout.stop), seed=seed,
        )


@dataclass
class PromptRequest:
    """One prompt: the chat-templated text, its visuals (already resized uint8 frames) and the
    processor outputs for exactly that text and those frames (``inputs``: input_ids (1, P), ...)."""

    prompt_text: str
    visuals: list[Visual]
    inputs: Any  # transformers BatchFeature / dict of tensors for one prompt
    request_id: str = ""


@dataclass
class SampledCompletion:
    token_ids: np.ndarray  # int32 (L,), up to and including the end token when it stopped
    logprobs: np.ndarray  # float32 (L,)
    text: str
    finish_reason: str  # "stop" | "length"
    extra: dict[str, Any] = field(default_factory=dict)
    versions: np.ndarray | None = None
    """int32 (L,): the weights version each token was sampled under (stamped by the engine)."""


class Engine(ABC):
    """What a generator samples with (:class:`~.hf.HFEngine`, :class:`~.vllm.VLLMEngine`)."""

    version: int = 0
    """The weight version the engine samples with now (0: the initial weights)."""

    @abstractmethod
    def generate(self, requests: list[PromptRequest], sampling: SamplingParams,
                 between_steps: Callable[[], None] | None = None) -> list[list[SampledCompletion]]:
        """G completions for each request, in request order. An engine that can update weights in
        flight calls ``between_steps`` at safe points between decoding steps (it may call
        :meth:`load_weights`); others never call it."""

    @abstractmethod
    def load_weights(self, version: int, tensors: dict[str, Any]) -> None:
        """Apply a complete weight version (between generate calls, or from ``between_steps``)."""


class TokenVersions:
    """Which weights version sampled each token of each sequence of a batch, from the sequence
    lengths the engine reported when the weights changed (pure bookkeeping).

    ``seen(key, n)``: sequence ``key`` has ``n`` tokens so far; ``update(v)``: tokens from now on are
    sampled under ``v``; ``of(key, n)``: the int32 versions of that sequence's ``n`` tokens.
    """

    def __init__(self, version: int):
        self.start = int(version)
        self.lengths: dict[Any, int] = {}
        self.marks: list[tuple[int, dict[Any, int]]] = []

    def seen(self, key: Any, n: int) -> None:
        self.lengths[key] = int(n)

    def update(self, version: int) -> None:
        self.marks.append((int(version), dict(self.lengths)))

    def started(self, keys: list[Any]) -> bool:
        """Every sequence in ``keys`` has sampled at least one token (all are past their prefill)."""
        return all(self.lengths.get(k, 0) > 0 for k in keys)

    def of(self, key: Any, n: int) -> np.ndarray:
        out = np.full(int(n), self.start, dtype=np.int32)
        for version, lengths in self.marks:
            out[min(lengths.get(key, 0), int(n)):] = version
        return out


def cut_at_stop(token_ids: np.ndarray, stop_ids: set[int]) -> tuple[int, str]:
    """Length of a sampled row up to and including the first stop token, and the finish reason
    (``"stop"``, or ``"length"`` for a row that used its whole token budget)."""
    for i, t in enumerate(token_ids.tolist()):
        if t in stop_ids:
            return i + 1, "stop"
    return len(token_ids), "length"
