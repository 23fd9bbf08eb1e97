"""The live agreement guard on stale tokens, through a real learner loop (real Redis, the tiny model).

An asynchronous run trains on tokens a few versions old, so the staleness-0 check sees nothing after the
first steps. Here a producer pushes groups that are 2 versions old when trained (as an async generator's
are); after ``SHIFT_AFTER`` groups it starts reporting every log-prob 1 lower (a generator that computes
another policy mid-run). The learner must warn within a few steps and set
streamgrpo_learner_agreement_drift{staleness="2"}; the same run without the shift must not warn.
"""

from __future__ import annotations

import copy
import json
import logging
import uuid
from pathlib import Path

import numpy as np
import pytest

from streamgrpo import metrics

PER_STEP = 4
STALENESS = 2
SHIFT_AFTER = 7 * PER_STEP  # steps 1-7 as sampled (bucket 2 gets 5 steps of history), shifted from step 8
STEPS = 11


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", PER_STEP, num_generations=4,
                         max_tokens=6)


def _stream(groups, shift: float):
    """STEPS x PER_STEP groups in the order the learner takes them: step k (learner at v k-1) gets groups of
    policy version max(0, k-1-STALENESS); from group SHIFT_AFTER on, every log-prob reported ``shift`` lower."""
    out = []
    for i in range(STEPS * PER_STEP):
        g = copy.deepcopy(groups[i % PER_STEP])
        g.group_id = uuid.uuid4().hex
        g.policy_version = max(0, i // PER_STEP - STALENESS)
        for c in g.completions:
            c.versions = None
            if i >= SHIFT_AFTER:
                c.logprobs = (np.asarray(c.logprobs, np.float32) - shift).astype(np.float32)
        out.append(g)
    return out


def _run(stream, tiny_model_dir, redis_server, ns, run, steps=STEPS):
    from streamgrpo.config import load_config
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=ns, consumer="test-producer")
    try:
        q.put_many(stream)
    finally:
        q.close()
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={run}", f"queue.url={redis_server.url}",
                               f"queue.namespace={ns}", f"learner.groups_per_step={PER_STEP}",
                               f"learner.max_steps={steps}", "learner.save_steps=1000", "learner.get_timeout_s=0.5",
                               "weights.pub_port=0", "weights.snapshot_port=0", "metrics.port=0", "loss.beta=0"])
    assert run_learner(cfg) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _drift():
    return metrics.AGREEMENT_DRIFT.labels(staleness="2")._value.get()


def _warnings():
    return metrics.AGREEMENT_WARNINGS.labels(staleness="2")._value.get()


def test_a_generator_that_shifts_mid_run_is_caught_on_stale_tokens(groups, tiny_model_dir, redis_server, tmp_path,
                                                                   caplog):
    before = _warnings()
    with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
        rows = _run(_stream(groups, 1.0), tiny_model_dir, redis_server, "drift-bad", tmp_path / "bad",
                    steps=SHIFT_AFTER // PER_STEP + 2)  # the learner stops 2 steps after the shift: warned by then
    assert len(rows) == SHIFT_AFTER // PER_STEP + 2
    later = rows[STALENESS:]
    assert all(r["fresh_tokens"] == 0 and set(r["staleness_tokens"]) == {"2"} for r in later)  # blind at staleness 0
    first_shifted = SHIFT_AFTER // PER_STEP  # index of the first step with shifted groups
    before_kl = [r["staleness_kl"]["2"] for r in rows[STALENESS:first_shifted]]
    after = rows[first_shifted:]
    assert all(r["staleness_log_ratio"]["2"] > 0.8 for r in after)  # the log-ratio moved by about the shift
    assert min(r["kl_behaviour"] for r in after) > 3 * max(before_kl)
    warned = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("generators and learner disagree on tokens 2 version(s) old")
    assert _drift() == 1.0 and _warnings() == before + 1
    assert metrics.AGREEMENT_LOG_RATIO.labels(staleness="2")._value.get() > 0.8


def test_the_same_stream_unshifted_never_warns(groups, tiny_model_dir, redis_server, tmp_path, caplog):
    before = _warnings()
    with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
        rows = _run(_stream(groups, 0.0), tiny_model_dir, redis_server, "drift-good", tmp_path / "good")
    assert len(rows) == STEPS and all(set(r["staleness_tokens"]) == {"2"} for r in rows[STALENESS:])
    assert not [r for r in caplog.records if "disagree" in r.getMessage()]
    assert _drift() == 0.0 and _warnings() == before
    assert all(abs(r["staleness_log_ratio"]["2"]) < 0.2 for r in rows[STALENESS:])
