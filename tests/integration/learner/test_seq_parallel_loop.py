"""The learner loop with ``learner.sequence_parallel: 2`` (issue 63 item 2): two gloo ranks under a real torchrun,
the ``streamgrpo learner`` CLI on the tiny Qwen2.5-VL, a real redis-server fed ScoredGroups sampled from the demo
videos; then ``--resume`` from its checkpoint.

The two ranks are one sequence-parallel group: rank 0 alone reads the groups from Redis and hands them to rank 1
(:class:`streamgrpo.learner.distributed.ReadLayout`); both train every step; rank 0 alone commits, audits and counts
them. The audit over both ranks' logs finds every group trained exactly once, and the metrics count each once.

The first run is on a device that holds 4 sequences a forward, and on rank 1 only
(tests/integration/learner/memory/oom_driver.py): its forward runs out inside the first decoder layer, between two
exchanges of heads, and its first backward through that layer runs out once. Both ranks retry the step together,
with half the micro-batch budget each time, instead of rank 0 waiting in the next exchange.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_learner_scale import ENV, _config, _jsonl, _kill_rank_in_its_step, _put, _torchrun

from tests.sessions import run_session

pytestmark = pytest.mark.slow
OOM_DRIVER = str(Path(__file__).parent / "memory" / "oom_driver.py")
POISON_DRIVER = str(Path(__file__).with_name("poison_rank_driver.py"))


def test_a_sequence_parallel_group_trains_each_group_once_and_resumes(tiny_model_dir, demo_data_dir, redis_server,
                                                                      redis_ns, tmp_path):
    from conftest import sampled_groups

    from benchmarks.audit import audit_run
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    groups = sampled_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 8, num_generations=4, max_tokens=6)
    url, run = redis_server.url, tmp_path / "run"

    def launch(steps: int, *flags: str, run_with: tuple[str, ...] = ("-m", "streamgrpo")) -> str:
        cfg = _config(tmp_path, tiny_model_dir, url, redis_ns, "learner.backend=torch", "learner.sequence_parallel=2",
                      "learner.groups_per_step=2", f"learner.max_steps={steps}", "learner.save_steps=2",
                      "learner.async_checkpoint=false")
        return _torchrun(*run_with, "learner", "--config", str(cfg), *flags, cwd=tmp_path).stderr

    _put(url, redis_ns, groups[:4])
    first = launch(2, run_with=(OOM_DRIVER, "--max-rows", "4", "--rank", "1", "--in-decoder", "--backward-once"))
    assert "2 groups per step (2 per group of 2 ranks)" in first  # steps 1-2, checkpoint step-000002
    retries = [line for line in first.splitlines() if "retrying the step with learner.micro_batch_tokens=" in line]
    assert len(retries) == 2, first[-4000:]  # 8 sequences in the forward, then 4 in the backward (once)
    assert "(8 sequences)" in retries[0] and "(4 sequences)" in retries[1], retries
    assert "Traceback" not in first
    assert (run / "checkpoints" / "step-000002").is_dir()
    _put(url, redis_ns, groups[4:])
    again = launch(4, "--resume")  # steps 3-4 from the checkpoint
    assert "resumed from" in again and "at step 2" in again

    rows = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["ranks"] for r in rows] == [2] * 4
    assert [r["groups_trained"] for r in rows] == [2, 4, 6, 8]  # each group counted once, not once per rank
    assert all(r["tokens"] > 0 and r["loss"] == r["loss"] for r in rows)
    trained = [r for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "trained"]
    assert [len(r["group_ids"]) for r in trained] == [2] * 4  # the reader's: the step's groups
    helper = _jsonl(run / "audit" / "learner-rank1.jsonl")
    assert helper and not [r for r in helper if r["event"] == "trained"]  # rank 1 trained them, owns none
    with RedisQueue(url, namespace=redis_ns, consumer="test-inspect") as q:
        audit = audit_run(run, q)
        held, depth = q.held_count(), q.depth()
    assert (audit.lost, audit.twice, audit.uncommitted, audit.trained, audit.steps, held, depth) == (0, 0, 0, 8, 4, 0, 0)
    assert audit.steps_in_order and audit.resumes == 1


def _one_group_a_step(tmp_path: Path, model_dir, url: str, ns: str, *sets: str) -> Path:
    """A sequence-parallel group of 2 torch ranks, one group a step, 3 steps, no checkpoint on the way."""
    return _config(tmp_path, model_dir, url, ns, "learner.backend=torch", "learner.sequence_parallel=2",
                   "learner.groups_per_step=1", "learner.max_steps=3", "learner.save_steps=100", "queue.max_failures=1",
                   *sets)


def _dead_letters_and_audit(url: str, ns: str, run: Path):
    """The dead letters, the exactly-once audit of ``run``, and the groups held and waiting, after a run."""
    from benchmarks.audit import audit_run
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    with RedisQueue(url, namespace=ns, consumer="test-inspect") as q:
        return q.dead_letters(), audit_run(run, q), q.held_count(), q.depth()


def test_a_group_that_kills_the_helper_rank_is_counted_and_dead_lettered(tiny_model_dir, demo_data_dir, redis_server,
                                                                        redis_ns, tmp_path):
    """Rank 1, the helper of a sequence-parallel group, dies (SIGSEGV, as a decoder that segfaults on a poison group)
    in a step: rank 0's step fails on the collective, a peer's failure. The helper had marked the step's group, so
    the resumed reader judges the helper's death its own and counts it (learner.crash_loop_starts 1): the group is
    dead-lettered, the others train. Before, only the reader marked, its mark said "peer", and the group would kill
    the helper again at every start."""
    from conftest import sampled_groups

    groups = sampled_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 8, num_generations=4, max_tokens=6)
    url, run = redis_server.url, tmp_path / "run"
    cfg = _one_group_a_step(tmp_path, tiny_model_dir, url, redis_ns, "learner.crash_loop_starts=1")
    _put(url, redis_ns, groups[:4])
    marked, text = _kill_rank_in_its_step(cfg, tmp_path, url, redis_ns)  # the helper marks its reader's group
    (killer,) = marked
    assert "another rank or the link between ranks failed" in text, text[-4000:]

    again = _torchrun("-m", "streamgrpo", "learner", "--config", str(cfg), "--resume", cwd=tmp_path).stderr
    assert f"(group {killer}): crash_loop: the learner died while training it" in again, again[-4000:]
    dead, audit, held, depth = _dead_letters_and_audit(url, redis_ns, run)
    assert [(d["group_id"], "consecutive starts" in d["reason"]) for d in dead] == [(killer, True)], dead
    assert (audit.lost, audit.twice, audit.trained, audit.steps, held, depth) == (0, 0, 3, 3, 0, 0), audit


def test_a_group_whose_step_raises_on_the_helper_alone_is_counted_and_dead_lettered(tiny_model_dir, demo_data_dir,
                                                                                   redis_server, redis_ns, tmp_path):
    """The helper's step raises on one group (poison_rank_driver.py: rank 1 only, as a bug one rank's share of the
    sequences trips); the reader's step fails as a peer's and counts nothing. The helper counts the failure
    (queue.max_failures 1), so the next start dead-letters the group instead of dying on it at every start."""
    from conftest import sampled_groups

    from streamgrpo.runtime.processes import free_port

    groups = sampled_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 8, num_generations=4, max_tokens=6)
    url, run, poison = redis_server.url, tmp_path / "run", groups[1].group_id  # the second step's group
    cfg = _one_group_a_step(tmp_path, tiny_model_dir, url, redis_ns)
    _put(url, redis_ns, groups[:4])

    def launch(*flags: str):
        return run_session([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                            "127.0.0.1", "--master_port", str(free_port()), POISON_DRIVER, "--rank", "1", "--group",
                            poison, "learner", "--config", str(cfg), *flags], env=ENV, cwd=tmp_path, timeout=480)

    first = launch()
    text = first.stdout + first.stderr
    assert first.returncode != 0, text[-4000:]
    assert "training step failed on this sequence-parallel rank (ValueError: injected on rank 1" in text, text[-4000:]
    assert "another rank or the link between ranks failed" in text, text[-4000:]  # the reader: a peer's failure
    again = launch("--resume")  # the group still trips rank 1: dead-lettered before it reaches a step
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    dead, audit, held, depth = _dead_letters_and_audit(url, redis_ns, run)
    assert [(d["group_id"], "training failed 1 times" in d["reason"]) for d in dead] == [(poison, True)], dead
    assert (audit.lost, audit.twice, audit.trained, audit.steps, held, depth) == (0, 0, 3, 3, 0, 0), audit
