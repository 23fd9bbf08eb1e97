"""Asynchronous checkpoints of DeepSpeed ranks (issue 52 item 6, many ranks): each rank copies its part at the
step boundary and writes it in the background; rank 0 renames ``step-N.tmp`` once every rank's part is fsynced,
and only then does any rank commit its groups in Redis.

Real parts: redis-server, the tiny Qwen2.5-VL, DeepSpeed ZeRO-2 ranks on the CPU (gloo) under
``python -m torch.distributed.run``, the ``streamgrpo learner`` CLI, ``kill -9``. The background writes are
slowed, held or failed by tests/integration/learner/checkpoint/checkpoint_write_driver.py (the real write, started late; a rank
whose write fails as a full disk does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.learner.test_learner_scale import (
    DEPLOY,
    ENV,
    _config,
    _jsonl,
    _put,
    _torchrun,
    kill_two_ranks_when,
)
from tests.sessions import run_session

pytestmark = pytest.mark.slow
DRIVER = str(Path(__file__).with_name("checkpoint_write_driver.py"))


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 24, num_generations=4, max_tokens=6)


def _cfg(tmp_path, model_dir, url, ns, steps: int, *sets: str) -> Path:
    return _config(tmp_path, model_dir, url, ns, "learner.backend=deepspeed",
                   f"learner.deepspeed_config={DEPLOY / 'zero2.json'}", f"learner.max_steps={steps}",
                   "learner.warmup_steps=6", "learner.micro_batch_tokens=250", "queue.claim_idle_s=2", *sets)


def _audit(run: Path, url: str, ns: str):
    from benchmarks.audit import audit_run
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(url, namespace=ns, consumer="test-inspect") as q:
        return audit_run(run, q), q.held_count(), q.depth()


def test_two_zero2_ranks_write_in_the_background_commit_after_it_and_resume(groups, tiny_model_dir, redis_server,
                                                                           redis_ns, tmp_path):
    from safetensors.torch import load_file

    url, run = redis_server.url, tmp_path / "run"
    _put(url, redis_ns, groups[:16])
    cfg = _cfg(tmp_path, tiny_model_dir, url, redis_ns, 4, "learner.save_steps=2")
    _torchrun(DRIVER, "--sleep", "3", "--out", str(tmp_path), "learner", "--config", str(cfg), cwd=tmp_path)
    writes = [r for rank in (0, 1) for r in _jsonl(tmp_path / f"writes-rank{rank}.jsonl")]
    # checkpoint 2 was written on both ranks while steps after it trained (the write started 3 s late)
    assert sorted((r["rank"], r["step"]) for r in writes) == [(0, 2), (0, 4), (1, 2), (1, 4)]
    assert all(r["live_step"] > 2 for r in writes if r["step"] == 2), writes
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002", "step-000004"]
    for step in (2, 4):
        ckpt = ckpts / f"step-{step:06d}"
        meta = json.loads((ckpt / "trainer_state.json").read_text())
        assert (meta["step"], meta["world_size"], meta["zero_stage"]) == (step, 2, 2)
        assert len(meta["learner"]["committing"]) == 8  # both ranks' groups of the two steps it holds
        shards = sorted(p.name for p in (ckpt / "deepspeed" / "state").glob("*optim_states.pt"))
        assert len(shards) == 2 and load_file(str(ckpt / "rng-rank1.safetensors"))
    # the step-2 files are step 2's state, not the live state the write ran beside (steps 3-4 changed it)
    import torch
    from transformers import AutoModelForImageTextToText

    from streamgrpo.learner.checkpoint.reshard import consolidate_zero12

    model = AutoModelForImageTextToText.from_pretrained(ckpts / "step-000002", dtype=torch.float32)
    shapes = {n: t.shape for n, t in model.named_parameters()}
    two = consolidate_zero12(ckpts / "step-000002" / "deepspeed" / "state", shapes)
    four = consolidate_zero12(ckpts / "step-000004" / "deepspeed" / "state", shapes)
    assert (two.step, four.step) == (2, 4)
    assert any(not torch.equal(two.tensors[n]["fp32"], four.tensors[n]["fp32"]) for n in two.tensors)
    weights = dict(model.named_parameters())  # rank 0's weights and the ranks' fp32 shards: the same moment
    assert all(torch.equal(st["fp32"], weights[n].detach()) for n, st in two.tensors.items())
    audit, held, depth = _audit(run, url, redis_ns)
    assert (audit.lost, audit.twice, audit.uncommitted, audit.trained, held, depth) == (0, 0, 0, 16, 0, 0)

    _put(url, redis_ns, groups[16:24])  # resume on the same two ranks: DeepSpeed loads the async-written shards
    _torchrun("-m", "streamgrpo", "learner", "--config", str(_cfg(tmp_path, tiny_model_dir, url, redis_ns, 6,
                                                                      "learner.save_steps=2")),
              "--resume", cwd=tmp_path)
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    peak = rows[-1]["lr"]  # one warm-up of 6 steps across the resume: the schedule came back from the shards
    assert [r["lr"] for r in rows] == pytest.approx([peak * min(k + 1, 6) / 6 for k in range(1, 7)], rel=1e-6)
    assert [r["step"] for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "resumed"] == [4]
    audit, held, depth = _audit(run, url, redis_ns)
    assert (audit.lost, audit.twice, audit.uncommitted, audit.trained, audit.steps, held, depth) == \
        (0, 0, 0, 24, 6, 0, 0)


def test_kill_9_during_a_two_rank_background_write_resumes_from_the_previous_checkpoint_exactly_once(
        groups, tiny_model_dir, redis_server, redis_ns, tmp_path):

    url, run = redis_server.url, tmp_path / "run"
    cfg = _cfg(tmp_path, tiny_model_dir, url, redis_ns, 4, "learner.save_steps=1")
    _put(url, redis_ns, groups[:16])
    kill_two_ranks_when(  # rank 1 first, in the middle of its write
        [DRIVER, "--hold-step", "2", "--out", str(tmp_path), "learner", "--config", str(cfg)], tmp_path, run,
        lambda: all((tmp_path / f"writing-rank{r}").exists() for r in (0, 1)),  # both ranks inside write 2
        order=("learner-rank1", "learner"))
    ckpts = run / "checkpoints"
    assert (ckpts / "step-000001").is_dir() and (ckpts / "step-000002.tmp").is_dir()
    assert not (ckpts / "step-000002").exists()
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(url, namespace=redis_ns, consumer="test-inspect") as q:
        assert q.committed_step() == 1  # step 2's groups: not committed (their checkpoint never completed)

    _torchrun("-m", "streamgrpo", "learner", "--config", str(cfg), "--resume", cwd=tmp_path)
    resumed = [r["step"] for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "resumed"]
    assert resumed == [1]
    audit, held, depth = _audit(run, url, redis_ns)
    assert (audit.lost, audit.twice, audit.uncommitted, audit.steps) == (0, 0, 0, 4), audit
    # the step the ranks died in trains its groups one per step after the restart (the crash-loop breaker; what
    # it carries stays held for the next start): what 4 steps did not reach is still in Redis, never lost
    assert audit.trained + held + depth == 16, (audit, held, depth)
    assert not list(ckpts.glob("*.tmp"))


def test_a_write_that_fails_on_one_rank_stops_both_with_one_line_and_commits_nothing(
        groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    from streamgrpo.runtime.processes import free_port
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    url, run = redis_server.url, tmp_path / "run"
    cfg = _cfg(tmp_path, tiny_model_dir, url, redis_ns, 4, "learner.save_steps=2")
    _put(url, redis_ns, groups[:16])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), DRIVER, "--fail-rank", "1", "--out", str(tmp_path),
           "learner", "--config", str(cfg)]
    out = run_session(cmd, env=ENV, cwd=tmp_path, timeout=480)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-4000:]
    line = "learner rank 1: cannot write checkpoint step-000002"
    assert text.count(line) >= 2, text[-6000:]  # both ranks stop with the same line
    assert "No space left on device" in text and "nothing was committed" in text
    assert not (run / "checkpoints" / "step-000002").exists()
    assert not (run / "checkpoints" / "step-000002.tmp").exists()  # rank 0 removed it, once both parts had ended
    trained = [g for name in ("learner.jsonl", "learner-rank1.jsonl") for r in _jsonl(run / "audit" / name)
               if r["event"] == "trained" and r["step"] <= 2 for g in r["group_ids"]]
    assert len(trained) == 8
    with RedisQueue(url, namespace=redis_ns, consumer="test-inspect") as q:  # steps 1-2's groups: held, not trained
        assert q.committed_step() in (None, 0) and q.is_trained(trained) == [False] * 8


def test_a_zero3_lora_snapshot_writes_what_a_synchronous_checkpoint_writes(tiny_model_dir, tmp_path):
    """LoRA under ZeRO-3 (the adapters gathered, the frozen base left out), one rank: the asynchronous checkpoint's
    files (model, DeepSpeed's module and optimizer trees, RNG, learner state) are the synchronous one's, and the
    next snapshot copies the gathered weights into the same host buffers (not fresh CPU copies)."""
    import os

    import torch
    from safetensors.torch import load_file

    from streamgrpo.learner.checkpoint.files import load_tree
    from streamgrpo.runtime.processes import free_port

    env = {**ENV, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("snapshot_ranks_driver.py")), str(tiny_model_dir),
                          str(tmp_path), str(DEPLOY / "zero3.json"), "lora"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    reuse = json.loads((tmp_path / "reuse.json").read_text())  # ZeRO-3's gathered weights: the reused host buffers
    assert reuse["weights"] > 0 and reuse["reused"] == reuse["weights"], reuse
    sync, written = tmp_path / "sync" / "step-000003", tmp_path / "async" / "step-000003"
    names = sorted(str(p.relative_to(sync)) for p in sync.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(written)) for p in written.rglob("*") if p.is_file())
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names
    trees = [n for n in names if n.startswith("deepspeed/state/") and n.endswith(".pt")]
    assert len(trees) == 2  # the module states and the rank's ZeRO optimizer shard
    for name in names:
        a, b = sync / name, written / name
        if name.endswith(".safetensors"):
            ta, tb = load_file(str(a)), load_file(str(b))
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
        elif name in trees:
            ta, tb = load_tree(a), load_tree(b)
            flat_a, flat_b = _tensors(ta), _tensors(tb)
            assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), name
        elif name == "trainer_state.json":
            assert json.loads(a.read_text()) == json.loads(b.read_text())


def _tensors(tree, path: str = "") -> dict:
    import torch

    if torch.is_tensor(tree):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{path}/{key}").items()}
