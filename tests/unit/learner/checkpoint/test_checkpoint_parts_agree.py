"""The pieces that let DeepSpeed ranks agree on a failed part of a checkpoint instead of waiting in a barrier, in one
process: the checkpoint engine keeps a write's error (DeepSpeed's ``save_checkpoint`` goes on to its collectives),
:func:`~streamgrpo.learner.checkpoint.ranks.parts_agree` turns it into one line (rank 0 removes ``step-N.tmp``), and a
failed checkpoint is counted. The ranks themselves: tests/integration/learner/checkpoint/test_checkpoint_rank_failures.py."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from streamgrpo.learner.checkpoint.files import (
    CheckpointWriteError,
    SafeTensorsCheckpointEngine,
    load_tree,
    staging_dir,
)
from streamgrpo.learner.checkpoint.ranks import part, parts_agree
from streamgrpo.learner.distributed import DistInfo


def test_the_engine_keeps_a_failed_write_for_the_ranks_agreement_and_writes_nothing_after_it(tmp_path):
    engine = SafeTensorsCheckpointEngine()
    engine.writing()
    engine.makedirs(str(tmp_path / "state"), exist_ok=True)
    engine.save({"a": torch.ones(2)}, str(tmp_path / "state" / "first.pt"))
    engine.save({"b": torch.ones(2)}, str(tmp_path / "missing" / "second.pt"))  # no such folder: kept, not raised
    engine.save({"c": torch.ones(2)}, str(tmp_path / "state" / "third.pt"))  # after a failure: not written
    error = engine.written()
    assert isinstance(error, Exception) and "missing" in str(error)
    assert torch.equal(load_tree(tmp_path / "state" / "first.pt")["a"], torch.ones(2))
    assert not (tmp_path / "state" / "third.pt").exists()
    with pytest.raises(Exception, match="missing"):  # no longer writing for the ranks: raises again
        engine.save({"b": torch.ones(2)}, str(tmp_path / "missing" / "second.pt"))


def test_deepspeeds_recovery_script_copy_keeps_its_error_too(tmp_path):
    class Engine:  # DeepSpeed's engine: rank 0 copies its recovery scripts inside save_checkpoint
        def _copy_recovery_script(self, save_path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), save_path)

    engine = Engine()
    ours = SafeTensorsCheckpointEngine.install(engine)
    assert engine.checkpoint_engine is ours
    ours.writing()
    engine._copy_recovery_script(str(tmp_path))
    assert isinstance(ours.written(), OSError)
    with pytest.raises(OSError):
        engine._copy_recovery_script(str(tmp_path))


def test_parts_agree_is_silent_when_every_part_succeeded_and_one_line_when_one_failed(tmp_path):
    one = DistInfo()
    staging_dir(tmp_path, 4)
    parts_agree(one, tmp_path, 4, None)
    assert (tmp_path / "step-000004.tmp").is_dir()
    failed = part(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "shard.pt")))
    with pytest.raises(CheckpointWriteError) as caught:
        parts_agree(one, tmp_path, 4, failed)
    assert str(caught.value).startswith(f"cannot write checkpoint step-000004 in {tmp_path}: No space left on device "
                                        "(shard.pt); nothing was committed")
    assert not (tmp_path / "step-000004.tmp").exists()  # rank 0 removed the shared folder


def test_a_part_that_fails_with_a_bug_keeps_its_own_traceback(tmp_path):
    bug = part(lambda: {}["missing"])
    assert isinstance(bug, KeyError)
    with pytest.raises(KeyError):
        parts_agree(DistInfo(), tmp_path, 2, bug)


def test_a_failed_checkpoint_is_counted():
    from streamgrpo.learner.checkpoint.commit import counted_failure
    from streamgrpo.metrics import ERRORS

    before = ERRORS.labels(kind="checkpoint")._value.get()
    with pytest.raises(CheckpointWriteError), counted_failure():
        raise CheckpointWriteError("cannot write checkpoint step-000002")
    with counted_failure():
        pass
    assert ERRORS.labels(kind="checkpoint")._value.get() == before + 1
