"""The crash-loop breaker's pure decisions (its Redis bookkeeping runs in tests/integration/test_group_limits.py
against a real redis-server and a learner killed with -9)."""

from __future__ import annotations

from types import SimpleNamespace

from streamgrpo.learner.crash_loop import CrashLoopBreaker


def _breaker(counts: dict[str, int], starts: int = 3) -> CrashLoopBreaker:
    b = CrashLoopBreaker(SimpleNamespace(client=None, namespace="ns", consumer="learner-1"), starts)
    b.counts = dict(counts)
    return b


def _batch(*gids: str) -> list:
    return [SimpleNamespace(group=SimpleNamespace(group_id=g)) for g in gids]


def test_the_most_counted_group_trains_alone_first_and_a_batch_without_counts_is_kept_whole():
    b = _breaker({"b": 1, "c": 2})
    step, later = b.isolate(_batch("a", "b", "c", "d"))
    assert [a.group.group_id for a in step] == ["c"] and [a.group.group_id for a in later] == ["a", "b", "d"]
    step, later = b.isolate(_batch("a", "d"))
    assert [a.group.group_id for a in step] == ["a", "d"] and later == []
    step, later = b.isolate(_batch("b"))
    assert [a.group.group_id for a in step] == ["b"] and later == []
    assert b.marker == "ns:stepping:learner-1" and b.counts_key == "ns:crash_starts"


def test_a_group_is_dead_lettered_at_crash_loop_starts_and_not_before():
    b = _breaker({"x": 2, "y": 3}, starts=3)
    assert b.verdict("x") is None and b.verdict("new") is None
    assert "in 3 consecutive starts (learner.crash_loop_starts 3)" in b.verdict("y")


def test_a_collective_failure_is_a_peers_and_a_groups_own_error_is_not():
    import torch.distributed as dist

    from streamgrpo.learner.distributed import is_peer_failure

    assert is_peer_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                                        "peer [127.0.0.1]:43521"))
    assert is_peer_failure(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert is_peer_failure(ConnectionResetError("Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_peer_failure(ValueError("token id 1000000000 is outside the model's vocabulary"))


def test_a_restarted_learner_takes_the_consumers_of_the_ranks_it_lacks_spread_over_its_ranks():
    from streamgrpo.learner.resume import absent_rank_consumers

    names = ["learner-0", "learner-1", "learner-2", "learner-3", "test-inspect", "learner-x"]
    assert absent_rank_consumers(names, 0, 1) == ["learner-1", "learner-2", "learner-3"]
    assert absent_rank_consumers(names, 0, 2) == ["learner-2"] and absent_rank_consumers(names, 1, 2) == ["learner-3"]
    assert absent_rank_consumers(names, 0, 4) == []
