"""A checkpoint the learner cannot stand on is refused in one line, never trained on or published:
one that does not load (truncated by a crash), one with non-finite weights, and one older than the
newest step whose groups Redis already committed (resuming there would lose them silently). Real
Redis, the tiny model, real checkpoint files."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamgrpo import metrics


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 8, num_generations=4, max_tokens=6)


def _cfg(model_dir, run_dir, url, ns, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}", f"queue.url={url}",
                                f"queue.namespace={ns}", "learner.groups_per_step=4", "learner.max_steps=2",
                                "learner.save_steps=1", "learner.get_timeout_s=0.5", "weights.pub_port=0",
                                "weights.snapshot_port=0", "metrics.port=0", "learner.max_staleness=100", *sets])


@pytest.fixture
def trained_run(groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    """Two steps trained, each checkpointed and committed: checkpoints step-1 and step-2."""
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-producer")
    q.put_many([copy.deepcopy(g) for g in groups])
    run = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, run, redis_server.url, redis_ns)
    assert run_learner(cfg) == 0
    assert q.committed_step() == 2 and q.depth() == 0
    yield cfg, run, q
    q.close()


def _resume(cfg):
    from streamgrpo.learner.loop import run_learner

    return run_learner(cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"resume": True,
                                                                                     "max_steps": 2})}))


def test_a_truncated_newest_checkpoint_is_one_line_that_says_what_to_do(trained_run, tmp_path):
    cfg, run, _ = trained_run
    weights = run / "checkpoints" / "step-000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a crash in the middle of writing it
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "streamgrpo", "learner", "--config", str(path), "--resume"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("streamgrpo learner:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "step-000002 cannot be loaded" in lines[0] and "move it aside" in lines[0]


def test_resuming_from_an_older_checkpoint_than_redis_committed_is_refused(trained_run, tmp_path):
    from streamgrpo.learner.checkpoint.files import CheckpointUnusable

    cfg, run, q = trained_run
    shutil.move(run / "checkpoints" / "step-000002", tmp_path / "step-000002")  # "it looked broken"
    with pytest.raises(CheckpointUnusable) as err:
        _resume(cfg)
    msg = str(err.value)
    assert "step-000001 is step 1, but Redis already committed the groups of step 2" in msg and "\n" not in msg
    assert "restore checkpoints/step-000002" in msg
    shutil.move(tmp_path / "step-000002", run / "checkpoints" / "step-000002")  # put back: it resumes
    assert _resume(cfg) == 0 and q.committed_step() >= 2


def test_a_checkpoint_with_nan_weights_is_refused(trained_run):
    from streamgrpo.learner.checkpoint.files import CheckpointUnusable

    cfg, run, _ = trained_run
    path = run / "checkpoints" / "step-000002" / "model.safetensors"
    tensors = load_file(str(path))
    name = next(n for n, t in tensors.items() if t.is_floating_point() and "lm_head" not in n)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointUnusable, match="holds non-finite weights"):
        _resume(cfg)


def test_non_finite_weights_are_never_published(tiny_model_dir, tmp_path):
    from streamgrpo.config import load_config
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.transport.weights.publisher import WeightPublisher

    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={tmp_path}"])
    learner = Learner(cfg)
    errors = metrics.ERRORS.labels(kind="weights")._value.get()
    with WeightPublisher("127.0.0.1", 0, 0) as pub:
        learner.publish(pub, 1)
        assert pub.flush(10) and pub.latest_version == 1
        with torch.no_grad():
            next(p for p in learner.module.parameters() if p.requires_grad).view(-1)[0] = float("inf")
        learner.publish(pub, 2)
        assert pub.flush(10) and pub.latest_version == 1  # generators keep the last good version
    assert metrics.ERRORS.labels(kind="weights")._value.get() == errors + 1


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_nothing_behind(groups, tiny_model_dir, redis_server,
                                                                                   redis_ns, tmp_path):
    """A real write failure: the learner runs with a 1 MB file-size limit (RLIMIT_FSIZE), so its first
    checkpoint's weights cannot be written. One line (exit 1), no step-N.tmp left, nothing committed."""
    import resource
    import signal

    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-producer")
    try:
        q.put_many([copy.deepcopy(g) for g in groups[:4]])
        run = tmp_path / "run"
        path = tmp_path / "cfg.yaml"
        path.write_text(_cfg(tiny_model_dir, run, redis_server.url, redis_ns, "learner.max_steps=1").to_yaml())

        def small_files():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        out = subprocess.run([sys.executable, "-m", "streamgrpo", "learner", "--config", str(path)], capture_output=True,
                             text=True, env=env, timeout=300, preexec_fn=small_files)
        assert out.returncode == 1, out.stderr[-3000:]
        lines = [line for line in out.stderr.splitlines() if line.startswith("streamgrpo learner:")]
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert "cannot write checkpoint step-000001" in lines[0] and "nothing was committed" in lines[0]
        assert not list((run / "checkpoints").glob("*.tmp")) and not list((run / "checkpoints").glob("step-*"))
        assert q.committed_step() is None and q.held_count() == 4  # held, to be trained again after --resume
    finally:
        q.close()


def test_a_learner_checkpoints_early_when_redis_nears_maxmemory(groups, tiny_model_dir, redis_factory, redis_ns,
                                                                 tmp_path, caplog):
    """Redis at maxmemory would refuse the generators' writes while the learner idles holding messages it
    cannot free before its next checkpoint (save_steps away): past 80% of maxmemory, with groups
    trained and not committed, the learner checkpoints now, and the commit frees them."""
    import logging

    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    srv = redis_factory("system")
    q = RedisQueue(srv.url, namespace=redis_ns, consumer="test-producer")
    try:
        empty, _ = q.memory()
        q.put_many([copy.deepcopy(g) for g in groups[:6]])  # one step of 4, then 2: the learner waits for more
        used, _ = q.memory()
        q.client.config_set("maxmemory-policy", "noeviction")
        # 85% used (over the watch's 80%) plus room for the two groups to come: what the commit frees is not all
        # the learner's reads took (its connections' buffers stay: its media thread's, the crash-loop marks, one)
        q.client.config_set("maxmemory", str(int(used / 0.85 + 2 * (used - empty) / 6)))
        run = tmp_path / "run"
        cfg = _cfg(tiny_model_dir, run, srv.url, redis_ns, "learner.save_steps=1000", "learner.max_steps=2")
        def later():  # the second step's groups come once the learner, idling, has checkpointed step 1 early
            import time

            deadline = time.monotonic() + 300
            while not (run / "checkpoints" / "step-000001").is_dir() and time.monotonic() < deadline:
                time.sleep(0.2)
            q.put_many([copy.deepcopy(g) for g in groups[6:8]])

        stopper = __import__("threading").Thread(target=later, daemon=True)
        stopper.start()
        with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
            assert run_learner(cfg) == 0
        stopper.join()
        early = [r.getMessage() for r in caplog.records if "checkpointing at step 1 now" in r.getMessage()]
        assert early and "of its maxmemory" in early[0], [r.getMessage() for r in caplog.records]
        assert (run / "checkpoints" / "step-000001").is_dir()  # long before save_steps=1000
        assert q.committed_step() == 2 and q.depth() == 0  # the final one committed the rest
    finally:
        q.close()
