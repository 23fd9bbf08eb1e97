"""One valid but huge group never stops training (issue 50 item 3). Real redis-server, the tiny model,
real mp4 frames, a real learner process killed with -9.

* a group past the learner's own limits (``learner.max_group_pixels`` / ``max_group_tokens``, by default
  the data config's) is dead-lettered ``too_large`` before anything of it is decoded;
* a group the learner dies on (here: a kill -9 while its step trains, as an out-of-memory killer does)
  in ``learner.crash_loop_starts`` consecutive starts is dead-lettered ``crash_loop``, and the run goes
  on past it: audit lost 0, twice 0.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from streamgrpo import metrics

HUGE = ["data.min_pixels=50176", "data.max_pixels=50176", "data.kinds=[colour]"]  # one video of 224 x 224 frames


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 8, num_generations=4, max_tokens=6)


@pytest.fixture(scope="module")
def huge(tiny_model_dir, demo_data_dir):
    """A group that follows every rule of the wire, sampled from 224 x 224 frames (the learner re-processes
    them to the same prompt: it would train)."""
    from benchmarks.rollouts import sample_groups

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 1, num_generations=4, max_tokens=6,
                         data_overrides=HUGE, seed=5)[0]


def _cfg(model_dir, run_dir, url, ns, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}", f"queue.url={url}",
                                f"queue.namespace={ns}", "learner.groups_per_step=2", "learner.save_steps=1",
                                "learner.get_timeout_s=0.5", "weights.pub_port=0", "weights.snapshot_port=0",
                                "metrics.port=0", "learner.max_staleness=100", "data.min_frames=4", "data.max_frames=4",
                                "eval.enabled=false", *sets])


def test_limits_are_read_from_the_message_and_default_to_the_data_config(groups, huge):
    from streamgrpo.config import load_config
    from streamgrpo.learner.intake.limits import GroupLimits, group_pixels, group_tokens, too_large

    cfg = load_config("demo", ["data.min_frames=4", "data.max_frames=4", "rollout.num_generations=4"])
    limits = GroupLimits.from_config(cfg)
    assert all(too_large(g, limits) is None for g in groups)  # what the data config makes always passes
    assert group_pixels(groups[0]) == 4 * 56 * 56 and group_pixels(huge) == 4 * 224 * 224
    why = too_large(huge, limits)
    assert why is not None and "200,704 pixels in 1 visual(s), over 12,544" in why
    assert too_large(huge, GroupLimits.from_config(cfg.model_copy(update={"learner": cfg.learner.model_copy(
        update={"max_group_pixels": 300_000})}))) is None
    tokens = group_tokens(groups[0])
    assert tokens == sum(len(groups[0].prompt_ids) + len(c.token_ids) for c in groups[0].completions)
    small = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_group_tokens": tokens - 1})})
    assert "over learner.max_group_tokens" in too_large(groups[0], GroupLimits.from_config(small))


def test_queue_check_names_a_group_over_the_limits(groups, huge):
    from streamgrpo.commands.queue_check import check_message
    from streamgrpo.config import load_config
    from streamgrpo.learner.intake.limits import GroupLimits
    from streamgrpo.wire import encode

    limits = GroupLimits.from_config(load_config("demo", ["data.min_frames=4", "data.max_frames=4"]))
    gid, problem, _ = check_message(encode(huge), None, 0, None, 1 << 28, limits=limits)
    assert gid == huge.group_id and problem.label == "too_large" and "over 12,544" in problem.reason


def test_a_group_over_the_limits_is_dead_lettered_before_it_is_decoded(groups, tiny_model_dir, demo_data_dir,
                                                                       redis_server, redis_ns, tmp_path, caplog):
    """By reference, so decoding would happen on the learner: the huge group is refused from its declared
    size (its media file is not even there), the others train."""
    import logging

    from benchmarks.rollouts import sample_groups
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    data = Path(demo_data_dir)
    big = sample_groups(tiny_model_dir, data / "train.jsonl", 1, num_generations=4, max_tokens=6, seed=5,
                        data_overrides=HUGE, media="reference")[0]
    v = big.visuals[0]  # decoding it would dead-letter it as media_missing instead:
    big.visuals[0] = replace(v, ref=replace(v.ref, path="gone/huge.mp4"))
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-producer")
    before = metrics.GROUPS_DROPPED.labels(reason="too_large")._value.get()
    try:
        q.put_many([big, *[copy.deepcopy(g) for g in groups[:4]]])
        cfg = _cfg(tiny_model_dir, tmp_path / "run", redis_server.url, redis_ns, "learner.max_steps=2",
                   f"data.media_root={data}")
        with caplog.at_level(logging.WARNING):
            assert run_learner(cfg) == 0
        dead = q.dead_letters()
        assert [d["reason"].split(":")[0] for d in dead] == ["too_large"], dead
        assert "200,704 pixels" in dead[0]["reason"] and dead[0]["group_id"] == big.group_id
        assert metrics.GROUPS_DROPPED.labels(reason="too_large")._value.get() == before + 1
        lines = [r.getMessage() for r in caplog.records if big.group_id in r.getMessage()]
        assert len(lines) == 1 and "too_large" in lines[0], lines
        assert q.committed_step() == 2 and q.depth() == 0
    finally:
        q.close()


def _marker(q, consumer: str = "learner-0") -> list[str]:
    """The groups of the step ``consumer`` is in (``[]``: none)."""
    return q.crash_marks().read([consumer])[0].groups


def _start_and_kill_in_step(argv, env, q, gid: str, log: Path, sig: int = signal.SIGSEGV,
                            timeout_s: float = 240.0) -> tuple[bool, int | None]:
    """Start a learner (its output in ``log``); send it ``sig`` as soon as it trains a step holding ``gid``
    (SIGSEGV: a decoder that segfaults on the group; SIGKILL: a kill from outside). Returns ``(killed, exit code)``."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    cleared = False  # the last learner's mark stays until this one has counted it
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            mark = _marker(q)
            cleared |= gid not in mark
            if cleared and gid in mark:
                os.kill(proc.pid, sig)
                proc.wait(30)
                return True, None
            time.sleep(0.01)
        return False, proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_a_group_the_learner_dies_on_is_dead_lettered_after_n_starts_and_training_goes_on(
        groups, huge, tiny_model_dir, redis_server, redis_ns, tmp_path):
    """The issue's crash loop, with N = 2: the huge group (under a raised max_group_pixels, so the learner
    takes it) is in the step when the learner is killed -9 from outside (not counted), then crashes (SIGSEGV) twice; the third start dead-letters it as
    crash_loop and trains the rest; every group trained once."""
    from benchmarks.audit import audit_run
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-producer")
    try:
        q.put_many([copy.deepcopy(g) for g in groups[:2]] + [copy.deepcopy(huge)]
                   + [copy.deepcopy(g) for g in groups[2:8]])
        run = tmp_path / "run"
        path = tmp_path / "cfg.yaml"
        path.write_text(_cfg(tiny_model_dir, run, redis_server.url, redis_ns, "learner.max_steps=4",
                             "learner.max_group_pixels=1000000", "learner.crash_loop_starts=2").to_yaml())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        argv = [sys.executable, "-m", "streamgrpo", "learner", "--config", str(path), "--resume"]
        # step 1 trains; step 2 holds the huge group: killed -9 from outside in it (not counted), then crashed
        for start, sig in enumerate((signal.SIGKILL, signal.SIGSEGV, signal.SIGSEGV)):
            log = tmp_path / f"start-{start}.log"
            killed, rc = _start_and_kill_in_step(argv, env, q, huge.group_id, log, sig)
            assert killed, f"start {start}: the learner was not in a step with the huge group (rc {rc})"
        assert "killed from outside" in (tmp_path / "start-1.log").read_text()  # the kill -9 counted nothing
        assert _marker(q) == [huge.group_id], log.read_text()[-3000:]  # the second start trained it alone
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        dead = q.dead_letters()
        assert [(d["group_id"], d["reason"].split(":")[0]) for d in dead] == [(huge.group_id, "crash_loop")], dead
        assert "in 2 consecutive starts" in dead[0]["reason"]
        mentions = [line for line in out.stderr.splitlines() if huge.group_id in line]
        assert len(mentions) == 1 and "crash_loop" in mentions[0] and "Traceback" not in out.stderr, mentions
        assert q.committed_step() == 4 and not q.client.exists(f"{redis_ns}:crash_starts")
        audit = audit_run(run, q)
        assert (audit.lost, audit.twice, audit.uncommitted, audit.steps) == (0, 0, 0, 4), audit
        assert audit.steps_in_order and audit.dropped.get("crash_loop") == 1, audit
    finally:
        q.close()
