"""Which Redis client errors are mistakes to report at once, and which are outages to wait out.

:class:`~streamgrpo.transport.queue.redis_stream.RedisQueue` retries connection loss (Redis restarting, a
refused connection, ``LOADING``) with backoff. A misconfiguration never heals that way, so it must
end the process at once with one line that says what to fix. :func:`misconfiguration` tells them
apart; it returns that line, or None for an outage:

* a wrong password or unknown ACL user, and missing ACL permissions: always;
* a TLS failure other than a dropped connection (certificate verification: no CA, the wrong CA, a
  host name the certificate does not name; a client certificate the server requires; a TLS
  protocol mismatch; an unreadable certificate file): always;
* ``redis://`` pointed at a TLS port (the server drops the connection, or answers bytes that are
  not RESP) and ``rediss://`` pointed at a plain port (the handshake times out): only before the
  first successful command, and only once a second connection confirms it (a TLS handshake, or a
  plain ``PING``, that the port answers). A server that had been working, or a proxy that drops
  connections while its backend is down, stays an outage.
"""

from __future__ import annotations

import os
import socket
import ssl
from typing import Any

import redis
from redis.exceptions import AuthorizationError, InvalidResponse, NoPermissionError

# SSL errors that mean "the connection went away", as a restarting server causes: outages.
_DROPPED = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError, ssl.SSLWantReadError,
            ssl.SSLWantWriteError)
_CLOSED = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_TLS_FILES = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
PROBE_TIMEOUT_S = 3.0


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (redis-py keeps the socket error there)."""
    out: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and node not in out:
        out.append(node)
        node = node.__cause__ or node.__context__
    return out


def _endpoint(client: redis.Redis) -> tuple[str, int, bool, dict[str, Any]] | None:
    """(host, port, tls, connection kwargs) of a TCP client; None for a unix socket."""
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if "path" in kw:
        return None
    return str(kw.get("host", "localhost")), int(kw.get("port", 6379)), issubclass(
        pool.connection_class, redis.connection.SSLConnection), kw


def misconfiguration(exc: BaseException, client: redis.Redis, url: str, what: str, *, connected: bool) -> str | None:
    """The one-line reason ``exc`` will not go away by retrying, or None if it may be an outage.

    ``url`` is the URL to name (without its password), ``what`` the command that failed and
    ``connected`` whether a command on this client has succeeded before.
    """
    if isinstance(exc, redis.AuthenticationError):
        return f"authentication failed for {url} ({exc}); check the user/password in queue.url"
    if isinstance(exc, (AuthorizationError, NoPermissionError)):
        return f"permission denied on {url} for {what}: {exc}"
    ep = _endpoint(client)
    if ep is None:
        return None
    host, port, tls, kw = ep
    chain = _chain(exc)
    bad_tls = next((e for e in chain if isinstance(e, ssl.SSLError) and not isinstance(e, _DROPPED)), None)
    if tls and bad_tls is not None:
        return _tls_reason(bad_tls, url, kw)
    if tls and any(isinstance(e, FileNotFoundError) for e in chain):
        missing = [f"{k}={kw[k]}" for k in _TLS_FILES if kw.get(k) and not os.path.exists(kw[k])]
        return f"TLS settings for redis at {url}: file not found: {', '.join(missing) or chain[-1]}; fix the path in queue.url"
    if connected:
        return None
    if not tls and (isinstance(exc, InvalidResponse) or _closed(chain)) and probe_tls(host, port):
        return (f"redis at {url} closed the connection right after connecting: port {port} is a TLS port; "
                "use rediss://... (with ssl_ca_certs=/path/ca.pem) in queue.url")
    if tls and any(isinstance(e, (TimeoutError, socket.timeout)) and "handshake" in str(e) for e in chain) \
            and probe_plain(host, port):
        return (f"TLS handshake with redis at {url} timed out, and port {port} answers plain (non-TLS) Redis: "
                "use redis://... in queue.url, or point rediss:// at the server's tls-port")
    return None


def tls_on_plain_port(client: redis.Redis, url: str) -> str | None:
    """Before the first command: a ``rediss://`` URL whose port answers plain Redis, in one line (the TLS
    handshake would otherwise wait out the socket timeout, a minute, before saying so). None otherwise."""
    ep = _endpoint(client)
    if ep is None or not ep[2] or not probe_plain(ep[0], ep[1]):
        return None
    return (f"redis at {url} answers plain (non-TLS) Redis on port {ep[1]}: use redis://... in queue.url, or point "
            "rediss:// at the server's tls-port")


def _closed(chain: list[BaseException]) -> bool:
    return any(isinstance(e, _CLOSED) or "Connection closed by server" in str(e) for e in chain)


def _tls_reason(err: ssl.SSLError, url: str, kw: dict[str, Any]) -> str:
    head = f"TLS handshake with redis at {url} failed"
    if isinstance(err, ssl.SSLCertVerificationError):
        detail = err.verify_message or str(err)
        if "hostname" in detail.lower() or "ip address mismatch" in detail.lower():
            fix = "connect to a host name or IP address the server certificate names (or add ssl_check_hostname=false)"
        elif kw.get("ssl_ca_certs") or kw.get("ssl_ca_path"):
            fix = (f"ssl_ca_certs={kw.get('ssl_ca_certs') or kw.get('ssl_ca_path')} does not hold the CA that "
                   "signed the server certificate; pass that CA")
        else:
            fix = "pass the CA that signed the server certificate as ssl_ca_certs=/path/ca.pem"
        return f"{head}: certificate verify failed ({detail}); {fix} in queue.url"
    reason = (err.reason or str(err)).upper()
    if "WRONG_VERSION_NUMBER" in reason or "UNKNOWN_PROTOCOL" in reason or "RECORD_LAYER_FAILURE" in reason:
        return (f"{head}: the server did not answer TLS ({err.reason or err}); is it a plain port? "
                "use redis://... in queue.url, or point rediss:// at the server's tls-port")
    if "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason:
        return (f"{head}: the server refused the handshake ({err.reason or err}); if it requires client "
                "certificates, pass ssl_certfile=/path/client.crt and ssl_keyfile=/path/client.key in queue.url")
    return f"TLS with redis at {url} failed: {err.reason or err}; check the ssl_* files and settings in queue.url"


def probe_tls(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True if ``host:port`` completes a TLS handshake, or refuses one with a TLS alert (no verification)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock, \
                ctx.wrap_socket(sock, server_hostname=host):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in (exc.reason or "").upper()
    except OSError:
        return False


def probe_plain(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True if ``host:port`` answers a plain ``PING`` like Redis does (``+PONG`` or an error such as ``-NOAUTH``)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64)[:1] in (b"+", b"-")
    except OSError:
        return False
