"""The data cursor end to end: a learner and a generator (shard 1 of 2) train with checkpoints, both are killed
with -9, both start again (the learner with ``--resume``, the generator as before: no flag). The restarted
generator's first prompt is the record after the cursor the learner committed with its checkpoint, not record 0
of its shard; that cursor is the furthest record of the groups that checkpoint holds, never one ahead of them;
and the audit finds no group lost and none trained twice. Real redis-server, the tiny model, real processes.

Also the queue's side on its own: the cursor is written with the commit of a checkpoint's groups, never by an
older checkpoint's commit, and a new run (step 0) clears it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "WANDB_MODE": "disabled"}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _spawn(config: Path, run: Path, name: str, *args: str) -> subprocess.Popen:
    role = "generator" if name.startswith("generator") else "learner"
    return subprocess.Popen([sys.executable, "-m", "streamgrpo", role, "--config", str(config), *args], env=ENV,
                            stdout=open(run / f"{name}.log", "ab"), stderr=subprocess.STDOUT)


def _wait(predicate, what: str, procs, run: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"{what}: {p.args[3]} exited with {p.returncode}\n" + "".join(
                f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(run.glob("*.log")))
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()


def _checkpoints(run: Path) -> list[int]:
    root = run / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if p.name.split("-")[1].isdigit()) \
        if root.is_dir() else []


def test_a_restarted_generator_continues_its_shard_where_the_learners_checkpoint_says(tiny_model_dir, demo_data_dir,
                                                                                      redis_server, redis_ns, tmp_path):
    from benchmarks.audit import audit_run
    from streamgrpo.config import load_config
    from streamgrpo.data.cursor import next_position
    from streamgrpo.data.dataset import shard_records
    from streamgrpo.data.records import load_records
    from streamgrpo.runtime.processes import free_port
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("demo", [
        f"run_dir={run}", f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false", "demo.make_data=false",
        f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}", "data.kinds=null", f"queue.url={redis_server.url}",
        f"queue.namespace={redis_ns}", "queue.claim_idle_s=2", "rollout.num_generators=2", "rollout.num_generations=2",
        "rollout.prompts_per_batch=2", "rollout.stop_grace_s=0", "learner.groups_per_step=2", "learner.save_steps=3",
        "learner.max_steps=1000", "learner.get_timeout_s=0.5", "learner.max_staleness=100",
        f"weights.pub_port={free_port()}", f"weights.snapshot_port={free_port()}", "metrics.port=0", "eval.enabled=false"])
    config = run / "config-test.yaml"
    config.write_text(cfg.to_yaml())
    produced = lambda: [r for r in _jsonl(run / "audit" / "generator-1.jsonl") if r["event"] == "produced"]  # noqa: E731
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-inspector")
    procs: list[subprocess.Popen] = []
    try:
        # 1. a new run: generator 1 of 2 reads shard 1 from its beginning; both killed -9 after a checkpoint
        procs = [_spawn(config, run, "learner"), _spawn(config, run, "generator-1", "--id", "1")]
        _wait(lambda: q.committed_cursors(), "a checkpoint and its commit", procs, run)
        _kill(*procs)
        first = produced()
        assert first[0]["source"] == [2, 1, 0, 0]  # a new run starts the shard at its beginning
        step = q.committed_step()
        assert step in _checkpoints(run)
        (epoch, position, at), = [v for k, v in q.committed_cursors().items() if k == (2, 1)]
        assert at == step and (epoch, position) > (0, 0)
        # the cursor is the furthest record of the groups that checkpoint holds: never ahead of what was trained
        source = {r["group_id"]: tuple(r["source"][2:]) for r in first}
        rows = _jsonl(run / "audit" / "learner.jsonl")
        held = [g for r in rows if r["event"] == "trained" and r["step"] <= step for g in r["group_ids"]]
        dropped = [r["group_id"] for r in rows if r["event"] == "dropped"]
        assert held and all(q.is_trained(held))
        assert max(source[g] for g in held) <= (epoch, position) <= max(source[g] for g in held + dropped)

        # 2. both started again: the learner with --resume, the generator with the same command as before
        procs = [_spawn(config, run, "learner", "--resume")]
        _wait(lambda: any(r["event"] == "resumed" for r in _jsonl(run / "audit" / "learner.jsonl")), "the resume",
              procs, run)
        newest = _checkpoints(run)[-1]  # step, or a later one killed before its commit: rolled forward now
        state = json.loads((run / "checkpoints" / f"step-{newest:06d}" / "trainer_state.json").read_text())
        epoch, position = state["learner"]["data_cursor"]["2/1"]  # a --resume restores it from here
        assert q.committed_cursors()[(2, 1)] == (epoch, position, newest)
        procs.append(_spawn(config, run, "generator-1", "--id", "1"))
        _wait(lambda: len(produced()) > len(first), "the restarted generator's first group", procs, run)
        again = produced()[len(first):]
        shard = len(shard_records(load_records(cfg.data.train_path, cfg.data), 1, 2))
        # the generator read the cursor committed when it started: the resumed checkpoint's, or a later one's
        # (the resumed learner trains the groups still queued meanwhile)
        said = re.search(r"generator-1: shard 1/2: resuming at epoch (\d+), record (\d+) of (\d+) \(committed by the "
                         r"learner at step (\d+)\)", (run / "generator-1.log").read_text())
        assert said, (run / "generator-1.log").read_text()[-3000:]
        e, p, size, at = (int(x) for x in said.groups())
        state = json.loads((run / "checkpoints" / f"step-{at:06d}" / "trainer_state.json").read_text())
        assert size == shard and at >= newest and (e, p) == next_position(*state["learner"]["data_cursor"]["2/1"], shard)
        assert again[0]["source"] == [2, 1, e, p], (again[0], e, p)
        assert (e, p) >= next_position(epoch, position, shard) > (0, 0)  # not record 0 of the shard
        for proc, name in zip(procs, ("learner", "generator-1")):  # SIGTERM: the learner's final checkpoint; exit 0
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(600) == 0, (run / f"{name}.log").read_text()[-3000:]
        result = audit_run(run, q)
        assert (result.lost, result.twice) == (0, 0) and result.resumes == 1 and result.steps_in_order, result
        # the final checkpoint committed the cursor of everything trained: still never ahead of it
        final = q.committed_cursors()[(2, 1)]
        trained = [g for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "trained" for g in r["group_ids"]]
        sources = {r["group_id"]: tuple(r["source"][2:]) for r in produced()}
        dropped = [r["group_id"] for r in _jsonl(run / "audit" / "learner.jsonl") if r["event"] == "dropped"]
        assert final[2] == result.steps == q.committed_step()
        assert max(sources[g] for g in trained) <= final[:2] <= max(sources[g] for g in trained + dropped)
    finally:
        _kill(*procs)
        q.close()


def test_a_generator_that_started_on_a_stale_version_moves_to_the_cursor_the_resumed_learner_commits(
        tiny_model_dir, demo_data_dir, redis_server, redis_ns, weight_publisher, tmp_path):
    """A requeued job: the generator's first version comes from what outlived the last allocation (a host's relay
    still serving v32) while the learner has not resumed yet, so the cursor it reads at start is the old one (step
    26). The learner then resumes from a later checkpoint (step 28: it rolls the cursor forward) and steps on; with
    its first version past the stale one (v33) the generator reads the cursor again and moves its shard there."""
    from streamgrpo.config import load_config
    from streamgrpo.models.loading import load_model
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("demo", [
        f"run_dir={run}", f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false", "demo.make_data=false",
        f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}", "data.kinds=null", f"queue.url={redis_server.url}",
        f"queue.namespace={redis_ns}", "rollout.num_generators=1", "rollout.num_generations=2",
        "rollout.prompts_per_batch=2", "rollout.stop_grace_s=0", "rollout.max_completion_length=8",
        "queue.max_pending=1000", "rollout.num_epochs=1000",  # no learner takes groups here: room for them all
        f"weights.pub_port={weight_publisher.pub_port}", f"weights.snapshot_port={weight_publisher.snapshot_port}",
        "metrics.port=0", "eval.enabled=false"])
    config = run / "config-test.yaml"
    config.write_text(cfg.to_yaml())
    net = load_model(cfg.model, "cpu", dtype="float32")
    tensors = {n: p.detach().clone() for n, p in net.named_parameters()}
    produced = lambda: [r for r in _jsonl(run / "audit" / "generator-0.jsonl") if r["event"] == "produced"]  # noqa: E731
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-learner")
    procs: list[subprocess.Popen] = []
    try:
        q.commit([], step=26, cursor={"1/0": (0, 3)})  # what the last allocation's learner committed
        weight_publisher.publish(32, tensors)  # the stale version: served at once
        procs = [_spawn(config, run, "generator-0", "--id", "0")]
        _wait(lambda: len(produced()) >= 2, "the generator's first groups", procs, run)
        assert produced()[0]["source"] == [1, 0, 0, 4]  # after the cursor of step 26
        q.commit([], step=28, cursor={"1/0": (500, 10)})  # the learner resumed from step 28's checkpoint (epochs on)
        weight_publisher.publish(33, tensors)  # its first version after the stale one
        _wait(lambda: any(r["source"][2:] >= [500, 11] for r in produced()), "the shard moved to step 28's cursor",
              procs, run, timeout_s=120)
        log = (run / "generator-0.log").read_text()
        assert "the learner committed a later data cursor: shard 0/1: resuming at epoch 500, record 11" in log, log[-2000:]
        assert "(committed by the learner at step 28)" in log
        later = [r["source"][2:] for r in produced() if r["source"][2:] >= [500, 11]]
        assert later[0] == [500, 11]  # the first record after the new cursor, none skipped
    finally:
        _kill(*procs)
        q.close()


def test_the_queue_commits_a_checkpoints_cursor_never_an_older_ones_and_a_new_run_clears_it(redis_server, redis_ns):
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="learner-0")
    try:
        assert q.committed_cursors() == {}
        q.commit([], step=4, cursor={"2/0": (0, 9), "2/1": (1, 2)})
        q.commit([], step=3, cursor={"2/0": (0, 5)})  # an older checkpoint's commit (rolled forward late)
        assert q.committed_cursors() == {(2, 0): (0, 9, 4), (2, 1): (1, 2, 4)} and q.committed_step() == 4
        q.commit([], step=4, cursor={"2/0": (0, 9), "2/1": (1, 2)})  # a resume rolls the same one forward
        q.client.delete(q.cursor_key)  # Redis lost it (no AOF): a resumed learner's roll-forward writes it back
        q.commit([], step=4, cursor={"2/0": (0, 9)})
        assert q.committed_cursors() == {(2, 0): (0, 9, 4)}
        q.reset_committed_step()  # a learner at step 0: a new run
        assert q.committed_cursors() == {} and q.committed_step() is None
    finally:
        q.close()
