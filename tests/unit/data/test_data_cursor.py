"""The data cursor's pure parts: iterating a shard from ``(epoch, position)`` yields exactly the tail of a fresh
iteration, where a generator starts from what the learner committed, the cursor only moves forward (over
ranks too), the optional ``source`` of a message, and the learner state that carries the cursor."""

from __future__ import annotations

import numpy as np
import pytest

from streamgrpo.config import DataConfig
from streamgrpo.data.cursor import advance, furthest, next_position, start_for
from streamgrpo.data.dataset import iter_positions, shard_records
from streamgrpo.data.records import load_records
from streamgrpo.learner.state import LearnerState
from streamgrpo.learner.step_data import StepSummary
from streamgrpo.wire import Completion, ScoredGroup, Source, WireError, decode, encode


def _cfg() -> DataConfig:
    return DataConfig(frame_cache_mib=0)


@pytest.mark.parametrize("epochs", [None, 2.5])
def test_iterating_from_a_cursor_yields_exactly_the_tail_of_a_fresh_iteration(demo_data_dir, epochs):
    records = load_records(demo_data_dir / "train.jsonl", _cfg())
    kw = dict(shard=1, num_shards=4, seed=3, epochs=epochs, factor=28)
    n = len(shard_records(records, 1, 4))
    stop = int(np.ceil(2.5 * n)) if epochs else 2 * n + 3

    def walk(**more):
        out = []
        for epoch, position, record, _visuals in iter_positions(records, _cfg(), **kw, **more):
            out.append((epoch, position, record.id))
            if len(out) == stop:
                break
        return out

    fresh = walk()
    assert [(e, p) for e, p, _ in fresh[:n + 1]] == [(0, p) for p in range(n)] + [(1, 0)]
    assert len(fresh) == stop  # a fractional epochs budget counts from the beginning, not from the start given
    for cut in (1, n - 1, n, n + 2, stop - 1):  # mid-epoch, the last record of an epoch, the next epoch's first
        epoch, position, _ = fresh[cut - 1]  # the furthest one consumed
        tail = walk(start=next_position(epoch, position, n))
        assert tail[:len(fresh) - cut] == fresh[cut:] and (epochs is None or tail == fresh[cut:])
    assert walk(start=(0, n + 5))[0][:2] == (1, 0)  # the shard shrank since the cursor: the next epoch


def test_a_generator_starts_after_its_shards_committed_cursor():
    committed = {(4, 2): (1, 1834, 120), (4, 0): (1, 20, 120)}
    start = start_for(committed, 4, 2, 2000)
    assert (start.epoch, start.position, start.warning) == (1, 1835, False)
    assert start.line == "shard 2/4: resuming at epoch 1, record 1835 of 2000 (committed by the learner at step 120)"
    last = start_for({(4, 2): (1, 1999, 120)}, 4, 2, 2000)  # the last record of epoch 1: epoch 2 begins
    assert (last.epoch, last.position) == (2, 0)
    fresh = start_for({}, 4, 2, 2000)
    assert (fresh.epoch, fresh.position, fresh.warning) == (0, 0, False) and "no data cursor committed" in fresh.line


def test_a_cursor_of_another_shard_count_is_not_used_and_keeps_the_passes_every_old_shard_made():
    scaled = start_for({(2, 0): (3, 10, 50), (2, 1): (2, 400, 50)}, 3, 1, 500)  # kubectl scale 2 -> 3
    assert (scaled.epoch, scaled.position, scaled.warning) == (2, 0, True)
    assert scaled.line.startswith("shard 1/3: the committed data cursor is for 2 shard(s)") and "\n" not in scaled.line
    partial = start_for({(2, 0): (3, 10, 50)}, 3, 1, 500)  # shard 1 of 2 never committed: no pass is sure
    assert (partial.epoch, partial.position, partial.warning) == (0, 0, True)


def test_the_cursor_only_moves_forward_per_shard_and_merges_over_ranks():
    cursor = advance({}, {"2/0": (0, 7)})
    cursor = advance(cursor, {"2/0": (0, 3), "2/1": (1, 0)})  # an earlier position read late: no step back
    assert cursor == {"2/0": (0, 7), "2/1": (1, 0)}
    assert advance(cursor, {"2/0": [1, 0]}) == {"2/0": (1, 0), "2/1": (1, 0)}  # JSON lists (gather_json) too
    assert furthest([Source(2, 0, 0, 4), None, Source(2, 0, 0, 9), Source(2, 0, 0, 1)]) == {"2/0": (0, 9)}

    class A:  # an accepted group of a rank's batch
        def __init__(self, source):
            self.group = type("G", (), {"source": source, "completions": [], "group_id": "g"})()

    def rank(sources, dropped_at):
        s = StepSummary()
        s.consumed_at = {k: list(v) for k, v in advance(dropped_at, furthest(a.group.source for a in sources)).items()}
        return s.to_json()

    merged = StepSummary.merge([rank([A(Source(2, 0, 0, 5))], {"2/1": (0, 8)}),  # rank 0 dropped one of shard 1
                                rank([A(Source(2, 0, 0, 6)), A(Source(2, 1, 0, 2)), A(None)], {})])
    assert merged.consumed_at == {"2/0": [0, 6], "2/1": [0, 8]}


def _group(**kw) -> ScoredGroup:
    c = Completion(np.array([5, 6], np.int32), np.array([-0.5, -1.0], np.float32), "x", "stop", {"accuracy": 1.0}, 1.0)
    return ScoredGroup("rec-1", "gen-0", 3, "m", np.array([1, 2, 3], np.int32), [], "A", [c], **kw)


def test_a_message_says_where_its_prompt_came_from_and_one_without_it_still_decodes():
    got = decode(encode(_group(source=Source(4, np.int64(2), 1, 1834))))
    assert got.source == Source(4, 2, 1, 1834) and got.source.key == "4/2" and got.source.at == (1, 1834)
    assert decode(encode(_group())).source is None  # an external producer need not send it
    with pytest.raises(WireError, match=r"^source.shard: shard 4 of 4 is not a shard"):
        encode(_group(source=Source(4, 4, 0, 0)))
    with pytest.raises(WireError, match=r"^source.position: expected an integer"):
        encode(_group(source=Source(4, 1, 0, -1)))


def test_the_learner_state_carries_the_cursor_and_reads_a_checkpoint_without_one():
    state = LearnerState(step=5, data_cursor={"2/0": (1, 7)})
    back = LearnerState.from_json(state.to_json())
    assert back.data_cursor == {"2/0": (1, 7)}
    old = state.to_json()
    del old["data_cursor"]  # a checkpoint written before the cursor existed
    assert LearnerState.from_json(old).data_cursor == {}
