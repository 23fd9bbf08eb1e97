"""The live agreement guard through a real learner loop (real Redis, the tiny model): groups sampled
with the learner's current weights whose behaviour log-probs were shifted (a generator that computes
another policy) make the learner log one warning line and set streamgrpo_learner_agreement_kl; the
same groups unshifted read KL ~0."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from streamgrpo import metrics

SHIFT = 0.5  # the generator reports log p - 0.5 for every token: k3 = e^0.5 - 1 - 0.5 = 0.1487


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 4, num_generations=4, max_tokens=6)


def _run(groups, tiny_model_dir, redis_server, ns, run, *sets):
    import json

    from streamgrpo.config import load_config
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    q = RedisQueue(redis_server.url, namespace=ns, consumer="test-producer")
    try:
        q.put_many(groups)
    finally:
        q.close()
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={run}", f"queue.url={redis_server.url}",
                               f"queue.namespace={ns}", "learner.groups_per_step=4", "learner.max_steps=1",
                               "learner.get_timeout_s=0.5", "weights.pub_port=0", "weights.snapshot_port=0",
                               "metrics.port=0", "loss.beta=0", "learner.agreement_window=1", *sets])
    assert run_learner(cfg) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_generator_that_computes_another_policy_is_caught_live(groups, tiny_model_dir, redis_server, tmp_path,
                                                                 caplog):
    shifted = copy.deepcopy(groups)
    for g in shifted:
        for c in g.completions:
            c.logprobs = (np.asarray(c.logprobs, np.float32) - SHIFT).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
        (row,) = _run(shifted, tiny_model_dir, redis_server, "live-bad", tmp_path / "bad")
    expected = math.exp(SHIFT) - 1 - SHIFT
    assert row["fresh_tokens"] == sum(len(c.token_ids) for g in groups for c in g.completions)  # all at staleness 0
    assert row["kl_fresh"] == pytest.approx(expected, rel=1e-3)
    assert metrics.AGREEMENT_KL._value.get() == pytest.approx(expected, rel=1e-3)
    assert metrics.AGREEMENT_MAX_KL._value.get() == 0.01
    warned = [r.getMessage() for r in caplog.records if "generators and learner disagree" in r.getMessage()]
    assert len(warned) == 1 and "> 0.01 (learner.agreement_max_kl)" in warned[0]


def test_the_same_groups_as_sampled_agree(groups, tiny_model_dir, redis_server, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
        (row,) = _run(copy.deepcopy(groups), tiny_model_dir, redis_server, "live-good", tmp_path / "good")
    assert row["fresh_tokens"] > 0 and row["kl_fresh"] < 1e-6
    assert metrics.AGREEMENT_KL._value.get() < 1e-6
    assert not [r for r in caplog.records if "disagree" in r.getMessage()]
