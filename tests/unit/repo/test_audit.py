"""The exactly-once audit's arithmetic (streamgrpo.audit.tally) on hand-made log rows."""

from __future__ import annotations

from benchmarks.audit import read_jsonl, tally


def _produced(*ids):
    return [{"event": "produced", "group_id": g} for g in ids]


def _steps(*groups):
    return [{"event": "trained", "step": i + 1, "version": i + 1, "group_ids": list(g)} for i, g in enumerate(groups)]


def test_every_group_accounted_for_once_is_ok():
    rows = _steps(["a", "b"], ["c"]) + [{"event": "dropped", "reason": "stale", "group_id": "d"}]
    out = tally(_produced("a", "b", "c", "d", "e", "f"), rows, dead_ids={"e"}, queued_ids={"f"},
                committed_ids={"a", "b", "c"})
    assert (out.lost, out.twice, out.uncommitted, out.queued) == (0, 0, 0, 1)
    assert out.dropped == {"stale": 1, "dead_letter": 1} and out.steps == out.version == 2 and out.ok


def test_lost_twice_uncommitted_and_step_order_are_caught():
    rows = _steps(["a", "b"], ["b"]) + [{"event": "trained", "step": 2, "version": 2, "group_ids": ["c"]}]
    out = tally(_produced("a", "b", "c", "x"), rows, dead_ids=set(), queued_ids=set(), committed_ids={"a"})
    assert out.lost == 1 and out.lost_ids == ["x"]
    assert out.twice == 1 and out.twice_ids == ["b"]
    assert out.uncommitted == 2 and not out.steps_in_order and not out.ok
    assert out.line() == "lost: 1, twice: 1"


def test_a_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"event": "produced", "group_id": "a"}\n{"event": "prod')
    assert read_jsonl(p) == [{"event": "produced", "group_id": "a"}] and read_jsonl(tmp_path / "none") == []


def test_other_ranks_groups_count_toward_trained_and_twice():
    rank1 = [{"event": "trained", "step": 1, "version": 1, "group_ids": ["c"]},
             {"event": "trained", "step": 2, "version": 2, "group_ids": ["a"]}]
    out = tally(_produced("a", "b", "c"), _steps(["a"], ["b"]), set(), set(), {"a", "b", "c"}, [rank1])
    assert out.trained == 3 and out.lost == 0 and out.twice == 1 and out.twice_ids == ["a"] and out.steps == 2


def test_groups_of_a_producer_without_a_log_are_accounted_from_the_learners_reads():
    """A third-party producer keeps no audit log: the groups the learner read count as produced, so one
    read but then neither trained, dropped, dead-lettered nor queued is lost."""
    read = [{"event": "consumed", "group_id": g, "generator": "my-server"} for g in ("x1", "x2", "x3")]
    rows = read + _steps(["a", "x1"]) + [{"event": "dropped", "reason": "mismatch", "group_id": "x2"}]
    out = tally(_produced("a"), rows, dead_ids=set(), queued_ids=set(), committed_ids={"a", "x1"})
    assert out.produced == 4 and out.unlogged == 3
    assert out.lost == 1 and out.lost_ids == ["x3"] and not out.ok
    fine = tally(_produced("a"), read[:1] + _steps(["a", "x1"]), set(), set(), {"a", "x1"})
    assert fine.ok and fine.unlogged == 1 and fine.produced == 2
