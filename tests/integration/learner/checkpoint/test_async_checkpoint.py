"""Asynchronous checkpoints (``learner.async_checkpoint``, issue 52 item 6): training goes on while a
checkpoint is written, and its groups are committed in Redis only once the files are durable.

Real parts: redis-server, the tiny Qwen2.5-VL, real checkpoint files, the ``streamgrpo learner`` CLI,
``kill -9`` (after SIGSTOP, so that it lands while ``step-N.tmp`` is being written).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "WANDB_MODE": "offline"}


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 16, num_generations=4, max_tokens=6)


def _cfg(model_dir, run_dir, url, ns, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}", f"queue.url={url}",
                                f"queue.namespace={ns}", "learner.groups_per_step=2", "learner.get_timeout_s=0.5",
                                "weights.pub_port=0", "weights.snapshot_port=0", "metrics.port=0",
                                "learner.max_staleness=100", *sets])


def _put(url, ns, groups):
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(url, namespace=ns, consumer="test-producer", max_pending=1000) as q:
        q.put_many([copy.deepcopy(g) for g in groups])


def _audit(run, url, ns):
    from benchmarks.audit import audit_run
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(url, namespace=ns, consumer="test-inspect") as q:
        return audit_run(run, q), q.held_count(), q.depth()


def _trained(run: Path) -> list[dict]:
    from benchmarks.audit import read_jsonl

    return [r for r in read_jsonl(run / "audit" / "learner.jsonl") if r.get("event") == "trained"]


def test_training_goes_on_during_the_write_and_its_groups_are_committed_after_it(
        groups, tiny_model_dir, redis_server, redis_ns, tmp_path, monkeypatch):
    """The write of checkpoint 2 is held back (the real write, started late): steps 3 and 4 train meanwhile,
    step 2's groups stay uncommitted and step-000002 does not exist; once written, they are committed."""
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.runtime.processes import StopFlag
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    url, run = redis_server.url, tmp_path / "run"
    _put(url, redis_ns, groups[:8])
    cfg = _cfg(tiny_model_dir, run, url, redis_ns, "learner.max_steps=4", "learner.save_steps=2")
    assert cfg.learner.async_checkpoint  # the default
    release, writing = threading.Event(), threading.Event()
    real_write = Learner.write_snapshot

    def held_write(self, root, snap):
        writing.set()
        assert release.wait(300)
        return real_write(self, root, snap)

    monkeypatch.setattr(Learner, "write_snapshot", held_write)
    done: list = []
    thread = threading.Thread(target=lambda: done.append(run_learner(cfg, stop=StopFlag(install=False))))
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while len(_trained(run)) < 4:  # steps 3 and 4 trained while checkpoint 2 waits to be written
            assert thread.is_alive() and time.monotonic() < deadline, "the learner stopped"
            time.sleep(0.1)
        assert writing.is_set()
        step2 = _trained(run)[1]["group_ids"]
        with RedisQueue(url, namespace=redis_ns, consumer="test-inspect") as q:
            assert q.is_trained(step2) == [False, False] and q.committed_step() in (None, 0)
        assert not (run / "checkpoints" / "step-000002").exists()
    finally:
        release.set()
        thread.join(300)
    assert done == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    state = json.loads((run / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["learner"]["step"] == 2 and len(state["learner"]["committing"]) == 4  # steps 1-2's groups
    audit, held, depth = _audit(run, url, redis_ns)
    assert (audit.lost, audit.twice, audit.uncommitted, audit.trained, held, depth) == (0, 0, 0, 8, 0, 0)


def _stop_during_a_write(proc: subprocess.Popen, ckpts: Path, log: Path, timeout_s: float = 300) -> str:
    """SIGSTOP the learner while a ``step-N.tmp`` exists (the background write in progress) and return its name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        tmp = [p.name for p in ckpts.glob("step-*.tmp")] if ckpts.is_dir() else []
        if tmp:
            os.kill(proc.pid, signal.SIGSTOP)
            if (ckpts / tmp[0]).is_dir():  # still being written: stopped in the middle of it
                return tmp[0]
            os.kill(proc.pid, signal.SIGCONT)  # it was renamed in between: wait for the next one
        time.sleep(0.001)
    raise AssertionError("no checkpoint write caught in progress")


def test_kill_9_during_an_asynchronous_write_resumes_from_the_previous_checkpoint_exactly_once(
        groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    url, run = redis_server.url, tmp_path / "run"
    cfg = _cfg(tiny_model_dir, run, url, redis_ns, "learner.max_steps=8", "learner.save_steps=1")
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    _put(url, redis_ns, groups)
    log = tmp_path / "first.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "streamgrpo", "learner", "--config", str(path)], env=ENV,
                                stdout=fh, stderr=subprocess.STDOUT)
    try:
        caught = _stop_during_a_write(proc, run / "checkpoints", log)
    finally:
        proc.kill()  # SIGKILL (a stopped process dies too)
        proc.wait()
    step = int(caught.split("-")[1].split(".")[0])
    ckpts = run / "checkpoints"
    assert (ckpts / caught).is_dir() and not (ckpts / f"step-{step:06d}").exists()
    out = subprocess.run([sys.executable, "-m", "streamgrpo", "learner", "--config", str(path), "--resume"],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    resumed = [json.loads(line) for line in (run / "audit" / "learner.jsonl").read_text().splitlines()
               if '"resumed"' in line]
    # the previous complete checkpoint (none: step 0, which --resume notes too)
    assert [r["step"] for r in resumed] == ([step - 1] if step > 1 else [0])
    audit, held, depth = _audit(run, url, redis_ns)
    assert (audit.lost, audit.twice, audit.uncommitted, audit.steps, held) == (0, 0, 0, 8, 0), audit
    # a step the learner died in trains its groups one per step after the restart (the crash-loop breaker):
    # what 8 steps did not reach is still queued, never lost
    assert audit.trained + audit.queued == 16 and audit.queued == depth, (audit, depth)
    assert not list(ckpts.glob("*.tmp"))  # the torn write was replaced when that step was checkpointed again


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_asynchronous_checkpoint_holds_what_a_synchronous_one_holds(tiny_model_dir, tmp_path, lora):
    """Snapshot, then change the live weights and optimizer state, then write: the files are those a synchronous
    save at the snapshot's moment writes (weights, optimizer, schedule, RNG, learner state), tensor for tensor."""
    import torch
    from safetensors.torch import load_file

    from streamgrpo.config import load_config
    from streamgrpo.learner.checkpoint.background import BackgroundWrite
    from streamgrpo.learner.trainer import Learner

    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={tmp_path}",
                               *(["model.lora={r: 4, alpha: 8}"] if lora else [])])
    learner = Learner(cfg)
    params = [p for p in learner.module.parameters() if p.requires_grad]
    sum((p.float() ** 2).sum() for p in params).backward()
    assert learner._optimizer_step()[1]
    learner.state.step = 3
    torch.manual_seed(5)
    sync = learner.save(tmp_path / "sync")
    torch.manual_seed(5)
    snap = learner.snapshot()
    with torch.no_grad():  # training goes on: none of this may reach the checkpoint
        for p in params:
            p.add_(1.0)
        learner.optimizer.state[params[0]]["exp_avg"].add_(1.0)
    learner.state.step = 4
    written = BackgroundWrite(3, lambda: learner.write_snapshot(tmp_path / "async", snap)).result()
    assert written.name == sync.name == "step-000003"
    names = sorted(p.name for p in sync.iterdir())
    assert names == sorted(p.name for p in written.iterdir())
    assert ("adapter_model.safetensors" if lora else "model.safetensors") in names
    for name in names:
        a, b = sync / name, written / name
        if name.endswith(".safetensors"):
            ta, tb = load_file(str(a)), load_file(str(b))
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
        elif name == "trainer_state.json":
            assert json.loads(a.read_text()) == json.loads(b.read_text())
        else:
            assert a.read_bytes() == b.read_bytes(), name
