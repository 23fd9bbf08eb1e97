"""No message can take the learner down: poison groups in a real Redis stream, a real tiny model.

Each case injects a group into the stream that used to crash the learner (a token id outside the
vocabulary, a NaN behaviour log-prob) or whose training raises, and checks that the learner
trains every other group, dead-letters the bad one alone (named by group id and stream id), and
goes on.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from streamgrpo import metrics
from streamgrpo.wire import encode


def value(metric, **labels) -> float:
    m = metric.labels(**labels) if labels else metric
    return m._value.get()


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 9, num_generations=4, max_tokens=6)


def _cfg(model_dir, run_dir, url, ns, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}", f"queue.url={url}",
                                f"queue.namespace={ns}", "learner.groups_per_step=4", "learner.max_steps=2",
                                "learner.get_timeout_s=0.5", "weights.pub_port=0", "weights.snapshot_port=0",
                                "metrics.port=0", "learner.max_staleness=100", *sets])


def _nan_logprob_message(group) -> bytes:
    """A wire message whose first behaviour log-prob is NaN (the encoder refuses to write one)."""
    sentinel = np.float32(-1.2345678)
    group.completions[0].logprobs[0] = sentinel
    data = bytearray(encode(group))
    at = bytes(data).find(sentinel.tobytes())
    assert at > 0
    data[at:at + 4] = np.float32(np.nan).tobytes()
    return bytes(data)


def _jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_learner_dead_letters_poison_groups_alone_and_trains_the_rest(groups, tiny_model_dir, redis_server, redis_ns,
                                                                      tmp_path):
    import copy

    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    good = [copy.deepcopy(g) for g in groups[:8]]
    vocab = copy.deepcopy(groups[8])
    vocab.group_id = "poison-vocab"
    vocab.completions[1].token_ids[2] = 10**9  # passes the wire contract, outside any Qwen vocabulary
    nan = copy.deepcopy(groups[8])
    nan.group_id = "poison-nan"
    old = copy.deepcopy(groups[8])
    old.group_id = "poison-old-schema"
    old_message = encode(old).replace(b"\xa6schema\x03", b"\xa6schema\x01", 1)  # as a pre-v2 generator wrote it
    assert old_message != encode(old)
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-producer")
    try:
        q.put_many(good[:3])
        vocab_sid = q.put(vocab)
        nan_sid = q.client.xadd(q.stream, {b"g": nan.group_id.encode(), b"d": _nan_logprob_message(nan)}).decode()
        old_sid = q.client.xadd(q.stream, {b"g": old.group_id.encode(), b"d": old_message}).decode()
        q.put_many(good[3:])
        invalid0, malformed0 = value(metrics.GROUPS_DROPPED, reason="invalid"), value(metrics.GROUPS_DROPPED,
                                                                                     reason="malformed")
        run = tmp_path / "run"
        assert run_learner(_cfg(tiny_model_dir, run, redis_server.url, redis_ns)) == 0  # no crash: it went on
        trained = [g for e in _jsonl(run / "audit" / "learner.jsonl") if e["event"] == "trained" for g in e["group_ids"]]
        assert sorted(trained) == sorted(g.group_id for g in good)
        rows = _jsonl(run / "metrics.jsonl")  # off-policy health in every step line
        assert all(0 < r["ess"] <= 1 + 1e-9 and r["kl_behaviour"] >= 0 and r["is_masked_frac"] == 0 for r in rows), \
            [(r["ess"], r["kl_behaviour"], r["is_masked_frac"]) for r in rows]
        dead = {d["group_id"]: d for d in q.dead_letters()}
        assert dead["poison-vocab"]["stream_id"] == vocab_sid and "10**9" not in dead["poison-vocab"]["reason"]
        assert "token id 1000000000 is outside the model's vocabulary" in dead["poison-vocab"]["reason"]
        assert "poison-vocab" in dead["poison-vocab"]["reason"]
        assert dead["poison-nan"]["stream_id"] == nan_sid and "not finite" in dead["poison-nan"]["reason"]
        assert dead["poison-old-schema"]["stream_id"] == old_sid
        assert "upgrade the generator" in dead["poison-old-schema"]["reason"]
        assert dead["poison-vocab"]["data"] > 0  # the message is kept for inspection
        assert value(metrics.GROUPS_DROPPED, reason="invalid") == invalid0 + 1
        assert value(metrics.GROUPS_DROPPED, reason="malformed") == malformed0 + 2
        assert q.depth() == 0 and q.held_count() == 0  # trained ones committed, poison ones out of the stream
        assert q.is_trained([g.group_id for g in good]) == [True] * 8
    finally:
        q.close()


def test_a_step_that_raises_dead_letters_the_group_that_fails_alone(groups, tiny_model_dir, redis_server, redis_ns,
                                                                     tmp_path):
    """An exception inside the training step (here: a token id the gate did not see) is pinned on the
    group that raises alone; it is dead-lettered as poison, the others train in the next step."""
    import copy
    from collections import Counter

    from streamgrpo.learner.intake.gate import Gate
    from streamgrpo.learner.intake.poison import guarded_step
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.runtime.jsonl import JsonlWriter
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    cfg = _cfg(tiny_model_dir, tmp_path, redis_server.url, redis_ns)
    learner = Learner(cfg)
    q = RedisQueue(redis_server.url, namespace=redis_ns)
    audit = JsonlWriter(tmp_path / "audit.jsonl")
    try:
        q.put_many([copy.deepcopy(g) for g in groups[:5]])
        gate = Gate(q, cfg.loss, learner.state, audit, learner.processor, learner.vocab_size,
                    max_staleness=cfg.learner.max_staleness)
        batch = [gate.admit(d) for d in q.get(4, timeout_s=1.0)]
        assert all(a is not None for a in batch) and gate.drops == Counter()
        bad = batch[2]
        bad.group.completions[0].token_ids = np.array([5, 10**9, 7], dtype=np.int32)  # arrived after the gate
        bad.group.completions[0].logprobs = np.zeros(3, dtype=np.float32)
        before = {n: p.detach().clone() for n, p in learner.module.named_parameters() if p.requires_grad}
        poison0 = value(metrics.GROUPS_DROPPED, reason="poison")
        out, carry = guarded_step(learner, q, gate, batch, learner.dist)
        assert out is None and [a.group.group_id for a in carry] == [batch[i].group.group_id for i in (0, 1, 3)]
        for n, p in learner.module.named_parameters():  # nothing applied, no gradient left behind
            if p.requires_grad:
                assert torch_equal(p, before[n]) and p.grad is None, n
        dead = {d["group_id"]: d for d in q.dead_letters()}
        assert dead[bad.group.group_id]["stream_id"] == bad.stream_id
        assert "training on it alone failed: BatchError" in dead[bad.group.group_id]["reason"]
        assert value(metrics.GROUPS_DROPPED, reason="poison") == poison0 + 1 and gate.drops["poison"] == 1
        more = [gate.admit(d) for d in q.get(1, timeout_s=1.0)]
        out, carry = guarded_step(learner, q, gate, carry + more, learner.dist)
        assert out is not None and carry == [] and out.tokens > 0
    finally:
        audit.close()
        q.close()


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.detach(), b))


def test_a_group_that_keeps_failing_is_dead_lettered_after_max_failures(groups, redis_server, redis_ns):
    """With several ranks a failing step re-raises (one rank cannot probe alone); the failures are
    counted in Redis per group, and at queue.max_failures the next read dead-letters the group."""
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=redis_ns, max_failures=2, claim_idle_s=0.2)
    try:
        sid = q.put(groups[0])
        (d,) = q.get(1, timeout_s=1.0)
        assert q.record_failure([groups[0].group_id], "RuntimeError: boom") == [1]
        q.close()
        q = RedisQueue(redis_server.url, namespace=redis_ns, max_failures=2)  # a restarted learner
        (d,) = q.get(1, timeout_s=1.0)  # re-read: one failure is below the bound
        assert d.stream_id == sid
        assert q.record_failure([groups[0].group_id], "RuntimeError: boom again") == [2]
        q.close()
        q = RedisQueue(redis_server.url, namespace=redis_ns, max_failures=2)
        poison0 = value(metrics.GROUPS_DROPPED, reason="poison")
        assert q.get(1, timeout_s=0.3) == []
        (letter,) = q.dead_letters()
        assert letter["stream_id"] == sid and letter["group_id"] == groups[0].group_id
        assert "training failed 2 times; last error: RuntimeError: boom again" in letter["reason"]
        assert value(metrics.GROUPS_DROPPED, reason="poison") == poison0 + 1
        assert q.depth() == 0 and q.held_count() == 0
    finally:
        q.close()


def _gate(tiny_model_dir, tmp_path, url, ns, *sets):
    from streamgrpo.learner.intake.gate import Gate
    from streamgrpo.learner.state import LearnerState
    from streamgrpo.models.loading import load_processor
    from streamgrpo.runtime.jsonl import JsonlWriter
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    cfg = _cfg(tiny_model_dir, tmp_path, url, ns, *sets)
    q = RedisQueue(url, namespace=ns)
    audit = JsonlWriter(tmp_path / "audit.jsonl")
    return Gate(q, cfg.loss, LearnerState(), audit, load_processor(str(tiny_model_dir)), 10**6,
                max_staleness=cfg.learner.max_staleness), q, audit


def test_a_burst_of_stale_groups_is_logged_with_counts(groups, tiny_model_dir, redis_server, redis_ns, tmp_path,
                                                        caplog):
    import copy
    import logging

    gate, q, audit = _gate(tiny_model_dir, tmp_path, redis_server.url, redis_ns, "learner.max_staleness=2")
    try:
        gate.state.version = 10
        old = [copy.deepcopy(g) for g in groups[:3]]
        for v, g in zip((3, 4, 9), old):
            g.policy_version = v
        q.put_many(old)
        with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
            admitted = [gate.admit(d) for d in q.get(3, timeout_s=1.0)]
        assert admitted[:2] == [None, None] and admitted[2] is not None  # v9 is 1 behind: kept
        assert gate.drops["stale"] == 2
        (line,) = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
        assert "dropped 1 stale group(s) (policy v3..v3; learner at v10, max_staleness 2)" in line
        gate._stale_logged -= 10.0  # the next burst, ten seconds on
        caplog.clear()
        later = copy.deepcopy(groups[3])
        later.policy_version = 1
        q.put(later)
        with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
            assert gate.admit(q.get(1, timeout_s=1.0)[0]) is None
        assert any("dropped 2 stale group(s) (policy v1..v4" in r.getMessage() for r in caplog.records)
    finally:
        audit.close()
        q.close()


def test_a_group_in_the_checkpoint_is_refused_although_redis_forgot_it(groups, tiny_model_dir, redis_server, redis_ns,
                                                                     tmp_path):
    """The checkpoint's memory of trained ids is the second gate (e.g. Redis restarted without its data)."""
    gate, q, audit = _gate(tiny_model_dir, tmp_path, redis_server.url, redis_ns)
    try:
        gate.state.remember([groups[0].group_id])
        q.put(groups[0])  # a fresh XADD; Redis has no record of it
        (d,) = q.get(1, timeout_s=1.0)
        dup0 = value(metrics.GROUPS_DROPPED, reason="duplicate")
        assert gate.admit(d) is None and gate.drops["duplicate"] == 1
        assert value(metrics.GROUPS_DROPPED, reason="duplicate") == dup0 + 1
        assert q.depth() == 0 and q.held_count() == 0  # released
        q.put(groups[1])
        assert gate.admit(q.get(1, timeout_s=1.0)[0]) is not None  # positive control
    finally:
        audit.close()
        q.close()


def test_a_behaviour_log_prob_of_minus_100_trains(groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    """A behaviour log-prob of -100 is inside the wire's range [-1000, 0] (a float32 sampler can reach it).
    It used to overflow exp(log pi - log mu) and make the gradient NaN, so the group was dead-lettered as
    poison; the log ratio is clamped before exp now (loss.LOG_RATIO_CLAMP) and the group trains with the rest."""
    import copy

    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    good = [copy.deepcopy(g) for g in groups[:7]]
    low = copy.deepcopy(groups[7])
    low.group_id = "behaviour-minus-100"
    low.completions[0].logprobs[0] = -100.0
    q = RedisQueue(redis_server.url, namespace=redis_ns, consumer="test-producer")
    try:
        q.put_many(good[:3])
        q.put(low)
        q.put_many(good[3:])
        nan0, poison0 = value(metrics.GROUPS_DROPPED, reason="nan_loss"), value(metrics.GROUPS_DROPPED, reason="poison")
        run = tmp_path / "run"
        assert run_learner(_cfg(tiny_model_dir, run, redis_server.url, redis_ns)) == 0
        trained = [g for e in _jsonl(run / "audit" / "learner.jsonl") if e["event"] == "trained" for g in e["group_ids"]]
        assert sorted(trained) == sorted([g.group_id for g in good] + ["behaviour-minus-100"])
        assert not q.dead_letters()
        assert value(metrics.GROUPS_DROPPED, reason="nan_loss") == nan0
        assert value(metrics.GROUPS_DROPPED, reason="poison") == poison0
        rows = _jsonl(run / "metrics.jsonl")
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    finally:
        q.close()
