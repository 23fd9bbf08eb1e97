"""The /metrics endpoint cannot take its process down: silent connections are closed after a timeout,
and connections beyond a bound are closed at once instead of each taking a thread (real sockets)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

from streamgrpo.metrics import MetricsServer, _BoundedServer, _Handler


def _handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if "process_request" in t.name)


def _closed_by_server(s: socket.socket, wait_s: float = 30.0) -> bool:
    s.settimeout(wait_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_connections_beyond_the_bound_are_closed_at_once_and_take_no_thread(monkeypatch):
    monkeypatch.setattr(_Handler, "timeout", 120.0)  # nothing times out during this test: the bound alone acts
    server = MetricsServer("127.0.0.1", 0)
    socks = []
    try:
        for _ in range(200):  # connect, send nothing: the half-open connections that exhausted the learner
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        over = 200 - _BoundedServer.max_connections
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and server._httpd.refused < over:
            time.sleep(0.05)
        assert server._httpd.refused == over
        assert _handler_threads() == _BoundedServer.max_connections
        assert all(_closed_by_server(s) for s in socks[_BoundedServer.max_connections:])
    finally:
        for s in socks:
            s.close()
        server.close()


def test_a_silent_connection_is_closed_after_the_timeout_and_the_endpoint_still_answers(monkeypatch):
    monkeypatch.setattr(_Handler, "timeout", 1.0)
    server = MetricsServer("127.0.0.1", 0)
    try:
        silent = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(5)]
        assert all(_closed_by_server(s) for s in silent)  # before, each held a thread and a descriptor forever
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"streamgrpo_" in r.read()
        for s in silent:
            s.close()
    finally:
        server.close()


def test_a_taken_fixed_port_is_one_line_naming_it_and_the_fix(tmp_path):
    """Another process holds the port (a real listening socket): the role's start refuses in one line,
    a usage error, with the way to another port; a free port still works and is recorded."""
    import pytest

    from streamgrpo.config import ConfigError, MetricsConfig
    from streamgrpo.metrics import MetricsPortTaken, start_metrics

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(MetricsPortTaken) as exc:
            start_metrics(MetricsConfig(port=port), tmp_path, "generator-1", hint="give it --local-index K")
        assert isinstance(exc.value, ConfigError) and "\n" not in str(exc.value)
        assert str(exc.value).startswith(f"generator-1: metrics port {port} on 127.0.0.1 is taken")
        assert "give it --local-index K" in str(exc.value)
        server = start_metrics(MetricsConfig(port=0), tmp_path, "relay-h")
        assert (tmp_path / "ports" / "relay-h.json").is_file() and server.port != port
        server.close()
    finally:
        holder.close()


def test_close_waits_at_most_a_short_poll_of_the_serving_loop(monkeypatch):
    """Every process closes its /metrics server on the way out; serve_forever notices the request only
    at its next poll (0.5 s by default: up to half a second of each exit)."""
    import socketserver

    polls: list[float] = []
    serve = socketserver.BaseServer.serve_forever

    def spy(self, poll_interval=0.5):
        polls.append(poll_interval)
        return serve(self, poll_interval)

    monkeypatch.setattr(socketserver.BaseServer, "serve_forever", spy)
    server = MetricsServer("127.0.0.1", 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
        assert r.status == 200
    server.close()
    assert polls and max(polls) <= 0.1, polls


def test_a_scraper_that_hung_up_is_counted_not_printed_and_other_errors_still_are(capsys):
    """socketserver prints a traceback for any error in a handler; a client gone before its reply was
    written (BrokenPipe, ConnectionReset: a scrape timeout on a loaded host) is counted instead."""
    server = MetricsServer()
    try:
        httpd = server._httpd
        for exc in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "Connection reset by peer")):
            try:
                raise exc
            except ConnectionError:
                httpd.handle_error(None, ("127.0.0.1", 1))
        assert httpd.hung_up == 2 and capsys.readouterr().err == ""
        try:
            raise ValueError("a bug in a handler")
        except ValueError:
            httpd.handle_error(None, ("127.0.0.1", 1))
        assert "ValueError: a bug in a handler" in capsys.readouterr().err and httpd.hung_up == 2
    finally:
        server.close()
