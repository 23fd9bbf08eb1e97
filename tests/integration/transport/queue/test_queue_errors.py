"""Loud failures of the queue (issue 18): a TLS mistake ends at once with one clear QueueError, like
a wrong password; a real outage (refused, dropped by a server that had been working, a proxy whose
backend is down) is still waited out. Real redis-servers with a TLS port (the ``tls_redis`` fixture)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis
from conftest import make_tls_files
from test_queue import group

from streamgrpo.transport.queue.errors import probe_plain, probe_tls
from streamgrpo.transport.queue.redis_stream import QueueError, RedisQueue
from streamgrpo.transport.queue.server import free_port

# Before the fix these mistakes were retried as outages: max_outage_s ends such a test (with a
# message the assertions reject) instead of letting it hang.
LIMITED = {"backoff_s": (0.02, 0.3), "max_outage_s": 8.0}


def queue_error(url: str, **kw) -> str:
    with pytest.raises(QueueError) as info:
        RedisQueue(url, **{**LIMITED, **kw}).close()
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one line, no chained traceback
    msg = str(info.value)
    assert "\n" not in msg and "unavailable for" not in msg, msg
    return msg


# ------------------------------------------------------------------------------ TLS mistakes
def test_rediss_without_the_ca_says_certificate_verify_failed(tls_redis, redis_ns):
    url = f"rediss://127.0.0.1:{tls_redis.tls_port}/0"
    msg = queue_error(url, namespace=redis_ns)
    assert msg.startswith(f"TLS handshake with redis at {url} failed: certificate verify failed"), msg
    assert "ssl_ca_certs=" in msg and "queue.url" in msg


def test_rediss_with_a_ca_that_did_not_sign_it(tmp_path, tls_redis, redis_ns):
    other = make_tls_files(tmp_path / "other")["ca.crt"]
    msg = queue_error(f"rediss://127.0.0.1:{tls_redis.tls_port}/0?ssl_ca_certs={other}", namespace=redis_ns)
    assert "certificate verify failed" in msg and f"ssl_ca_certs={other} does not hold the CA" in msg, msg


def test_rediss_to_a_host_name_the_certificate_does_not_name(tls_redis, redis_ns):
    msg = queue_error(f"rediss://localhost:{tls_redis.tls_port}/0?ssl_ca_certs={tls_redis.ca}", namespace=redis_ns)
    assert "certificate verify failed" in msg and "localhost" in msg and "host name" in msg, msg


def test_rediss_with_a_ca_file_that_does_not_exist(tmp_path, tls_redis, redis_ns):
    missing = tmp_path / "nope" / "ca.pem"
    msg = queue_error(f"rediss://127.0.0.1:{tls_redis.tls_port}/0?ssl_ca_certs={missing}", namespace=redis_ns)
    assert f"file not found: ssl_ca_certs={missing}" in msg, msg


def test_plain_redis_url_on_a_tls_port(tls_redis, redis_ns):
    url = f"redis://127.0.0.1:{tls_redis.tls_port}/0"
    msg = queue_error(url, namespace=redis_ns)
    assert msg.startswith(f"redis at {url} closed the connection right after connecting"), msg
    assert "TLS port" in msg and "rediss://" in msg


def test_rediss_url_on_a_plain_port(tls_redis, redis_ns):
    """A plain PING before the first TLS handshake tells at once (the handshake would wait out the socket
    timeout, a minute by default, for an answer a plain server never sends)."""
    url = f"rediss://127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={tls_redis.ca}&ssl_password=hunter2"
    msg = queue_error(url, namespace=redis_ns, socket_timeout_s=600.0)
    assert msg.startswith("redis at rediss://") and "answers plain (non-TLS) Redis" in msg, msg
    assert "use redis://" in msg and "hunter2" not in msg and "ssl_password=***" in msg


def test_an_unknown_url_option_is_one_line_not_a_type_error(redis_server, redis_ns):
    msg = queue_error(redis_server.url + "?sockettimeout=5", namespace=redis_ns)
    assert "unknown option(s) sockettimeout" in msg, msg


def test_right_tls_settings_work(tls_redis, redis_ns):
    q = RedisQueue(f"rediss://127.0.0.1:{tls_redis.tls_port}/0?ssl_ca_certs={tls_redis.ca}", namespace=redis_ns)
    q.put(group(1))
    assert q.get(1, timeout_s=1.0)[0].group.prompt_id == "p1" and q.ping()
    q.close()


def test_probes_tell_tls_and_plain_ports_apart(tls_redis):
    assert probe_tls("127.0.0.1", tls_redis.tls_port) and not probe_tls("127.0.0.1", tls_redis.port)
    assert probe_plain("127.0.0.1", tls_redis.port) and not probe_plain("127.0.0.1", tls_redis.tls_port)
    closed = free_port()
    assert not probe_tls("127.0.0.1", closed) and not probe_plain("127.0.0.1", closed)


# ------------------------------------------------------------------------------ outages stay outages
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_connection_dropped_by_a_working_server_is_retried(tls_redis, redis_ns, tls):
    """CLIENT KILL of every connection of a queue that has worked: the next call reconnects, no QueueError."""
    url = (f"rediss://127.0.0.1:{tls_redis.tls_port}/0?ssl_ca_certs={tls_redis.ca}" if tls else tls_redis.url)
    q = RedisQueue(url, namespace=redis_ns, **LIMITED)
    admin = redis.Redis.from_url(tls_redis.url)
    for round_ in range(3):
        q.put(group(round_))
        killed = admin.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
        assert q.depth() == round_ + 1  # the dropped connection is an outage of one retry, not a mistake
    assert [d.group.prompt_id for d in q.get(5, timeout_s=1.0)] == ["p0", "p1", "p2"]
    q.close()
    admin.close()


class ClosingProxy:
    """A TCP proxy that accepts and at once closes connections until ``backend`` is set, then forwards
    to it: what an L4 proxy or service-mesh sidecar does while the Redis behind it is still down."""

    def __init__(self) -> None:
        self.backend: int | None = None
        self.dropped = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.backend is None:
                conn.close()
                self.dropped += 1
                continue
            up = socket.create_connection(("127.0.0.1", self.backend))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_proxy_that_closes_connections_before_redis_is_up_is_an_outage(redis_server, redis_ns):
    """A connection closed before the first command ever succeeded is not enough to call it a TLS
    port: the probe finds no TLS there, so the queue waits, and works once the backend is up."""
    proxy = ClosingProxy()
    made: list = []
    t = threading.Thread(target=lambda: made.append(RedisQueue(f"redis://127.0.0.1:{proxy.port}/0",
                                                               namespace=redis_ns, **LIMITED)), daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 20
        while proxy.dropped < 3 and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.dropped >= 3 and t.is_alive() and not made  # still retrying, not failed
        proxy.backend = redis_server.port
        t.join(30)
        assert made, "the queue did not come up once the backend did"
        q = made[0]
        q.put(group(4))
        assert q.get(1, timeout_s=1.0)[0].group.prompt_id == "p4"
        q.close()
    finally:
        proxy.close()


def test_redis_at_maxmemory_is_backpressure_for_a_generator_not_a_crash(redis_factory, redis_ns):
    """The generator used to die with an OutOfMemoryError traceback (again on every restart): now a put
    at maxmemory is QueueFull (the generator waits and retries), counted and said in one warning."""
    import numpy as np

    from streamgrpo import metrics
    from streamgrpo.transport.queue.base import QueueFull
    from streamgrpo.wire import Completion, ScoredGroup, Visual

    srv = redis_factory("system")
    q = RedisQueue(srv.url, namespace=redis_ns, consumer="gen", max_pending=10_000)
    try:
        used = int(q.client.info("memory")["used_memory"])
        q.client.config_set("maxmemory-policy", "noeviction")
        q.client.config_set("maxmemory", str(used + (2 << 20)))
        rng = np.random.default_rng(0)

        def group(i: int) -> ScoredGroup:
            return ScoredGroup(
                prompt_id=f"p{i}", generator_id="g", policy_version=0, model_id="m",
                prompt_ids=np.arange(4, dtype=np.int32), answer="A", prompt_text="q",
                visuals=[Visual("image", rng.integers(0, 256, (1, 224, 224, 3), dtype=np.uint8))],
                completions=[Completion(np.arange(3, dtype=np.int32), np.full(3, -1.0, np.float32), "c", "stop",
                                        {"accuracy": 1.0}, 1.0)], group_id=f"oom-{i}")

        oom0 = metrics.ERRORS.labels(kind="queue_oom")._value.get()
        refused = None
        for i in range(200):  # 150 KB a group: 2 MB of room runs out
            try:
                q.put_many([group(i)], timeout_s=0.1)
            except QueueFull as exc:
                refused = (i, str(exc))
                break
        assert refused is not None and "is at maxmemory" in refused[1], refused
        assert metrics.ERRORS.labels(kind="queue_oom")._value.get() == oom0 + 1
        q.client.config_set("maxmemory", "0")  # room again (the learner committed): the same group goes in
        assert len(q.put_many([group(refused[0])], timeout_s=1.0)) == 1
    finally:
        q.close()
