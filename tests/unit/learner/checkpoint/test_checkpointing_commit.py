"""Checkpoint, then commit (:class:`streamgrpo.learner.checkpoint.commit.Checkpointing`) with stand-ins for the
learner and the queue: what a learner holds uncommitted, and what an early commit under Redis pressure does
while a background write is in flight (its groups are freed only by its commit)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from streamgrpo.learner.checkpoint.commit import Checkpointing
from streamgrpo.learner.distributed import DistInfo
from streamgrpo.learner.state import LearnerState


class FakeLearner:
    def __init__(self, release: threading.Event):
        self.state = LearnerState()
        self.release = release
        self.sync_saves: list[int] = []
        self.written: list[int] = []
        self.finalised: list[int] = []

    def save(self, root, model_card=None):
        self.sync_saves.append(self.state.step)
        self.recorded = list(self.state.committing)

    def snapshot(self, root=None, model_card=None):
        return SimpleNamespace(step=self.state.step)

    def finalise_write(self, root, step):
        self.finalised.append(step)

    def write_snapshot(self, root, snap):
        self.release.wait(5)
        self.written.append(snap.step)
        return root


class FakeQueue:
    def __init__(self):
        self.commits: list[tuple[list, int]] = []
        self.cursors: list[dict] = []  # the data cursor of each commit

    def commit(self, entries, step=None, cursor=None):
        self.commits.append((list(entries), step))
        self.cursors.append(dict(cursor or {}))
        return len(entries)


def _ckpts(release):
    learner, queue = FakeLearner(release), FakeQueue()
    c = Checkpointing(learner, queue, DistInfo(), "/nonexistent", asynchronous=True, model_card=lambda: None)
    return c, learner, queue


def test_a_background_write_is_held_until_its_commit_and_commit_now_commits_it():
    release = threading.Event()
    c, learner, queue = _ckpts(release)
    assert not c.holding
    learner.state.step = 1
    c.trained([("1-0", "g1")])
    assert c.holding
    c.save()  # asynchronous: the write is in flight, nothing committed
    assert c.saved_step == 1 and c.in_flight and c.holding and queue.commits == []
    release.set()
    c.commit_now()  # no step since the checkpoint: wait for the write and commit it, no second checkpoint
    assert queue.commits == [([("1-0", "g1")], 1)] and learner.sync_saves == [] and learner.written == [1]
    assert not c.holding and not c.in_flight


def test_a_background_write_commits_the_data_cursor_of_its_checkpoint_not_a_later_one():
    """The cursor goes with the groups the checkpoint holds: steps trained while it is written move the
    learner's cursor, and a commit of that one would run ahead of what the checkpoint holds."""
    release = threading.Event()
    c, learner, queue = _ckpts(release)
    learner.state.step, learner.state.data_cursor = 1, {"2/0": (0, 5), "2/1": (0, 3)}
    c.trained([("1-0", "g1")])
    c.save()
    learner.state.step, learner.state.data_cursor = 2, {"2/0": (0, 9), "2/1": (1, 0)}  # trained meanwhile
    c.trained([("2-0", "g2")])
    release.set()
    c.finish()
    assert queue.commits == [([("1-0", "g1")], 1)] and queue.cursors == [{"2/0": (0, 5), "2/1": (0, 3)}]
    c.save(wait=True)
    assert queue.commits[-1] == ([("2-0", "g2")], 2) and queue.cursors[-1] == {"2/0": (0, 9), "2/1": (1, 0)}


def test_commit_now_after_more_steps_checkpoints_synchronously_and_commits_everything():
    release = threading.Event()
    c, learner, queue = _ckpts(release)
    learner.state.step = 1
    c.trained([("1-0", "g1")])
    c.save()
    learner.state.step = 2
    c.trained([("2-0", "g2")])
    release.set()
    c.commit_now()
    assert queue.commits == [([("1-0", "g1")], 1), ([("2-0", "g2")], 2)] and learner.sync_saves == [2]
    assert c.saved_step == 2 and not c.holding


def test_a_commit_refused_after_a_background_write_leaves_its_entries_to_the_next_checkpoint():
    from streamgrpo.transport.queue.base import QueueStopped

    release = threading.Event()
    release.set()
    c, learner, queue = _ckpts(release)
    learner.state.step = 1
    c.trained([("1-0", "g1")])
    c.save()
    real, calls = queue.commit, []

    def refuse_once(entries, step=None, cursor=None):
        calls.append(step)
        if len(calls) == 1:
            raise QueueStopped("stop requested while redis was unavailable")
        return real(entries, step, cursor)

    queue.commit = refuse_once
    try:
        c.finish()
    except QueueStopped:
        pass
    else:
        raise AssertionError("the refused commit should raise")
    learner.state.step = 2
    c.trained([("2-0", "g2")])
    c.save(wait=True)  # the final checkpoint: it records (committing) and commits step 1's entries too
    assert queue.commits == [([("1-0", "g1"), ("2-0", "g2")], 2)]
    assert learner.recorded == [("1-0", "g1"), ("2-0", "g2")]  # a resume from step 2 would roll them forward


def test_the_ranks_agree_on_a_write_only_when_every_rank_has_written_and_stop_together_on_one_failure():
    from streamgrpo.learner.checkpoint.background import FAILED, WRITING, WRITTEN, agree, first_failure

    assert agree([WRITTEN]) == WRITTEN and agree([WRITING]) == WRITING
    assert agree([WRITTEN, WRITING]) == WRITING  # rank 1 still writes: nobody renames or commits
    assert agree([WRITTEN, WRITTEN, WRITTEN]) == WRITTEN
    assert agree([WRITING, FAILED]) == FAILED  # no rank waits for the others' writes to end after a failure
    assert agree([]) == WRITING
    assert first_failure(["", "cannot write checkpoint step-000002 in /x: No space left on device"]) == \
        "learner rank 1: cannot write checkpoint step-000002 in /x: No space left on device"
    assert first_failure(["disk full"]) == "disk full"  # one rank: its own line


def test_a_failed_background_write_raises_its_one_line_error_and_commits_nothing():
    import pytest

    from streamgrpo.learner.checkpoint.files import CheckpointWriteError

    release = threading.Event()
    c, learner, queue = _ckpts(release)

    def fail(root, snap):
        raise CheckpointWriteError("cannot write checkpoint step-000001 in /x: No space left on device")

    learner.write_snapshot = fail
    learner.state.step = 1
    c.trained([("1-0", "g1")])
    c.save()
    with pytest.raises(CheckpointWriteError, match="^cannot write checkpoint step-000001"):
        c.finish()
    assert queue.commits == [] and learner.finalised == [] and not c.in_flight


def test_a_write_is_committed_only_after_it_is_finalised():
    release = threading.Event()
    c, learner, queue = _ckpts(release)
    learner.state.step = 1
    c.trained([("1-0", "g1")])
    c.save()
    c.poll()  # still writing: nothing finalised, nothing committed
    assert learner.finalised == [] and queue.commits == [] and c.in_flight
    release.set()
    c.finish()
    assert learner.finalised == [1] and queue.commits == [([("1-0", "g1")], 1)]


def test_host_buffers_are_reused_and_a_state_tree_gets_one_buffer_per_name():
    import torch

    from streamgrpo.learner.checkpoint.background import HostBuffers

    live = torch.randn(8, 4)
    host = HostBuffers()
    first = host.copy({"a": live, "b": live}, prefix="x/")
    assert first["a"] is first["b"] and first["a"].data_ptr() != live.data_ptr()
    live.add_(1.0)
    second = host.copy({"a": live, "b": live}, prefix="x/")
    assert second["a"].data_ptr() == first["a"].data_ptr() and torch.equal(second["a"], live)
    tree = host.copy({"a": live, "b": live}, prefix="t/", tied=False)
    assert tree["a"].data_ptr() != tree["b"].data_ptr() and torch.equal(tree["a"], tree["b"])


def test_a_rename_that_fails_commits_nothing():
    import pytest

    from streamgrpo.learner.checkpoint.files import CheckpointWriteError

    release = threading.Event()
    release.set()
    c, learner, queue = _ckpts(release)

    def refuse(root, step):
        raise CheckpointWriteError(f"cannot write checkpoint step-{step:06d} in /x: Read-only file system")

    learner.finalise_write = refuse
    learner.state.step = 1
    c.trained([("1-0", "g1")])
    c.save()
    with pytest.raises(CheckpointWriteError, match="Read-only file system"):
        c.finish()
    assert queue.commits == [] and not c.in_flight
