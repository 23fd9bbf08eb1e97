"""ScoredGroup: the message a generator sends the learner (the format in prose: docs/protocol.md). Its bytes are
:mod:`.codec`'s (:func:`~.codec.encode`, :func:`~.codec.decode`), its rules :mod:`.contract`'s (:func:`~.contract.validate`).

Frame layout (all integers little-endian)::

    b"SGRP"  u32 header_len  u64 body_len  header (msgpack map)  zero padding to 8  body (raw array bytes)

A visual travels as its frames or, schema 3, as a reference (``Visual.ref``, a
:class:`~streamgrpo.wire.media.MediaRef`: file, decoder, size and the digest of the pixels; the
learner decodes it again and checks the digest). Schema 2 messages (every visual inline) still decode.

The header holds every scalar, string and list of the group. Each array in it is a msgpack
extension (code 1) whose payload is ``msgpack([dtype, shape, offset, nbytes])`` pointing into the
body; every array starts at a multiple of 8 bytes. ``decode`` therefore never copies array
data: arrays are ``np.frombuffer`` views of the message (read-only when the message is ``bytes``).

Array dtypes travel as names (``uint8``, ``int32``, ``float32``, ``bfloat16`` ...). numpy has no
bfloat16, so a ``bfloat16`` array decodes as a ``torch.bfloat16`` tensor (torch is imported only
then); ``encode`` accepts numpy arrays, torch tensors (any supported dtype, bfloat16 included)
and ``ml_dtypes.bfloat16`` arrays. The fixed fields of a ScoredGroup use uint8/int32/float32; other
arrays may travel in ``meta``. No pickle: msgpack and raw bytes only.

Validation (one rule set for both directions, ``validate``) names the field, e.g.
``completions[3].logprobs: 7 values but token_ids has 8``. Any malformed input to ``decode``
raises :class:`~.arrays.WireError` and nothing else.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamgrpo.wire.media import MediaRef

LOGPROB_MIN = -1000.0  # below any sampler's reach: the smallest positive float64 is e^-745
LOGPROB_MAX = 1e-3  # a log-probability is at most 0 (this much rounding above it is allowed)
SCHEMA_VERSION = 3  # 2: per-token policy versions (Completion.versions); 3: visuals by reference (Visual.ref)
SCHEMAS = (2, 3)  # versions this build reads (a schema-2 message is a schema-3 one without references)
MAGIC = b"SGRP"
DEFAULT_MAX_BYTES = 256 << 20  # queue.max_message_mib default
__all__ = ["DEFAULT_MAX_BYTES", "LOGPROB_MAX", "LOGPROB_MIN", "MAGIC", "SCHEMAS", "SCHEMA_VERSION", "Completion",
           "MediaRef", "ScoredGroup", "Source", "Visual"]


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
