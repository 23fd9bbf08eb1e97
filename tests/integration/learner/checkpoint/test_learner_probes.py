"""Probes of the learner as tests (issue 50 item 7): a checkpoint on a full disk. Root-free: the learner runs
with a file-size limit (RLIMIT_FSIZE) under which its checkpoint's weights cannot be written, as on a full
disk. It stops in one line with the groups uncommitted; the next start (--resume, room again) trains them,
each exactly once by the audit. Real redis-server, the tiny model, real processes."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 8, num_generations=4, max_tokens=6)


def _small_files(limit: int):
    def set_limit():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) as ENOSPC would
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return set_limit


@pytest.mark.parametrize("full_at", ["first", "second"])
def test_a_checkpoint_on_a_full_disk_is_one_line_and_the_groups_train_exactly_once_after_resume(
        full_at, groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    """``first``: no checkpoint could ever be written (the next start begins at step 0 again);
    ``second``: a run wrote step 2's checkpoint, the next one cannot write step 4's (the start after resumes
    from step 2)."""
    from benchmarks.audit import audit_run
    from streamgrpo.config import load_config
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-producer")
    try:
        q.put_many([copy.deepcopy(g) for g in groups])
        run = tmp_path / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

        def learner(max_steps: int, **kw) -> subprocess.CompletedProcess:
            path = tmp_path / f"cfg-{max_steps}.yaml"
            path.write_text(load_config("demo", [
                f"model.name_or_path={tiny_model_dir}", f"run_dir={run}", f"queue.url={redis_server.url}",
                f"queue.namespace={redis_ns}", "learner.groups_per_step=2", f"learner.max_steps={max_steps}",
                "learner.save_steps=2", "learner.get_timeout_s=0.5", "weights.pub_port=0", "weights.snapshot_port=0",
                "metrics.port=0", "learner.max_staleness=100", "eval.enabled=false"]).to_yaml())
            return subprocess.run([sys.executable, "-m", "streamgrpo", "learner", "--config", str(path), "--resume"],
                                  capture_output=True, text=True, env=env, timeout=300, **kw)

        before = None
        if full_at == "second":
            assert learner(2).returncode == 0
            before = 2
        assert q.committed_step() == before
        out = learner(4, preexec_fn=_small_files(1 << 20))
        assert out.returncode == 1, out.stderr[-3000:]
        lines = [line for line in out.stderr.splitlines() if line.startswith("streamgrpo learner:")]
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        step = 2 if full_at == "first" else 4
        assert f"cannot write checkpoint step-{step:06d}" in lines[0] and "nothing was committed" in lines[0]
        assert not list((run / "checkpoints").glob("*.tmp"))
        # uncommitted: trained again next time (an asynchronous write of step 2 fails while steps 3-4 train:
        # theirs are held too, as far as they got)
        held = q.held_count()
        assert q.committed_step() == before and (4 <= held <= 8 if full_at == "first" else held == 4), held

        out = learner(4)
        assert out.returncode == 0, out.stderr[-3000:]
        assert q.committed_step() == 4 and q.held_count() == 0 and q.depth() == 0
        audit = audit_run(run, q)
        assert (audit.lost, audit.twice, audit.uncommitted, audit.steps) == (0, 0, 0, 4), audit
        assert audit.steps_in_order and audit.trained == 8, audit
    finally:
        q.close()
