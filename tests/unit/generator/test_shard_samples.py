"""A generator's shard of the data (generator/loop.py ShardSamples): where it starts, and the learner's later cursors
read with each new weight version: moved to when ahead of the shard, said once when the shard is already past the
first cursor of a resumed learner."""

from __future__ import annotations

import logging

from streamgrpo.generator.loop import ShardSamples


def _shard(size: int = 10) -> ShardSamples:
    def make(at):
        epoch, position = at
        while True:
            for p in range(position, size):
                yield (epoch, p, f"record-{p}", None)
            epoch, position = epoch + 1, 0

    return ShardSamples(make, 2, 1, size, "generator-1")


def test_a_later_cursor_moves_the_shard_and_one_behind_it_is_said_once(caplog):
    caplog.set_level(logging.INFO, logger="streamgrpo.generator")
    shard = _shard()
    shard.start({(2, 1): (0, 2, 26)})  # read at start: the last allocation's cursor (a stale version came first)
    assert [c[:2] for c in shard.take(4)] == [(0, 3), (0, 4), (0, 5), (0, 6)]
    shard.move_ahead({(2, 1): (0, 2, 26)})  # a new version, the same cursor: nothing said, nothing moved
    shard.move_ahead({(2, 1): (0, 5, 28)})  # the resumed learner's cursor is behind the shard: said, not moved
    shard.move_ahead({(2, 1): (0, 6, 30)})  # later ones behind: not said again
    assert [c[:2] for c in shard.take(1)] == [(0, 7)]
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "generator-1: shard 1/2: resuming at epoch 0, record 3 of 10 (committed by the learner at step 26)"
    assert said[1:] == ["generator-1: shard 1/2: already past the data cursor committed by the learner at step 28 "
                        "(at epoch 0, record 7)"]
    shard.move_ahead({(2, 1): (1, 4, 32)})  # ahead of the shard: moved there (never back)
    assert [c[:2] for c in shard.take(2)] == [(1, 5), (1, 6)]
    assert "later data cursor: shard 1/2: resuming at epoch 1, record 5" in caplog.records[-1].getMessage()
    shard.move_ahead({(2, 1): (0, 9, 34)})
    assert [c[:2] for c in shard.take(1)] == [(1, 7)]


def test_a_shard_with_no_cursor_at_start_says_the_first_one_it_is_past(caplog):
    caplog.set_level(logging.INFO, logger="streamgrpo.generator")
    shard = _shard()
    shard.start({})
    shard.take(5)
    shard.move_ahead({(2, 1): (0, 1, 2)})
    assert "already past the data cursor committed by the learner at step 2 (at epoch 0, record 5)" in \
        caplog.records[-1].getMessage()
