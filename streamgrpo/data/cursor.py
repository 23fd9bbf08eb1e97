"""The data cursor, as pure functions: how far each generator shard got, and where a generator starts.

The learner keeps, per shard ``"<num_shards>/<shard>"``, the furthest ``(epoch, position)`` of a group it
*consumed* -- trained, or dropped / dead-lettered (gone from the queue either way) -- and commits it in
Redis with the groups of each checkpoint (and saves it in the checkpoint): it never runs ahead of what
a checkpoint holds. A generator that starts reads the committed cursor of its shard and begins at the
next position (:func:`start_for`).

Trade-off (docs/data.md): the furthest consumed position, not the first one missing. A group of an
earlier position still in the queue at a restart (read by another learner rank, carried over a step) is
not lost: Redis keeps it and the learner trains it after the restart. What the queue held and the learner
had not consumed yet is sampled again after a restart (at most about ``queue.max_pending`` records per
shard); a record is never skipped while Redis keeps its queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Cursor = dict[str, tuple[int, int]]
"""``"<num_shards>/<shard>"`` -> ``(epoch, position)`` of the furthest record consumed."""


def next_position(epoch: int, position: int, n: int) -> tuple[int, int]:
    """The ``(epoch, position)`` read after ``(epoch, position)`` in a shard of ``n`` records (a shard that
    shrank since: the next epoch)."""
    return (epoch, position + 1) if position + 1 < n else (epoch + 1, 0)


def shard_key(num_shards: int, shard: int) -> str:
    return f"{num_shards}/{shard}"


def advance(cursor: Mapping[str, Iterable[int]], seen: Mapping[str, Iterable[int]]) -> Cursor:
    """``cursor`` moved forward to ``seen`` (per shard, the later ``(epoch, position)`` of the two); never back."""
    out: Cursor = {k: (int(v[0]), int(v[1])) for k, v in ((k, tuple(v)) for k, v in cursor.items())}
    for key, at in seen.items():
        at = tuple(int(x) for x in at)
        if key not in out or at > out[key]:
            out[key] = (at[0], at[1])
    return out


def furthest(sources: Iterable) -> Cursor:
    """Per shard, the furthest ``(epoch, position)`` of ``sources`` (:class:`~streamgrpo.wire.Source` or None)."""
    out: Cursor = {}
    for s in sources:
        if s is not None and (s.key not in out or s.at > out[s.key]):
            out[s.key] = s.at
    return out


@dataclass(frozen=True)
class Start:
    """Where a generator begins its shard, and the one line that says why."""

    epoch: int
    position: int
    line: str
    warning: bool = False  # a cursor of another shard count was not used


def start_for(committed: Mapping[tuple[int, int], tuple[int, int, int]], num_shards: int, shard: int,
              shard_size: int) -> Start:
    """Where shard ``shard`` of ``num_shards`` (``shard_size`` records) starts, from the committed cursor
    (``(num_shards, shard)`` -> ``(epoch, position, step)``, :meth:`RedisQueue.committed_cursors`).

    Its own shard's cursor: the position after it. None for this shard count but cursors of another one
    (the generators were scaled): their positions are of another partition of the data, so this shard starts
    at position 0 -- of the epoch that every shard of the count committed last had reached (when all of them
    are there), so a run with ``rollout.num_epochs`` keeps its count of passes. Nothing committed: the beginning.
    """
    name = f"shard {shard}/{num_shards}"
    mine = committed.get((num_shards, shard))
    if mine is not None:
        epoch, position, step = mine
        e, p = next_position(epoch, position, shard_size)
        return Start(e, p, f"{name}: resuming at epoch {e}, record {p} of {shard_size} "
                           f"(committed by the learner at step {step})")
    others = {nk: v for nk, v in committed.items() if nk[0] != num_shards}
    if not others:
        return Start(0, 0, f"{name}: starting at epoch 0, record 0 of {shard_size} (no data cursor committed)")
    n = max(others, key=lambda nk: (others[nk][2], nk[0]))[0]  # the shard count committed last
    old = [committed[(n, k)] for k in range(n) if (n, k) in committed]
    epoch = min(e for e, _, _ in old) if len(old) == n else 0
    return Start(epoch, 0, f"{name}: the committed data cursor is for {n} shard(s) (rollout.num_generators "
                           f"changed), not {num_shards}: starting at epoch {epoch}, record 0 of {shard_size}", True)
