"""The crash-loop breaker's pure decisions (its Redis bookkeeping runs in tests/integration/learner/intake/test_group_limits.py
against a real redis-server and a learner killed with -9)."""

from __future__ import annotations

from types import SimpleNamespace

from streamgrpo.learner.intake.crash_loop import CrashLoopBreaker
from streamgrpo.learner.intake.death_cause import Witness, count_in, judge, oom_counter_files
from streamgrpo.transport.queue.crash_marks import CrashMarks, Mark


def _breaker(counts: dict[str, int], starts: int = 3) -> CrashLoopBreaker:
    b = CrashLoopBreaker(CrashMarks(None, "ns", "learner-1"), starts)
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
    assert b.marks.stepping_key() == "ns:stepping:learner-1" and b.marks.counts_key == "ns:crash_starts"


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
    from streamgrpo.learner.checkpoint.resume import absent_rank_consumers

    names = ["learner-0", "learner-1", "learner-2", "learner-3", "test-inspect", "learner-x"]
    assert absent_rank_consumers(names, 0, 1) == ["learner-1", "learner-2", "learner-3"]
    assert absent_rank_consumers(names, 0, 2) == ["learner-2"] and absent_rank_consumers(names, 1, 2) == ["learner-3"]
    assert absent_rank_consumers(names, 0, 4) == []
    # learner.sequence_parallel 2 on 4 ranks: ranks 0 and 2 read; a helper's consumer (learner-1 and -3 of a run
    # without it) goes to its own reader, the one that judges its crash-loop marks; an absent rank's (learner-5 of a
    # bigger run) to the reader of replica k % 2
    names.append("learner-5")
    assert absent_rank_consumers(names, 0, 4, 2) == ["learner-1"] and absent_rank_consumers(names, 1, 4, 2) == []
    assert absent_rank_consumers(names, 2, 4, 2) == ["learner-3", "learner-5"]
    assert absent_rank_consumers(names, 0, 2, 2) == ["learner-1", "learner-2", "learner-3", "learner-5"]


V1_CGROUP = "4:memory:/process_api/abc\n0::/\n"
V1_MOUNTS = ("40 30 0:40 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
             "41 30 0:41 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
V2_MOUNTS = "29 23 0:26 /kubepods/pod1/c1 /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_out_of_memory_counter_is_found_in_cgroup_v1_and_v2_and_read_from_each_format():
    assert oom_counter_files(V1_CGROUP, V1_MOUNTS) == ["/sys/fs/cgroup/unified/memory.events",
                                                      "/sys/fs/cgroup/memory/process_api/abc/memory.oom_control"]
    # a container's cgroup namespace: the mount's root is the process's own cgroup
    assert oom_counter_files("0::/kubepods/pod1/c1\n", V2_MOUNTS) == ["/sys/fs/cgroup/memory.events"]
    assert oom_counter_files("0::/\n", "") == []
    assert count_in("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n") == 7  # v1 memory.oom_control
    assert count_in("low 0\nhigh 0\nmax 3\noom 2\noom_kill 1\noom_group_kill 0\n") == 1  # v2 memory.events
    assert count_in("pgfault 9\noom_kill 0\n") == 0 and count_in("oom 2\n") is None


def test_a_kill_from_outside_is_not_the_groups_doing_and_a_crash_or_an_oom_kill_or_no_evidence_is():
    cg, host = "/sys/fs/cgroup/memory.events", "/proc/vmstat"
    then = Witness("h1", "b1", {cg: 2, host: 5})
    outside = judge(then, "h1", "b1", {cg: 2, host: 9}, None)  # another process on the host ran out of memory
    assert not outside.own and "killed from outside" in outside.why
    oom = judge(then, "h1", "b1", {cg: 3, host: 6}, None)
    assert oom.own and "oom_kill 2 -> 3" in oom.why
    assert judge(then, "h1", "b1", {cg: None, host: 6}, None).own  # its cgroup is gone: the host's counter says
    assert not judge(then, "h1", "b1", {cg: None, host: 5}, None).own
    crashed = judge(then, "h1", "b1", {cg: 2, host: 5}, "Fatal Python error: Segmentation fault")
    assert crashed.own and "Segmentation fault" in crashed.why
    for unknown in (judge(None, "h1", "b1", {}, None), judge(then, "h2", "b1", {cg: 2}, None),
                    judge(then, "h1", "b2", {cg: 2}, None), judge(then, "h1", "b1", {cg: None, host: None}, None)):
        assert unknown.own and "unknown" in unknown.why
    assert Witness.from_json(then.to_json()) == then and Witness.from_json(["old"]) is None


def test_a_mark_in_the_format_before_witnesses_still_reads():
    old = Mark.parse("learner-0", b'["g1", "g2"]', {b"g3"})
    assert (old.groups, old.reading, old.witness, old.peer) == (["g1", "g2"], ["g3"], None, False)
    new = Mark.parse("learner-0", b'{"groups": [], "witness": {"host": "h"}, "peer": true}', set())
    assert (new.groups, new.witness, new.peer) == ([], {"host": "h"}, True)
    assert Mark.parse("learner-0", b"not json", set()).groups == []
