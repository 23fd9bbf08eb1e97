"""What a learner rank lets into a step, and how the ranks gather a step's groups.

:class:`Gate` refuses stale, rolled-back, already trained, all-equal (with
``loss.drop_zero_variance``), out-of-vocabulary and prompt-mismatched groups, each counted, audited
and released or dead-lettered; :func:`collect_groups` polls the queue in rounds that every rank
agrees on, so no rank waits in a collective for longer than one round.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

from streamgrpo import metrics as M
from streamgrpo.advantages import is_zero_variance
from streamgrpo.config import LossConfig
from streamgrpo.data.cursor import advance
from streamgrpo.learner.distributed import DistInfo, share
from streamgrpo.learner.intake.checks import reprocess, token_problem
from streamgrpo.learner.intake.media import MediaError, MediaUnavailable, MediaWatch, by_reference
from streamgrpo.learner.state import Accepted, LearnerState

log = logging.getLogger("streamgrpo.learner")
STARVED_S = 5.0  # Redis at maxmemory and no group for this long: train the groups at hand (collect_groups)


class Gate:
    """What a rank lets into a step: staleness, de-duplication, all-equal rewards (with
    ``loss.drop_zero_variance``), vocabulary, prompt re-processing.

    Visuals by reference are decoded and digest-checked by ``media``
    (:class:`~streamgrpo.learner.intake.media.MediaResolver`) before the prompt is re-processed.

    Refused groups are released (stale, rolled_back, duplicate, zero_variance, mismatch) or
    dead-lettered (invalid, poison, media_missing, media_outside, media_mismatch, size_mismatch),
    counted in ``groups_dropped{reason}`` and in :attr:`drops` (merged into the step's numbers), and
    written to the audit log. Stale drops are also logged in bursts (one line per 10 s at most).
    """

    def __init__(self, queue, loss: LossConfig, state: LearnerState, audit, processor, vocab_size: int, media=None,
                 media_watch=None, *, max_staleness: int):

        self.queue, self.loss, self.state, self.audit = queue, loss, state, audit
        self.max_staleness = int(max_staleness)  # learner.max_staleness
        self.processor, self.vocab_size = processor, vocab_size
        self.media = media  # MediaResolver: visuals by reference (None: a group by reference is dead-lettered)
        # MediaWatch: stop only when no reference resolves for a while and the media root is gone here
        self.media_watch = media_watch if media_watch is not None or media is None else MediaWatch(media.data)
        self.drops: Counter = Counter()  # this rank's drops since the last step
        self.dropped_at: dict = {}  # their sources: the data cursor counts them consumed (streamgrpo.data.cursor)
        self._stale: list[int] = []  # policy versions of stale groups not logged yet
        self._stale_logged = 0.0
        self._mismatches, self._mismatch_logged = 0, -1e9

    def admit(self, d) -> Accepted | None:
        try:
            return self._admit(d)
        finally:
            if self.media is not None:
                self.media.discard(d.stream_id)  # a group dropped early: its decode is not needed

    def _admit(self, d) -> Accepted | None:

        g, state = d.group, self.state
        M.GROUPS.labels(event="consumed").inc()
        self.audit.write({"event": "consumed", "group_id": g.group_id, "generator": g.generator_id})
        staleness = state.version - int(g.policy_version)
        if abs(staleness) > self.max_staleness:
            # ahead of the learner: made by weights of a run that was rolled back (resumed) past them
            self.drop(d.stream_id, g.group_id, "stale" if staleness > 0 else "rolled_back", source=g.source)
            self._note_stale(int(g.policy_version))
            return None
        if state.trained_recently(g.group_id):  # in this learner's checkpoint although Redis forgot it
            self.drop(d.stream_id, g.group_id, "duplicate", source=g.source)
            return None
        if self.loss.drop_zero_variance and is_zero_variance([c.reward for c in g.completions]):
            self.drop(d.stream_id, g.group_id, "zero_variance", source=g.source)  # no gradient: take another group instead
            return None
        problem = token_problem(g, self.vocab_size)
        if problem:
            self.dead_letter(d.stream_id, g, f"group {g.group_id}: {problem}", "invalid")
            return None
        if by_reference(g):
            g = self._resolve(d, g)
            if g is None:
                return None
        inputs, problem = reprocess(self.processor, g)
        if problem is not None:
            self._note_mismatch(g, d.stream_id, problem.reason)
            self.drop(d.stream_id, g.group_id, "mismatch", why=problem.reason, source=g.source)
            return None
        return Accepted(d.stream_id, g, inputs, staleness)

    def _resolve(self, d, g):
        """``g`` with its referenced visuals decoded and checked, or None: dead-lettered (the reason
        names the file); :class:`~.media.MediaWatch` decides whether this learner stops instead."""

        try:
            if self.media is None:
                raise MediaError("media_missing", "visuals by reference, and this consumer decodes none")
            resolved = self.media.resolved(d)
        except MediaError as exc:
            failure = exc
        else:
            if self.media_watch is not None:
                self.media_watch.resolved()
            return resolved
        log.warning("group %s (entry %s): %s", g.group_id, d.stream_id, failure)
        self.dead_letter(d.stream_id, g, f"group {g.group_id}: {failure}", failure.label)
        if self.media_watch is not None:
            self.media_watch.failed(failure)
        return None

    def drop(self, stream_id: str, group_id: str, reason: str, why: str | None = None, source=None) -> None:
        M.GROUPS_DROPPED.labels(reason=reason).inc()
        self.drops[reason] += 1
        self._consumed(source)
        self.audit.write({"event": "dropped", "reason": reason, "group_id": group_id, **({"why": why} if why else {})})
        self.queue.ack([stream_id])

    def dead_letter(self, stream_id: str, group, reason: str, label: str) -> None:
        self.drops[label] += 1
        self._consumed(getattr(group, "source", None))
        self.audit.write({"event": "dropped", "reason": label, "group_id": group.group_id, "why": reason})
        self.queue.dead_letter(stream_id, group, reason, label=label)

    def _consumed(self, source) -> None:
        """A dropped group's place in its shard (a :class:`~streamgrpo.wire.Source`; None: not sent) moves
        this rank's data cursor: it is consumed, as a trained one is."""
        if source is not None:
            self.dropped_at = advance(self.dropped_at, {source.key: source.at})

    def _note_mismatch(self, g, stream_id: str, why: str) -> None:
        """One warning per mismatched group, at most one per 10 s (the others counted in the next one)."""
        self._mismatches += 1
        now = time.monotonic()
        if now - self._mismatch_logged >= 10.0:
            more = f" ({self._mismatches - 1} more since the last warning)" if self._mismatches > 1 else ""
            log.warning("group %s (entry %s, generator %s) dropped as mismatch: %s%s; the generator's model, chat "
                        "template or frames are not the learner's", g.group_id, stream_id, g.generator_id, why, more)
            self._mismatches, self._mismatch_logged = 0, now

    def _note_stale(self, version: int) -> None:
        self._stale.append(version)
        now = time.monotonic()
        if now - self._stale_logged >= 10.0:
            log.warning("dropped %d stale group(s) (policy v%d..v%d; learner at v%d, max_staleness %d): "
                        "generators are not keeping up with the weights", len(self._stale), min(self._stale),
                        max(self._stale), self.state.version, self.max_staleness)
            self._stale, self._stale_logged = [], now


class MemoryWatch:
    """Rank 0: when Redis uses ``at`` of its ``maxmemory`` (read every ``every_s`` with INFO) and the
    learner holds trained groups not committed yet, say why to checkpoint now; with nothing to commit,
    warn (once a minute) that only more memory helps. Silent when Redis has no limit or refuses INFO.
    :attr:`full` says Redis used ``full_at`` of its limit at the last read (it refuses the generators)."""

    def __init__(self, queue, every_s: float = 2.0, at: float = 0.8, full_at: float = 0.95):
        self.queue, self.every_s, self.at, self.full_at = queue, every_s, at, full_at
        self._next = 0.0
        self._warned = -1e9
        self._off = False
        self.full = False

    def check(self, holding: bool) -> str | None:
        now = time.monotonic()
        if self._off or now < self._next:
            return None
        self._next = now + self.every_s
        try:
            used, limit = self.queue.memory()
        except Exception:  # noqa: BLE001 - INFO refused (ACL, managed Redis): nothing to watch
            self._off = True
            return None
        self.full = bool(limit) and used >= self.full_at * limit
        if not limit or used < self.at * limit:
            return None
        why = f"Redis uses {used / limit:.0%} of its maxmemory ({used / 2**20:.0f} of {limit / 2**20:.0f} MiB)"
        if holding:
            return why
        if now - self._warned >= 60.0:
            self._warned = now
            log.warning("%s and the learner holds nothing to commit: raise maxmemory, or lower "
                        "queue.max_pending", why)
        return None


@dataclass(frozen=True)
class CommitFirst:
    """What :func:`collect_groups` returns on every rank when Redis nears ``maxmemory``: checkpoint now so that the
    commit frees the messages the learner holds (``why``); ``carry``: the groups accepted so far, for the next step."""

    carry: list[Accepted]
    why: str


def _admit_all(gate: Gate, deliveries, accepted: list[Accepted]):
    """Admit ``deliveries`` into ``accepted``; the :class:`~.media.MediaUnavailable` that stops this rank, if
    any (the deliveries after it stay pending: read again after a restart)."""

    for d in deliveries:
        try:
            a = gate.admit(d)
        except MediaUnavailable as exc:
            return exc
        if a is not None:
            accepted.append(a)
    return None


def _stop_together(unusable, ranks) -> None:
    """Raise this rank's :class:`~.media.MediaUnavailable`, or one naming the ranks that stopped."""

    if unusable is not None:
        raise unusable
    which = ", ".join(str(r) for r in ranks.nonzero()[0].tolist())
    raise MediaUnavailable(f"stopping with learner rank(s) {which}, whose media root is unusable (their log says why)")


def collect_groups(queue, gate: Gate, stop, dist: DistInfo, want: int, carry: list[Accepted], *, timeout_s: float,
                   pressure=None, redis_full=None, reads: bool = True) -> list[Accepted] | CommitFirst | None:
    """This rank's ``want`` usable groups once every rank has its share; None when stopping.

    ``carry``: groups already accepted (kept from a failed step) that count toward ``want``. Ranks
    poll in rounds of at most ``timeout_s`` (``learner.get_timeout_s``) and agree after each round (one small
    all-reduce), so no rank waits in a collective for longer than a round. With
    ``loss.drop_zero_variance`` a step that has waited ``loss.fill_timeout_s`` trains on what it has
    once every rank holds at least one group. ``pressure`` (rank 0): a callable that returns a reason
    to checkpoint now (Redis near ``maxmemory``) or None; then every rank returns :class:`CommitFirst`.
    ``redis_full`` (rank 0): a callable, true while Redis is at ``maxmemory``; then, once no group came to
    any rank for ``STARVED_S`` and every rank holds at least one, the step trains on what the ranks hold: the
    groups held and not trained would otherwise fill Redis with nothing able to free it (its commit
    needs a step, the step more groups, and the generators are refused). ``reads`` false: a sequence-parallel
    rank that reads nothing (``want`` 0; its group's reader hands it the batch) and only takes part in the rounds.
    """
    accepted: list[Accepted] = list(carry)
    state = gate.state
    loss = gate.loss
    fill_by = time.monotonic() + loss.fill_timeout_s if loss.drop_zero_variance else math.inf
    came = time.monotonic()  # when a group last came to this rank
    while True:
        deliveries, unusable = [], None
        if len(accepted) < want and not stop:
            t0 = time.perf_counter()
            deliveries = queue.get(want - len(accepted), timeout_s=timeout_s)
            if not deliveries:
                M.IDLE_SECONDS.labels(role="learner").inc(time.perf_counter() - t0)
            unusable = _admit_all(gate, deliveries, accepted)
            if deliveries:
                came = time.monotonic()
        enough = len(accepted) >= want or (bool(accepted) and time.monotonic() >= fill_by)
        why = pressure() if pressure is not None else None  # also with a full batch: before Redis refuses
        full = bool(redis_full()) if redis_full is not None else False
        flags = share(dist, [enough, bool(stop), state.version, why is not None, full, bool(accepted) or not reads,
                             time.monotonic() - came >= STARVED_S or not reads, unusable is not None])
        if (flags[:, 2] != state.version).any():  # identical by construction; a mismatch is a bug worth stopping for
            raise RuntimeError(f"learner ranks disagree on the policy version: {flags[:, 2].astype(int).tolist()}")
        if flags[:, 7].any():  # a rank's media root is unusable: every rank stops (none waits in a collective)
            _stop_together(unusable, flags[:, 7])
        if flags[:, 3].any():  # the groups accepted so far are carried into the step after the checkpoint
            return CommitFirst(accepted, why or "rank 0 asked for an early checkpoint")
        if flags[:, 0].all():
            if len(accepted) < want:
                log.info("step %d: %d of %d groups after waiting %.0fs for informative ones (drop_zero_variance)",
                         state.step + 1, len(accepted), want, loss.fill_timeout_s)
            return accepted
        if flags[:, 1].any():
            return None  # held groups stay pending: re-read by this consumer after a restart
        if flags[:, 4].any() and flags[:, 5].all() and flags[:, 6].all():
            log.warning("step %d: Redis is at maxmemory and no group came for %.0fs: training on the %d group(s) at hand (of "
                        "%d) so that the commit can free them", state.step + 1, STARVED_S, len(accepted), want)
            return accepted
