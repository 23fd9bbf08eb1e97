"""`streamgrpo up --learner-ranks 2` end to end on this CPU machine: two gloo learner ranks under a real
torchrun, two generators, a real redis-server; then `up --resume`. The audit over both ranks' logs
finds every produced group trained once or accounted for, the status line and the ports count both
ranks, and no two processes share a metrics port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "WANDB_MODE": "disabled"}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _up(run: Path, sets: list[str], *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "streamgrpo", "up", "--config", "demo", "--learner-ranks", "2", "--generators", "2",
            "--set", "launch.agreement_check=false", *flags]  # test_loop runs the check
    for s in sets:
        argv += ["--set", s]
    env = {k: v for k, v in ENV.items() if k != "STREAMGRPO_REDIS_URL"}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, cwd=run.parent)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + "".join(
        f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run / "logs").glob("*.log")))
    return out


def test_up_with_two_learner_ranks_trains_each_group_once_and_resumes(tiny_model_dir, demo_data_dir, redis_server,
                                                                       redis_ns, tmp_path):
    from benchmarks.audit import audit_run
    from streamgrpo.config import QueueConfig
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    run = tmp_path / "run"
    sets = [f"run_dir={run}", f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false",
            f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}", "demo.make_data=false", "data.kinds=null",
            f"queue.url={redis_server.url}", f"queue.namespace={redis_ns}", "learner.groups_per_step=4",
            "rollout.prompts_per_batch=2", "learner.save_steps=4", "learner.get_timeout_s=1", "metrics.port=0",
            "learner.max_staleness=100", "eval.enabled=false", "rollout.stop_grace_s=0"]
    out = _up(run, [*sets, "learner.max_steps=8"])
    assert "placement: 2 learner rank(s), 2 generator(s) on the CPU" in out.stdout
    assert "learner.backend set to deepspeed" in out.stdout and "2 learner ranks, gens" in out.stdout
    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[-1]["groups_trained"] == 8 * 4
    # every process of this `up` served /metrics on a port of its own, both ranks included
    ports = {f.stem: json.loads(f.read_text())["metrics"] for f in (run / "ports").glob("*.json") if f.stem != "weights"}
    assert set(ports) == {"learner", "learner-rank1", "generator-0", "generator-1"}
    assert len(set(ports.values())) == 4
    ranks = {name: [r for r in _jsonl(run / "audit" / f"{name}.jsonl") if r["event"] == "trained"]
             for name in ("learner", "learner-rank1")}
    assert all(len(r) == 8 for r in ranks.values())  # both ranks took part in every step
    assert all(len(r["group_ids"]) == 2 for rs in ranks.values() for r in rs)  # 4 groups a step, 2 on each rank

    q = RedisQueue.from_config(QueueConfig(url=redis_server.url, namespace=redis_ns), redis_server.url,
                               consumer="audit")
    try:
        first = audit_run(run, q)
        assert (first.lost, first.twice, first.uncommitted, first.steps, first.trained) == (0, 0, 0, 8, 32), first
        assert first.steps_in_order

        out = _up(run, [*sets, "learner.max_steps=12"], "--resume")
        for k in range(2):  # each generator went on from the data cursor the learner committed, not record 0
            assert f"generator-{k}: shard {k}/2: resuming at epoch" in (run / "logs" / f"generator-{k}.log").read_text()
        rows = _jsonl(run / "metrics.jsonl")
        assert [r["step"] for r in rows][-4:] == [9, 10, 11, 12] and rows[-1]["groups_trained"] == 12 * 4
        assert [r["step"] for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "resumed"] == [8]
        again = audit_run(run, q)
        assert (again.lost, again.twice, again.uncommitted, again.steps, again.trained) == (0, 0, 0, 12, 48), again
        assert again.resumes == 1 and again.steps_in_order
    finally:
        q.close()
