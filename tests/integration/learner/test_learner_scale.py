"""The learner at scale: DeepSpeed ranks under torchrun on CPU (gloo), all consuming one Redis stream.

Real parts: redis-server, real ScoredGroups (demo videos, completions sampled by the tiny
Qwen2.5-VL) put straight into the stream, ``python -m torch.distributed.run`` with two ranks.

* ZeRO-1 through the CLI (``torchrun -m streamgrpo learner``): each group trained exactly once,
  weights identical on both ranks after every step, merged metrics, a checkpoint without pickles; both
  ranks killed between checkpoints, then resumed: nothing lost, nothing trained twice.
* ZeRO-2: stop, resume from the DeepSpeed checkpoint, continue; replaying the same per-rank
  groups through one uninterrupted learner gives bit-identical weights.
* One process (torch backend) with LoRA and wandb offline, through ``run_learner``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import wandb_log

from tests.paths import REPO
from tests.sessions import run_session

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
DEPLOY = REPO / "streamgrpo" / "configs" / "deepspeed"


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 16, num_generations=4, max_tokens=6)


def _config(tmp_path: Path, model_dir, url: str, ns: str, *sets: str) -> Path:
    from streamgrpo.config import load_config

    cfg = load_config("demo", [
        f"model.name_or_path={model_dir}", "demo.tiny_model=false", f"run_dir={tmp_path / 'run'}",
        f"queue.url={url}", f"queue.namespace={ns}", "queue.max_pending=1000", "learner.groups_per_step=4",
        "learner.get_timeout_s=0.5", "learner.max_staleness=100", "metrics.log_every=1", "weights.pub_port=0",
        "weights.snapshot_port=0", "metrics.port=0", *sets])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _put(url: str, ns: str, groups) -> None:
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(url, namespace=ns, consumer="test-producer", max_pending=1000) as q:
        q.put_many(list(groups))


def _queue_state(url: str, ns: str, ids) -> tuple[int, list[bool]]:
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(url, namespace=ns, consumer="test-inspect") as q:
        return q.depth(), q.is_trained(list(ids))


def load_config_lr(path: Path) -> float:
    from streamgrpo.config import load_config

    return load_config(path).learner.learning_rate


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _kill_rank_in_its_step(cfg: Path, tmp_path: Path, url: str, ns: str, rank: int = 1) -> tuple[list[str], str]:
    """Two learner ranks under torchrun on ``cfg``; ``rank`` killed with SIGSEGV (as a decoder that segfaults on a
    poison group) while its crash-loop mark names the groups of its step (stopped with SIGSTOP, the mark read again,
    then killed: a step that ends between the read and the kill cannot make it die between steps). The other ranks
    must stop on their own. Returns the groups it had marked and torchrun's output."""
    import signal
    import time

    import redis

    from streamgrpo.runtime.processes import free_port
    from streamgrpo.transport.queue.crash_marks import CrashMarks

    consumer, run = f"learner-{rank}", tmp_path / "run"
    r = redis.Redis.from_url(url)
    marks = CrashMarks(r, ns, consumer)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "streamgrpo", "learner", "--config", str(cfg)]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=ENV, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        deadline, pid = time.monotonic() + 400, None
        while True:
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-4000:]
            if marked := marks.read([consumer])[0].groups:
                pid = pid or json.loads((run / "ports" / f"learner-rank{rank}.json").read_text())["pid"]
                os.kill(pid, signal.SIGSTOP)  # frozen; still marked, it is in the step (or clearing its mark)
                if marks.read([consumer])[0].groups == marked:
                    os.kill(pid, signal.SIGSEGV)  # delivered first thing when it runs on
                    os.kill(pid, signal.SIGCONT)
                    break
                os.kill(pid, signal.SIGCONT)  # the step ended meanwhile: the next one
            time.sleep(0.02)
        assert first.wait(timeout=120) != 0  # the other rank stops on its own: its collective failed
    finally:
        r.close()
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    return marked, (tmp_path / "first.log").read_text()


def _torchrun(*args: str, cwd: Path, timeout: int = 480) -> subprocess.CompletedProcess:
    from streamgrpo.runtime.processes import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *args]
    out = run_session(cmd, env=ENV, cwd=cwd, timeout=timeout)
    (cwd / "torchrun.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return out


def _trained_per_rank(run: Path) -> dict[int, list[dict]]:
    return {0: [r for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "trained"],
            1: [r for r in _jsonl(run / "audit" / "learner-rank1.jsonl") if r["event"] == "trained"]}


def _assert_exactly_once_and_replicas(per_rank: dict[int, list[dict]], ids: list[str], steps: int) -> None:
    for rank in (0, 1):
        assert [r["step"] for r in per_rank[rank]] == list(range(1, steps + 1))
        assert all(len(r["group_ids"]) == 2 for r in per_rank[rank])  # groups_per_step / world_size each
    trained = [g for rank in (0, 1) for r in per_rank[rank] for g in r["group_ids"]]
    assert sorted(trained) == sorted(ids), "every group trained exactly once, by one rank"
    for a, b in zip(per_rank[0], per_rank[1]):
        if "weights_checksum" in a:
            assert a["weights_checksum"] == b["weights_checksum"], f"ranks differ after step {a['step']}"
    assert all(len({r["version"] for r in step}) == 1 for step in zip(per_rank[0], per_rank[1]))


@pytest.mark.slow
def test_two_zero1_ranks_share_one_stream_through_the_cli_and_resume_after_a_kill(groups, tiny_model_dir, redis_server,
                                                                                  redis_ns, tmp_path):
    """Two ZeRO-1 ranks through the CLI: each group trained exactly once, weights identical on both ranks after
    every step, merged metrics, a checkpoint without pickles. Between checkpoints (after step 3; step 4 waits for
    groups) kill -9 of both ranks (and torchrun): each rank re-reads and re-trains its own groups trained after the
    checkpoint; the audit over both ranks' logs finds nothing lost, nothing twice. One run of ranks for what were
    two tests (a clean run, and the kill): one two-rank start fewer, every assertion of both kept."""
    from transformers import AutoModelForImageTextToText

    from benchmarks.audit import audit_run
    from streamgrpo.learner.checkpoint.files import load_tree
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    steps = 4
    cfg = _config(tmp_path, tiny_model_dir, redis_server.url, redis_ns, "learner.backend=deepspeed",
                  f"learner.deepspeed_config={DEPLOY / 'zero1.json'}", f"learner.max_steps={steps}",
                  "learner.save_steps=2", "learner.replica_check_every=1", "learner.micro_batch_tokens=200")
    batch = groups[:steps * 4]
    _put(redis_server.url, redis_ns, batch[:12])  # step 4 waits for groups: the kill lands before it
    run = tmp_path / "run"
    kill_two_ranks_after_step(cfg, tmp_path, run, 3)
    assert (run / "checkpoints" / "step-000002").is_dir() and not (run / "checkpoints" / "step-000004").exists()
    _put(redis_server.url, redis_ns, batch[12:])
    _torchrun("-m", "streamgrpo", "learner", "--config", str(cfg), "--resume", cwd=tmp_path)

    per_rank = _trained_per_rank(run)
    _assert_exactly_once_and_replicas(per_rank, [g.group_id for g in batch], steps)  # steps 3-4 redone, once
    assert all("weights_checksum" in r for r in per_rank[0])
    assert [r["step"] for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "resumed"] == [2]
    depth, done = _queue_state(redis_server.url, redis_ns, [g.group_id for g in batch])
    assert depth == 0 and all(done)  # every rank acked and marked its own groups
    with RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-inspect") as q:
        audit = audit_run(run, q)
        assert q.held_count() == 0
    assert (audit.lost, audit.twice, audit.uncommitted, audit.trained, audit.steps) == (0, 0, 0, 16, steps)
    rows = _jsonl(run / "metrics.jsonl")  # rank 0 only, numbers of both ranks merged
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["groups_trained"] for r in rows] == [4, 8, 12, 16] and all(r["ranks"] == 2 for r in rows)
    assert all(r["tokens"] == sum(len(c.token_ids) for g in batch[4 * i:4 * i + 4] for c in g.completions)
               for i, r in enumerate(rows))
    assert all(r["micro_batches"] >= 2 for r in rows)
    ports = {p.name for p in (run / "ports").iterdir()}
    assert {"learner.json", "learner-rank1.json", "weights.json"} <= ports
    ckpt = run / "checkpoints" / f"step-{steps:06d}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["learner"]["step"] == steps and state["backend"] == "deepspeed" and state["world_size"] == 2
    shards = sorted((ckpt / "deepspeed" / "state").iterdir())
    assert len([s for s in shards if "optim_states" in s.name]) == 2
    for shard in shards:  # DeepSpeed's files, written by our engine: safetensors, no pickle
        assert load_tree(shard) is not None
    assert (ckpt / "rng-rank0.safetensors").is_file() and (ckpt / "rng-rank1.safetensors").is_file()
    AutoModelForImageTextToText.from_pretrained(ckpt)  # the gathered model loads with plain transformers


@pytest.mark.slow
def test_zero2_resume_is_exact_against_an_uninterrupted_replay(groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    from streamgrpo.wire import encode

    first, total = 2, 4
    cfg = _config(tmp_path, tiny_model_dir, redis_server.url, redis_ns, "learner.backend=deepspeed",
                  f"learner.deepspeed_config={DEPLOY / 'zero2.json'}", "learner.warmup_steps=3",
                  "learner.replica_check_every=1", "learner.micro_batch_tokens=250", "loss.beta=0.04")
    batch = groups[:total * 4]
    (tmp_path / "groups.msgpack").write_bytes(msgpack.packb([encode(g) for g in batch]))
    _put(redis_server.url, redis_ns, batch)
    driver = Path(__file__).with_name("learner_scale_driver.py")
    _torchrun(str(driver), "--config", str(cfg), "--groups", str(tmp_path / "groups.msgpack"), "--first", str(first),
              "--total", str(total), "--out", str(tmp_path / "result.json"), cwd=tmp_path)

    result = json.loads((tmp_path / "result.json").read_text())
    assert result["replay_steps"] == total and result["world_size"] == 2
    assert result["replay_equal"], f"resumed run differs from the replay (max |diff| {result['max_abs_diff']})"
    checks = result["replay_checksums"]
    assert checks[0] == checks[1]
    run = tmp_path / "run"
    _assert_exactly_once_and_replicas(_trained_per_rank(run), [g.group_id for g in batch], total)
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["version"] for r in rows] == [1, 2, 3, 4]
    lr = float(load_config_lr(cfg))
    assert [r["lr"] for r in rows] == pytest.approx([2 / 3 * lr, lr, lr, lr], rel=1e-6)  # warm-up survived the resume
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]


def test_one_process_lora_with_wandb_through_run_learner(groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.runtime.processes import StopFlag

    cfg_path = _config(tmp_path, tiny_model_dir, redis_server.url, redis_ns, "learner.groups_per_step=2",
                       "learner.max_steps=2", "model.lora={r: 4, alpha: 8}", "metrics.sample_every=2",
                       "metrics.wandb={project: sg-test, mode: offline}")
    from streamgrpo.config import load_config

    cfg = load_config(cfg_path)
    _put(redis_server.url, redis_ns, groups[:4])
    assert run_learner(cfg, stop=StopFlag(install=False)) == 0
    run = tmp_path / "run"
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["groups_trained"] for r in rows] == [2, 4] and rows[-1]["ranks"] == 1
    assert "policy_seq_log_prob" in rows[0] and rows[0]["policy_seq_log_prob"] < 0
    ckpt = run / "checkpoints" / "step-000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "README.md").is_file()
    depth, done = _queue_state(redis_server.url, redis_ns, [g.group_id for g in groups[:4]])
    assert depth == 0 and all(done)
    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1
    (log_file,) = wandb_runs[0].glob("run-*.wandb")
    logged = {key for row in wandb_log.history(log_file) for key in row}
    for key in ("grpo/policy_seq_log_prob", "grpo/kl_div", "grpo/format_reward", "grpo/accuracy_reward",
                "grpo/total_reward", "grpo/advantage", "samples/_type"):
        assert key in logged, key


def kill_two_ranks_after_step(cfg: Path, tmp_path: Path, run: Path, step: int) -> None:
    """Start two learner ranks under torchrun; once step ``step`` is in the audit and no checkpoint write is in
    flight (an asynchronous one is renamed, then committed, at a step boundary after it), kill -9 both ranks
    (torchrun starts them in their own sessions), then torchrun; return once the ranks are gone."""
    from benchmarks.audit import read_jsonl

    def ready() -> bool:
        return bool([r for r in read_jsonl(run / "audit" / "learner.jsonl") if r.get("step") == step]
                    and not list((run / "checkpoints").glob("step-*.tmp")))

    kill_two_ranks_when(["-m", "streamgrpo", "learner", "--config", str(cfg)], tmp_path, run, ready)


def kill_two_ranks_when(args: list[str], tmp_path: Path, run: Path, ready, *,
                        order: tuple[str, str] = ("learner", "learner-rank1")) -> None:
    """Start two ranks of ``torchrun ... *args``; once ``ready()``, kill -9 both ranks (in ``order``: their
    ports files' names), then torchrun; return once the ranks are gone. Its output: ``tmp_path/first.log``."""
    import os
    import signal
    import time

    from streamgrpo.runtime.processes import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *args]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=ENV, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 480
        while not ready():
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-4000:]
            time.sleep(0.2)
        ranks = [json.loads((run / "ports" / f"{n}.json").read_text())["pid"] for n in order]
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    for pid in ranks:
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, f"rank pid {pid} survived SIGKILL"
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
