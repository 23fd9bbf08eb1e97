"""Who runs the relay on a host: a lock file says whether one runs; a generator starts one when none does.

The relay of a learner address lives in its folder (:func:`~streamgrpo.transport.weights.factory.relay_dir`,
``<shm_dir>/sgr-<hash>``, mode 0700: only this user's processes reach its sockets) and holds an
exclusive ``flock`` on ``relay.lock`` there for its whole life (the kernel drops it when the process
dies, ``kill -9`` included) and its PID in it. Every generator with ``weights.relay`` probes that lock at
start and between batches (at most every 5 s, with a shared lock for an instant, writing nothing): when no
relay holds it, it starts one
(``streamgrpo relay``, in its own session, so it outlives that generator and serves the others).
Two generators that race both start one; the second relay finds the lock held and exits. A relay
with no generator connected for a minute exits (:mod:`.loop`), so nothing outlives a run for long.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from streamgrpo.config import ConfigError
from streamgrpo.config.roles import RelayConfig
from streamgrpo.transport.weights.factory import relay_dir

log = logging.getLogger("streamgrpo.relay")


def private_dir(wcfg) -> Path:
    """The relay's folder, made 0700 when missing; a ConfigError when it is not this user's."""

    d = relay_dir(wcfg)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"weights.relay: {d} belongs to another user or is open to others: give this run a "
                          "weights.shm_dir of its own")
    return d


def lock_path(wcfg) -> Path:

    return relay_dir(wcfg) / "relay.lock"


def take_lock(wcfg, wait_s: float = 2.0) -> int | None:
    """The relay's lock (a file descriptor to keep open while relaying, the file holding this PID), or None
    when another relay holds it. A generator's probe (:func:`relay_running`) holds a shared lock for an
    instant: that is waited out (up to ``wait_s``), so a relay starting beside a probe does not give up."""
    path = private_dir(wcfg) / "relay.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if _held_by_a_relay(path) or time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.01)  # a probe's shared lock: gone in a moment
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _held_by_a_relay(path: Path) -> bool:
    """Whether an exclusive lock (a relay's) holds ``path``: a shared lock cannot be had beside it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # lets the shared lock go, when taken


def relay_running(wcfg) -> bool:
    """Whether a relay holds the lock now: a probe that writes nothing (the file keeps the relay's PID)."""
    path = private_dir(wcfg) / "relay.lock"
    if not path.exists():
        return False
    return _held_by_a_relay(path)


class RelayKeeper:
    """A generator's side: start the host's relay when none runs (at most every ``every_s`` seconds)."""

    def __init__(self, cfg, run_dir: str | Path, name: str, every_s: float = 5.0, clock=time.monotonic):
        self.cfg, self.run_dir, self.name, self.every_s, self._clock = cfg, Path(run_dir), name, every_s, clock
        self._last: float | None = None
        self._started_at: float | None = None
        self.started = 0  # relays this generator started

    def check(self) -> bool:
        """Start a relay if none runs; True when this call started one."""
        now = self._clock()
        if self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        if relay_running(self.cfg.weights):
            return False
        if self._started_at is not None and now - self._started_at < self._backoff():
            return False  # it died soon after its start: its log says why; not again at once
        self.start()
        self._started_at = now
        return True

    def _backoff(self) -> float:
        """Seconds between starts: 5 s, then doubling with each relay started, up to 5 minutes."""
        return min(300.0, self.every_s * 2 ** max(0, self.started - 1))

    def start(self) -> None:
        wc = self.cfg.weights
        conf = private_dir(wc) / "relay.yaml"
        # the relay's sections only (a config file of their own: the rest defaults): no queue URL, no secret on disk
        on_disk = RelayConfig.of(self.cfg).model_dump(mode="json")
        tmp = conf.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(yaml.safe_dump(on_disk, sort_keys=False))
        os.chmod(tmp, 0o600)
        os.replace(tmp, conf)
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"relay-{socket.gethostname()}.log"
        argv = [sys.executable, "-m", "streamgrpo", "relay", "--config", str(conf)]
        if wc.curve_keys_dir and self.name.startswith("generator-"):  # this host has that generator's key
            argv += ["--client-key", "client-" + self.name.removeprefix("generator-")]
        with open(log_path, "ab") as fh:
            subprocess.Popen(argv, stdout=fh,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        self.started += 1
        log.info("%s: no weight relay on this host: started one (log %s)", self.name, log_path)
