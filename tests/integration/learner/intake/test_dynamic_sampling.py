"""Dynamic sampling (loss.drop_zero_variance) on a real Redis queue: groups whose rewards are all
equal are dropped before the step and counted, the step is filled with further groups, and after
loss.fill_timeout_s a step trains on what it has."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from streamgrpo import metrics


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 6, num_generations=4, max_tokens=4)


def _flat(g, value: float):
    g = copy.deepcopy(g)
    g.group_id += "-flat"
    for c in g.completions:
        c.reward = value
    return g


def _collect(tiny_model_dir, tmp_path, url, ns, put, want, *sets):
    from streamgrpo.config import load_config
    from streamgrpo.learner.distributed import DistInfo
    from streamgrpo.learner.intake.gate import Gate, collect_groups
    from streamgrpo.learner.state import LearnerState
    from streamgrpo.models.loading import load_processor
    from streamgrpo.runtime.jsonl import JsonlWriter
    from streamgrpo.runtime.processes import StopFlag
    from streamgrpo.transport.queue.redis_stream import RedisQueue

    cfg = load_config("demo", [f"queue.url={url}", f"queue.namespace={ns}", "learner.get_timeout_s=0.2",
                               "loss.drop_zero_variance=true", *sets])
    q = RedisQueue(url, namespace=ns)
    audit = JsonlWriter(tmp_path / "audit.jsonl")
    try:
        q.put_many(put)
        gate = Gate(q, cfg.loss, LearnerState(), audit, load_processor(str(tiny_model_dir)), 10**6,
                    max_staleness=cfg.learner.max_staleness)
        batch = collect_groups(q, gate, StopFlag(install=False), DistInfo(), want, [],
                               timeout_s=cfg.learner.get_timeout_s)
        return batch, gate, q.depth(), q.held_count()
    finally:
        audit.close()
        q.close()


def value(reason: str) -> float:
    return metrics.GROUPS_DROPPED.labels(reason=reason)._value.get()


def test_all_equal_groups_are_dropped_and_the_step_filled_with_informative_ones(groups, tiny_model_dir, redis_server,
                                                                                redis_ns, tmp_path):
    put = [_flat(groups[0], 1.0), groups[1], _flat(groups[2], 0.0), groups[3], groups[4]]
    before = value("zero_variance")
    batch, gate, depth, held = _collect(tiny_model_dir, tmp_path, redis_server.url, redis_ns, put, 3)
    assert [a.group.group_id for a in batch] == [groups[i].group_id for i in (1, 3, 4)]
    assert gate.drops["zero_variance"] == 2 and value("zero_variance") == before + 2
    assert (depth, held) == (0, 3)  # the flat ones are out of the stream, the step's three are held


def test_after_the_fill_timeout_a_step_trains_on_what_it_has(groups, tiny_model_dir, redis_server, redis_ns, tmp_path):
    put = [groups[5], _flat(groups[0], 1.0)]
    batch, gate, _, _ = _collect(tiny_model_dir, tmp_path, redis_server.url, redis_ns, put, 3, "loss.fill_timeout_s=1")
    assert [a.group.group_id for a in batch] == [groups[5].group_id] and gate.drops["zero_variance"] == 1
