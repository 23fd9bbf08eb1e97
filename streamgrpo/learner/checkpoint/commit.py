"""Checkpoint, then commit: the order that makes training exactly once, synchronous or asynchronous.

:class:`Checkpointing` holds the ``(stream id, group id)`` entries this rank trained since the last
checkpoint and commits them in Redis (``queue.commit``: marked trained, acked, deleted), with the data
cursor that checkpoint holds (``state.data_cursor`` when it was taken), only once a checkpoint holding
their training is durable on disk:

* synchronous (:meth:`Checkpointing.save` with ``wait=True``, the final checkpoint, or
  ``learner.async_checkpoint: false``): write (every rank), fsync, rename, then commit right away;
* asynchronous (``learner.async_checkpoint``, the torch backend and DeepSpeed ranks, one or many): copy
  the state to host memory (the only stall; every rank its own part), hand the copies to a background
  write (:mod:`streamgrpo.learner.checkpoint.background`, :mod:`streamgrpo.learner.checkpoint.ranks`) and go on
  training. :meth:`Checkpointing.poll`, called at every step boundary, settles the write: every rank
  says whether its part is still being written, written and fsynced, or failed (one all-reduce of a
  number per rank, only while a write is in flight; every rank gets the same answer, so every rank takes
  the same branch and no collective is left waiting). Once every rank's part is written, rank 0 renames
  ``step-N.tmp`` to ``step-N`` and tells the others; then each rank commits its entries. A write that failed
  on any rank stops every rank at that boundary with the same one-line
  :class:`~streamgrpo.learner.checkpoint.files.CheckpointWriteError`: nothing of it was committed.

A part that fails on one DeepSpeed rank *during* the checkpoint (rank 0 cannot create ``step-N.tmp``, a rank's
copy or synchronous write fails) stops every rank the same way, synchronous or asynchronous, at that step:
the ranks agree on each part (:func:`~streamgrpo.learner.checkpoint.ranks.parts_agree`) instead of waiting in
a barrier for a rank that has given up. Every failed checkpoint counts ``streamgrpo_errors_total{kind="checkpoint"}``
on every rank.

At most one write is in flight: a checkpoint due while the previous one is still being written
waits for it first (and commits it).

:attr:`Checkpointing.holding` says whether this rank holds trained groups Redis has not committed yet:
steps since the last checkpoint (:attr:`~Checkpointing.saved_step`), *or* a background write whose
commit has not happened. Under Redis memory pressure :meth:`Checkpointing.commit_now` commits both.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from streamgrpo import metrics as M
from streamgrpo.learner.checkpoint.background import FAILED, WRITING, BackgroundWrite, agree
from streamgrpo.learner.checkpoint.files import CheckpointWriteError
from streamgrpo.learner.checkpoint.ranks import fail_together
from streamgrpo.learner.distributed import DistInfo, broadcast_json, gather_json, share
from streamgrpo.learner.trainer import Learner

log = logging.getLogger("streamgrpo.learner")


class Checkpointing:
    """This rank's uncommitted entries and its checkpoint in flight (see the module docstring)."""

    def __init__(self, learner: Learner, queue, dist: DistInfo, ckpt_root: Path, *, asynchronous: bool,
                 model_card: Callable[[], str | None]):
        self.learner, self.queue, self.dist, self.root = learner, queue, dist, ckpt_root
        self.asynchronous = asynchronous
        self.model_card = model_card
        self.uncommitted: list[tuple[str, str]] = []
        self._inflight: tuple[BackgroundWrite, list[tuple[str, str]], dict] | None = None  # write, entries, cursor
        """Seconds the last :meth:`save` kept training waiting (the copy, or the whole synchronous write)."""
        self.saved_step = learner.state.step
        """The step of the last checkpoint taken (written, or being written in the background)."""

    def trained(self, entries: list[tuple[str, str]]) -> None:
        """Entries trained by the step just taken: committed with the next checkpoint."""
        self.uncommitted.extend(entries)

    def save(self, *, wait: bool = False) -> None:
        """Checkpoint ``state.step`` now (every rank calls it); commit its entries once it is durable: right
        away when ``wait`` or synchronous, else at the first :meth:`poll` after the background write ends."""
        self.finish()  # at most one in flight; its entries are committed first
        state = self.learner.state
        card = self.model_card() if self.dist.is_main else None
        if wait or not self.asynchronous:
            state.committing = [tuple(e) for part in gather_json(self.dist, self.uncommitted) for e in part]
            try:
                with counted_failure():
                    self.learner.save(self.root, model_card=card)
            finally:
                state.committing = []
            # the checkpoint is durable: so is their training, and the data cursor it holds
            self.queue.commit(self.uncommitted, step=state.step, cursor=state.data_cursor)
            self.uncommitted.clear()
        else:
            entries, step, cursor = list(self.uncommitted), state.step, dict(state.data_cursor)
            state.committing = [tuple(e) for part in gather_json(self.dist, entries) for e in part]
            try:
                with counted_failure():
                    snap = self.learner.snapshot(self.root, model_card=card)
            finally:
                state.committing = []
            self.uncommitted.clear()
            self._inflight = (BackgroundWrite(step, lambda: self.learner.write_snapshot(self.root, snap)), entries,
                              cursor)
        self.saved_step = state.step

    @property
    def in_flight(self) -> bool:
        """A background write whose groups are not committed yet."""
        return self._inflight is not None

    @property
    def holding(self) -> bool:
        """Trained groups not committed yet: steps since the last checkpoint, or a write not committed yet
        (the same on every rank: every rank checkpoints at the same steps and settles its write at the same
        boundary)."""
        return self.learner.state.step > self.saved_step or self._inflight is not None

    def commit_now(self) -> None:
        """Redis near ``maxmemory`` (every rank calls it): commit what this learner holds now. Steps since the
        last checkpoint: a synchronous checkpoint (which commits a write in flight first); otherwise wait for
        the write in flight and commit it (a background write's groups are freed only by its commit)."""
        if self.learner.state.step > self.saved_step:
            self.save(wait=True)
        else:
            self.finish()

    def poll(self) -> None:
        """At a step boundary (every rank): commit the entries of a background write that every rank has finished
        (raises the one-line error of a write that failed on any rank)."""
        if self._inflight is not None:
            self._settle(wait=False)

    def finish(self) -> None:
        """Wait for the write in flight, if any, and commit its entries (every rank; raises its error: nothing
        committed)."""
        if self._inflight is not None:
            self._settle(wait=True)

    def _settle(self, *, wait: bool) -> None:
        with counted_failure():
            self._settle_write(wait=wait)

    def _settle_write(self, *, wait: bool) -> None:
        write, entries, cursor = self._inflight
        if wait:
            write.join()
        verdict = agree([int(s) for s in share(self.dist, [write.status])[:, 0]])  # every rank: the same verdict
        if verdict == WRITING:
            return
        self._inflight = None
        if verdict == FAILED:
            write.join()  # this rank's part ends first: past fail_together's gather, no rank writes into step-N.tmp
            fail_together(self.dist, self.root, write.step, write.error)
        error = None
        try:
            self.learner.finalise_write(self.root, write.step)  # rank 0: rename step-N.tmp (DeepSpeed)
        except Exception as exc:  # noqa: BLE001 - told to every rank first: none may wait for it in a collective
            error = exc
        refused = broadcast_json(self.dist, "" if error is None else (str(error) or type(error).__name__))
        if error is not None and not isinstance(error, CheckpointWriteError):
            raise error
        if refused:  # the others commit only once rank 0 has renamed
            raise CheckpointWriteError(refused)
        try:
            self.queue.commit(entries, step=write.step, cursor=cursor)
        except BaseException:  # Redis refused (stop during an outage): the next checkpoint records and commits them
            self.uncommitted[:0] = entries
            raise


@contextlib.contextmanager
def counted_failure() -> Iterator[None]:
    """Count a failed checkpoint (``streamgrpo_errors_total{kind="checkpoint"}``) raised inside, then raise it."""
    try:
        yield
    except CheckpointWriteError:
        M.ERRORS.labels(kind="checkpoint").inc()
        raise
