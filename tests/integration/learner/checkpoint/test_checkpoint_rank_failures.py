"""A part of a checkpoint that fails on one DeepSpeed rank stops every rank at once, with one line, and loses no
checkpoint: rank 0 that cannot create ``step-N.tmp`` (asynchronous checkpoint), rank 1 whose part of a synchronous
DeepSpeed save fails (a full disk). Before, the other rank waited in a barrier (the process group's timeout is an
hour) or was killed by torchrun without a word, and rank 1 removed the folder the ranks share.

Real parts: redis-server, the tiny Qwen2.5-VL, two DeepSpeed ZeRO-2 ranks on the CPU (gloo) under torchrun, the
``streamgrpo learner`` CLI; the failure is a monkeypatch in the failing rank's process only
(tests/integration/learner/checkpoint/checkpoint_write_driver.py). Then ``--resume`` from the previous checkpoint trains every group
exactly once (the audit).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_async_checkpoint_ranks import DRIVER, _audit, _cfg

from tests.integration.learner.test_learner_scale import ENV, _jsonl, _put, _torchrun
from tests.sessions import run_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 16, num_generations=4, max_tokens=6)


def _fails_on_every_rank(cfg: Path, tmp_path: Path, *inject: str, resume: bool = False) -> str:
    """Two ranks under torchrun with ``inject`` (driver options); they must both stop on their own, well within
    the process group's timeout (an hour), with the same one line. Returns that line."""
    from streamgrpo.runtime.processes import free_port

    # torchrun stops the other ranks once one has exited, at its next look (every 0.1 s by default): a loaded box's
    # slower rank was stopped before it said its line; every 3 s leaves it the time to stop on its own
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "--monitor-interval", "3", DRIVER, *inject, "--out", str(tmp_path),
           "learner", "--config", str(cfg), *(["--resume"] if resume else [])]
    out = run_session(cmd, env=ENV, cwd=tmp_path, timeout=240)
    text = out.stdout + out.stderr
    (tmp_path / "torchrun-failed.log").write_text(text)
    assert out.returncode != 0, text[-4000:]
    lines = [line for line in text.splitlines() if line.startswith("streamgrpo learner:")]
    assert len(lines) == 2 and lines[0] == lines[1], text[-6000:]  # each rank says it itself: none was killed
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-6000:]  # torchrun's own: fine
    return lines[0]


def _resumes_exactly_once(cfg: Path, tmp_path: Path, url: str, ns: str, run: Path) -> None:
    _torchrun("-m", "streamgrpo", "learner", "--config", str(cfg), "--resume", cwd=tmp_path)
    resumed = [r["step"] for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "resumed"]
    assert resumed == [2, 2]  # the checkpoint before the ones that failed (the second failure: after a resume)
    audit, held, depth = _audit(run, url, ns)
    assert (audit.lost, audit.twice, audit.uncommitted, audit.trained, audit.steps, held, depth) == \
        (0, 0, 0, 16, 4, 0, 0), audit
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]


def _stopped_at_4(run: Path, url: str, ns: str) -> None:
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002"]  # no step-4, not even its .tmp
    with RedisQueue(url, namespace=ns, consumer="test-inspect") as q:
        assert q.committed_step() == 2


def test_a_checkpoint_part_failing_on_either_rank_stops_both_in_one_line_and_resumes_exactly_once(
        groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    """Rank 0 that cannot stage an asynchronous checkpoint at step 4 stops both ranks in one line; the run resumed
    from step 2 with synchronous checkpoints, where rank 1 fails its part of step 4's save, stops both ranks again
    in one line and keeps the shared folder for rank 0 (no step-4, not even its .tmp); the next --resume trains
    every group exactly once. One run of ranks for what were two tests (each failure, then its own resume): one
    two-rank start fewer, every assertion of both kept."""
    url, run = redis_server.url, tmp_path / "run"
    _put(url, redis_ns, groups)
    cfg = _cfg(tmp_path, tiny_model_dir, url, redis_ns, 4, "learner.save_steps=2")
    line = _fails_on_every_rank(cfg, tmp_path, "--fail-stage", "4")
    assert line.endswith("learner rank 0: cannot write checkpoint step-000004 in "
                         f"{run / 'checkpoints'}: Permission denied ({run / 'checkpoints' / 'step-000004.tmp'}); "
                         "nothing was committed: the groups since the last checkpoint stay in Redis and are trained "
                         "again after --resume (free space there, or lower learner.save_total_limit)"), line
    _stopped_at_4(run, url, redis_ns)

    cfg = _cfg(tmp_path, tiny_model_dir, url, redis_ns, 4, "learner.save_steps=2", "learner.async_checkpoint=false")
    line = _fails_on_every_rank(cfg, tmp_path, "--fail-sync-rank", "1", "--fail-step", "4", resume=True)
    assert "learner rank 1: cannot write checkpoint step-000004" in line and "No space left on device" in line, line
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in line  # rank 1's own file: its ZeRO shard
    _stopped_at_4(run, url, redis_ns)
    _resumes_exactly_once(cfg, tmp_path, url, redis_ns, run)
