"""A generator that runs out of device memory halves its batch and goes on (issue 49).

``rollout.prompts_per_batch`` prompts are sampled in one engine call. When that call runs out of
memory (``torch.OutOfMemoryError``), :class:`BatchSize` frees what it can, halves the batch and
samples the same prompts again in halves (each half halved again if it still does not fit, down to
one prompt). The smaller size is kept for the following batches of this generator, so it does not
run out of memory on every batch. A call that ran out of memory produced nothing: every prompt of
the chunk gives exactly one group, in the chunk's order, whatever the retries.

Only when one prompt alone does not fit does the generator stop, with :class:`PromptDoesNotFit`:
one line naming the settings that would make it fit.

The splitting is pure (:meth:`BatchSize.run` takes the sampling function and what counts as out
of memory); :func:`is_out_of_memory` and :func:`free_memory` are the torch side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

log = logging.getLogger("streamgrpo.generator")

T = TypeVar("T")
R = TypeVar("R")


class PromptDoesNotFit(RuntimeError):
    """One prompt alone runs the rollout engine out of memory: a setting to lower (the message names them)."""


def halved(size: int) -> int:
    """The batch size after running out of memory with ``size`` prompts: half of it, rounded up (so a
    chunk splits into two halves), and at least 1."""
    return max(1, (int(size) + 1) // 2)


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (CUDA's ``torch.cuda.OutOfMemoryError`` is the same class)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError)


def free_memory() -> None:
    """Collect what the failed call left behind and give CUDA's cached blocks back (when CUDA is there)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def does_not_fit_message(name: str, cfg: Any) -> str:
    """The one line a generator stops with when one prompt does not fit: the settings that make it fit."""
    r, d = cfg.rollout, cfg.data
    return (f"{name}: one prompt does not fit in the rollout engine's memory (rollout.prompts_per_batch is already 1): "
            f"lower rollout.num_generations ({r.num_generations}), rollout.max_completion_length "
            f"({r.max_completion_length}), data.max_pixels ({d.max_pixels}) or data.max_frames ({d.max_frames})")


class BatchSize:
    """How many prompts one engine call samples; halved, and kept halved, each time a call runs out of memory.

    ``size``: the current batch size (starts at ``rollout.prompts_per_batch``); ``halvings``: how many
    times it was halved. ``on_halve(tried, new)`` is called once per halving (the warning and the metric):
    ``tried`` prompts ran out of memory, ``new`` is the size from now on."""

    def __init__(self, size: int, *, does_not_fit: str = "one prompt does not fit in memory",
                 is_oom: Callable[[BaseException], bool] = is_out_of_memory, free: Callable[[], None] = free_memory,
                 on_halve: Callable[[int, int], None] | None = None):
        if size < 1:
            raise ValueError(f"batch size {size}: at least 1")
        self.size, self.halvings = int(size), 0
        self.does_not_fit, self.is_oom, self.free, self.on_halve = does_not_fit, is_oom, free, on_halve

    def run(self, items: Sequence[T], sample: Callable[[list[T]], list[R]]) -> list[R]:
        """``sample`` over ``items`` in pieces of at most :attr:`size`, one result per item, in order.

        A piece that runs out of memory gave nothing: the size is halved and the same items are
        sampled again in smaller pieces. :class:`PromptDoesNotFit` when a piece of one item does not fit."""
        out: list[R] = []
        i = 0
        while i < len(items):
            piece = list(items[i:i + self.size])
            try:
                got = sample(piece)
            except Exception as exc:
                if not self.is_oom(exc):
                    raise
                failed = True  # the exception (and the frames holding the failed call's tensors) dies here
            else:
                failed = False
            if failed:
                self.free()
                if len(piece) == 1:
                    raise PromptDoesNotFit(self.does_not_fit) from None
                self._halve(len(piece))
                continue
            if len(got) != len(piece):
                raise RuntimeError(f"sampling {len(piece)} prompts gave {len(got)} results")
            out.extend(got)
            i += len(piece)
        return out

    def _halve(self, tried: int) -> None:
        self.size = halved(tried)
        self.halvings += 1
        if self.on_halve is not None:
            self.on_halve(tried, self.size)
