"""Out of memory in a learner step costs a retry, not the run: a real learner (tiny model, real Redis,
the CLI, torchrun with two gloo ranks) on a device that holds only a few sequences per forward
(tests/integration/learner/memory/oom_driver.py raises torch.OutOfMemoryError past that, as a GPU does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.sessions import run_session

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
DRIVER = str(Path(__file__).with_name("oom_driver.py"))


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 8, num_generations=4, max_tokens=6)


def _setup(tmp_path, tiny_model_dir, redis_server, ns, groups, *sets) -> Path:
    from streamgrpo.config import load_config
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(redis_server.url, namespace=ns, consumer="test-producer", max_pending=1000) as q:
        q.put_many(list(groups))
    cfg = load_config("demo", [
        f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false", f"run_dir={tmp_path / 'run'}",
        f"queue.url={redis_server.url}", f"queue.namespace={ns}", "learner.groups_per_step=4", "learner.max_steps=2",
        "learner.get_timeout_s=0.5", "learner.max_staleness=100", "weights.pub_port=0", "weights.snapshot_port=0",
        "metrics.port=0", "launch.agreement_check=false", *sets])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _trained(run: Path) -> Counter:
    ids: Counter = Counter()
    for f in (run / "audit").glob("learner*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "trained":
                ids.update(rec["group_ids"])
    return ids


def _queue(url: str, ns: str, ids) -> tuple[int, list[bool]]:
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(url, namespace=ns, consumer="test-inspect") as q:
        return q.depth(), q.is_trained(list(ids))


def test_a_step_that_runs_out_of_memory_is_retried_with_half_the_budget(groups, tiny_model_dir, redis_server,
                                                                         redis_ns, tmp_path):
    """16 sequences a step on a device that holds 2: the budget halves (the step's groups stay, uncommitted)
    until groups are cut into runs of 2 sequences; both steps train, every group exactly once, committed."""
    cfg = _setup(tmp_path, tiny_model_dir, redis_server, redis_ns, groups)
    out = subprocess.run([sys.executable, DRIVER, "--max-rows", "2", "learner", "--config", str(cfg)], env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    retries = [line for line in out.stderr.splitlines() if "retrying the step with learner.micro_batch_tokens=" in line]
    assert len(retries) >= 2, out.stderr[-4000:]  # 16 sequences, then a group of 4, before runs of 2 fit
    budgets = [int(line.split("micro_batch_tokens=")[1].split()[0]) for line in retries]
    assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == len(budgets)  # smaller each time
    assert "(16 sequences)" in retries[0] and budgets[0] == int(retries[0].split("batch of ")[1].split()[0]) // 2
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["micro_batches"] >= 8 for r in rows)
    trained = _trained(run)
    assert trained == Counter(g.group_id for g in groups)  # lost 0, twice 0
    depth, done = _queue(redis_server.url, redis_ns, [g.group_id for g in groups])
    assert depth == 0 and all(done)  # the final checkpoint committed them
    assert "Traceback" not in out.stderr


def test_when_one_sequence_does_not_fit_the_learner_stops_in_one_line(groups, tiny_model_dir, redis_server, redis_ns,
                                                                       tmp_path):
    cfg = _setup(tmp_path, tiny_model_dir, redis_server, redis_ns, groups[:4])
    out = subprocess.run([sys.executable, DRIVER, "--max-rows", "0", "learner", "--config", str(cfg)], env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-4000:]
    assert "Traceback" not in out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("streamgrpo learner:")]
    assert "out of memory in a learner step with one sequence per micro-batch" in line
    for setting in ("learner.gradient_checkpointing", "rollout.max_completion_length", "data.max_pixels",
                    "zero2_offload"):
        assert setting in line, setting
    run = tmp_path / "run"
    assert not _trained(run) and not (run / "checkpoints").exists()  # nothing trained, nothing committed
    depth, done = _queue(redis_server.url, redis_ns, [g.group_id for g in groups[:4]])
    assert not any(done)  # the groups are still the queue's, for a learner that fits


@pytest.mark.slow
def test_two_ranks_agree_on_the_retry_when_one_runs_out(groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    """DeepSpeed ranks (gloo): only rank 1 runs out; both retry the step together with the same budget."""
    from streamgrpo.runtime.processes import free_port

    cfg = _setup(tmp_path, tiny_model_dir, redis_server, redis_ns, groups, "learner.backend=deepspeed",
                 "learner.dist_backend=gloo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), DRIVER, "--max-rows", "4", "--rank", "1", "learner", "--config",
           str(cfg)]
    out = run_session(cmd, env=ENV, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    text = out.stdout + out.stderr
    assert "retrying the step with learner.micro_batch_tokens=" in text
    run = tmp_path / "run"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert _trained(run) == Counter(g.group_id for g in groups)  # over both ranks: lost 0, twice 0
