"""Sharded, shuffled iteration over records that yields decoded samples and skips bad ones.

Generator K of N reads shard K: the records at positions K, K+N, K+2N, ... of the file order, so
shards are disjoint and together cover the data set. Each epoch the shard is shuffled with a
generator seeded by (seed, shard, epoch). A record whose media fail to load is logged once,
counted in ``streamgrpo_errors_total{kind="data"}`` and not tried again in later epochs (of this process).

Where a sample comes from is ``(epoch, position)``: its place in the shard's order of that epoch. A
generator sends it with each group (:class:`~streamgrpo.wire.Source`); the learner commits the furthest
one it consumed per shard with its checkpoints (the data cursor), and a restarted generator starts
after it (:func:`iter_positions` with ``start``), so a requeued run does not read the head of its shard again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np

from streamgrpo.config import DataConfig
from streamgrpo.data.records import DataError, Record
from streamgrpo.data.video import load_visuals
from streamgrpo.metrics import ERRORS
from streamgrpo.wire import Visual

log = logging.getLogger(__name__)


def shard_records(records: Sequence[Record], shard: int, num_shards: int) -> list[Record]:
    """Records ``shard``, ``shard + num_shards``, ... (disjoint shards covering everything)."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} of {num_shards} is not a valid shard")
    return list(records[shard::num_shards])


def epoch_order(n: int, seed: int, shard: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order of a shard's ``n`` records in ``epoch`` (a permutation, seeded)."""
    if not shuffle:
        return list(range(n))
    rng = np.random.default_rng([seed, shard, epoch])
    return [int(i) for i in rng.permutation(n)]


def iter_samples(records: Sequence[Record], cfg: DataConfig, **kw) -> Iterator[tuple[Record, list[Visual]]]:
    """Yield ``(record, visuals)`` for a shard: :func:`iter_positions` without the positions."""
    for _epoch, _position, record, visuals in iter_positions(records, cfg, **kw):
        yield record, visuals


def iter_positions(
    records: Sequence[Record],
    cfg: DataConfig,
    *,
    shard: int,
    num_shards: int,
    seed: int,
    epochs: float | None = None,
    factor: int,
    temporal_patch: int = 2,
    shuffle: bool = True,
    start: tuple[int, int] = (0, 0),
) -> Iterator[tuple[int, int, Record, list[Visual]]]:
    """Yield ``(epoch, position, record, visuals)`` for this shard, ``epochs`` passes (``None``: forever);
    ``position`` counts the shard's records in that epoch's order.

    ``start``: the ``(epoch, position)`` to begin at (a data cursor, :func:`~streamgrpo.data.cursor.next_position` of the last one
    consumed): exactly the tail of what a fresh iteration yields from there, ``epochs`` counted from the
    beginning. A fractional ``epochs`` stops part-way through the last pass. Records whose media fail are
    skipped (one warning each, counted); an epoch in which every record fails raises
    :class:`DataError` instead of spinning.
    """

    mine = shard_records(records, shard, num_shards)
    if not mine:
        raise DataError(None, None, f"shard {shard} of {num_shards} is empty ({len(records)} records)")
    budget = None if epochs is None else math.ceil(epochs * len(mine) - 1e-9)  # positions, bad ones included
    bad: set[str] = set()
    epoch, first = start
    if first >= len(mine):  # the shard shrank since the cursor was taken
        epoch, first = epoch + 1, 0
    consumed = epoch * len(mine) + first
    while budget is None or consumed < budget:
        good_this_epoch = 0
        order = epoch_order(len(mine), seed, shard, epoch, shuffle)
        for position in range(first, len(mine)):
            if budget is not None and consumed >= budget:
                return
            consumed += 1
            record = mine[order[position]]
            if record.id in bad:
                continue
            try:
                visuals = load_visuals(record, cfg, factor, temporal_patch)
            except DataError as exc:
                bad.add(record.id)
                ERRORS.labels(kind="data").inc()
                log.warning("skipping %s", exc)
                continue
            good_this_epoch += 1
            yield epoch, position, record, visuals
        if good_this_epoch == 0 and len(bad) == len(mine):
            raise DataError(None, None, f"no usable record in shard {shard} of {num_shards} "
                            f"(all {len(mine)} failed; see the warnings above)")
        epoch, first = epoch + 1, 0
