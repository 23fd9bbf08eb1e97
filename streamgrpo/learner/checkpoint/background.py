"""Asynchronous checkpoints (``learner.async_checkpoint``): copy at the step boundary, write in the background.

At a checkpoint's step boundary the learner copies what the checkpoint holds to host memory
(:func:`host_copies`: the weights, the optimizer's tensors, the schedule, the RNG states and the
learner state; into pinned buffers reused from one checkpoint to the next when they live on a GPU)
and a background thread (:class:`BackgroundWrite`) writes those copies in the usual layout
(:mod:`streamgrpo.learner.checkpoint.files`: ``step-N.tmp``, every file and folder fsynced, renamed to
``step-N``) while training goes on. The stall is the copy, not the write. This module is the torch backend's
path and what every path shares (the buffers, the writer thread, the ranks' agreement :func:`agree`);
DeepSpeed ranks capture and write their parts in :mod:`streamgrpo.learner.checkpoint.ranks`.

Exactly once is unchanged: the groups a checkpoint holds are committed in Redis by the learner's loop
only after the write has finished (renamed and fsynced), at the first step boundary after that
(:class:`~streamgrpo.learner.checkpoint.commit.Checkpointing`); at most one write is in flight (the next
checkpoint waits for it). A crash (``kill -9``) during the write leaves ``step-N.tmp``, which no
resume picks: the learner resumes from the previous complete checkpoint and trains the groups since
then again, as after any crash between checkpoints.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Snapshot:
    """A checkpoint's content in host memory, detached from the live training state."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: tuple[dict[str, torch.Tensor], dict[str, Any]] | None
    scheduler: dict[str, Any] | None
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]]
    meta: dict[str, Any]
    model_card: str | None


class HostBuffers:
    """Host copies of tensors into buffers kept for the next checkpoint (a fresh 3 GB allocation costs its page
    faults every time: 8 s against 1-2 s for a copy into warm buffers on the 2-core CPU of docs/performance.md);
    tensors on a GPU go to pinned buffers (the copy is asynchronous, one sync at the end). Tensors sharing
    storage (tied embeddings) stay shared. A buffer is reused only once the write that read it has ended
    (:class:`~streamgrpo.learner.checkpoint.commit.Checkpointing` keeps at most one in flight)."""

    def __init__(self) -> None:
        self._kept: dict[str, torch.Tensor] = {}

    def copy(self, tensors: dict[str, torch.Tensor], prefix: str = "", *, tied: bool = True) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors`` (``tied=False``: one buffer per name even where storage is shared, as a
        state tree's safetensors file needs)."""
        out: dict[str, torch.Tensor] = {}
        seen: dict[tuple[int, torch.dtype, tuple], torch.Tensor] = {}
        cuda = False
        for name, t in tensors.items():
            t = t.detach()
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if tied and key in seen:  # tied: the same host copy
                out[name] = seen[key]
                continue
            cuda = cuda or t.is_cuda
            buf = self._kept.get(prefix + name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._kept[prefix + name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            buf.copy_(t, non_blocking=t.is_cuda)
            out[name] = seen[key] = buf
        if cuda:
            torch.cuda.synchronize()
        return out


def host_optimizer(opt_flat: tuple[dict[str, torch.Tensor], dict[str, Any]], buffers: HostBuffers):
    """The optimizer's flat ``(tensors, meta)`` with the tensors copied to the host and the meta deep-copied."""
    tensors, meta = opt_flat
    return buffers.copy(tensors, prefix="optimizer/"), copy.deepcopy(meta)


WRITING, WRITTEN, FAILED = 0, 1, 2
"""A rank's background write: still writing, its files written and fsynced, or failed."""


def agree(statuses: list[int]) -> int:
    """What every rank concludes from every rank's write status (pure; the same on every rank): FAILED as soon
    as one rank failed (nothing is committed; no rank waits for the others' writes), WRITTEN once every rank's
    files are durable (the checkpoint can be renamed, then committed), else WRITING (ask again at the next step
    boundary)."""
    if any(s == FAILED for s in statuses):
        return FAILED
    return WRITTEN if statuses and all(s == WRITTEN for s in statuses) else WRITING


def first_failure(lines: list[str]) -> str:
    """The one line every rank raises when a write failed: the first failing rank's (``lines``: every rank's
    error line, empty where it did not fail), naming the rank when there are several."""
    for rank, line in enumerate(lines):
        if line:
            return line if len(lines) == 1 else f"learner rank {rank}: {line}"
    return "checkpoint write failed on a learner rank; nothing was committed"


class BackgroundWrite:
    """One checkpoint written by a thread. :meth:`result` waits and returns its folder, or re-raises the
    writer's error in the caller's thread."""

    def __init__(self, step: int, write: Callable[[], Path]):
        self.step = step
        self._write = write
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{step}", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._path = self._write()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread (result(), error)
            self._error = exc

    @property
    def status(self) -> int:
        """:data:`WRITING`, :data:`WRITTEN` or :data:`FAILED` (what this rank tells the others)."""
        if self._thread.is_alive():
            return WRITING
        return FAILED if self._error is not None else WRITTEN

    @property
    def error(self) -> BaseException | None:
        """The writer's error once it has ended (None: written, or still writing)."""
        return None if self._thread.is_alive() else self._error

    def join(self) -> None:
        """Wait for the write to end (its error, if any, stays in :attr:`error`)."""
        self._thread.join()

    def result(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path
