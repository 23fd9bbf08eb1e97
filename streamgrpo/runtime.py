"""Small process plumbing shared by the learner and generator loops: stop signals, run-dir files,
the metrics endpoint and the queue URL. No training logic lives here."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from streamgrpo.config import ConfigError

log = logging.getLogger(__name__)


class RunDirBusy(ConfigError):
    """Another live process owns this run directory (one run directory, one owner)."""


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/<name>.lock`` for as long as this process lives (the kernel
    drops it when the process dies, ``kill -9`` included): a second ``up`` or learner on the same run
    directory refuses in one line instead of writing the same checkpoints and queue. A clean
    :meth:`close` removes the file (while still holding the lock); a process that opened it just
    before then finds its descriptor no longer names the path once it gets the lock, and opens
    the path again, so two owners never hold two different files of one name."""

    def __init__(self, run_dir: str | os.PathLike, name: str, what: str):
        import fcntl

        self._path = Path(run_dir) / f"{name}.lock"
        self._path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise RunDirBusy(f"{Path(run_dir)} is in use by another {what} (pid {holder}): stop it first, or use "
                                 "another run directory") from None
            if _names(fd, self._path):
                break
            os.close(fd)  # the previous owner removed the file between our open and our lock: again
        self._fd = fd
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def close(self) -> None:
        """Remove the lock file and release the lock (a clean exit leaves nothing behind)."""
        if self._fd >= 0:
            if _names(self._fd, self._path):
                self._path.unlink()
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = -1


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open at ``fd``."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def die_with_parent() -> None:
    """``preexec_fn`` of a child that must not outlive its parent whatever ends the parent (``kill -9``
    too): the kernel then sends the child SIGTERM (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


class NoRedisConfigured(ConfigError, RuntimeError):
    """Neither ``queue.url``, ``STREAMGRPO_REDIS_URL`` nor an embedded server's record names a Redis."""


class StopFlag:
    """Set by SIGTERM/SIGINT/SIGHUP; loops check it at safe points and finish the current unit of work
    (a closed terminal or ssh session stops a process cleanly, as SIGTERM does)."""

    def __init__(self, install: bool = True):
        self._event = threading.Event()
        self.signal_name: str | None = None
        if install and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        if self._event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.info("%s received: finishing the current step, then stopping", self.signal_name)
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)


def write_json(path: str | Path, data: Any) -> None:
    """Write JSON atomically (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


class JsonlWriter:
    """Append-only JSON lines, flushed per line (``metrics.jsonl``, audit logs)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, default=_default) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_new_lines(path: Path, offset: int, rows: list[dict[str, Any]]) -> int:
    """Append the whole JSON lines of ``path`` past byte ``offset`` to ``rows`` (a line still being
    written waits for the next call; a malformed one is skipped); returns the new offset."""
    if not path.exists():
        return offset
    with open(path) as fh:
        fh.seek(offset)
        while True:
            line = fh.readline()
            if not line or not line.endswith("\n"):
                break
            offset += len(line.encode())
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return offset


def rewind_jsonl(path: str | Path, step: int) -> int:
    """Drop the lines of ``path`` whose ``step`` is after ``step`` (and a torn last line), in place
    and atomically; lines without a step stay. Returns how many lines were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            row = None
        if not isinstance(row, dict) or (isinstance(row.get("step"), int) and row["step"] > step):
            dropped += 1
            continue
        keep.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return dropped


LEARNER_OUTPUTS = ["checkpoints", "metrics.jsonl", "learner_state.json", "audit/learner*.jsonl"]
"""What a learner writes into its run directory (``--fresh`` moves them aside)."""


def archive_previous(run_dir: str | Path, names: list[str]) -> Path | None:
    """Move what exists of ``names`` (files or folders in ``run_dir``; globs allowed) to
    ``<run_dir>/previous/<time>/``, so a new run starts clean and nothing is lost. Returns the folder."""
    run_dir = Path(run_dir)
    matched = {p for name in names for p in run_dir.glob(name) if p.exists()}
    found = sorted(p for p in matched if not any(q in p.parents for q in matched))  # a folder moves with what it holds
    if not found:
        return None
    dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True)
    for p in found:
        target = dest / p.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(p, target)
    return dest


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int | None:
    """The lowest port the kernel hands to outgoing connections (Linux), None where unknown."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1", *, tries: int = 50) -> int:
    """A TCP port that was free a moment ago on ``host``, for a server that another process will start.

    Picked at random below the kernel's ephemeral range where it is known (Linux: 10000 up to
    ``ip_local_port_range``'s low end), so that no outgoing connection (a client of Redis, a test's
    HTTP probe) can be given the same port before the server binds it; elsewhere, the OS's choice."""
    import random
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = ephemeral_low()
    candidates = [random.randrange(10_000, low) for _ in range(tries)] if low and low > 11_000 else []
    for port in [*candidates, 0, 0, 0]:
        if port in _HANDED_OUT:  # two servers of one config must never be given the same port
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            got = int(sock.getsockname()[1])
        if got not in _HANDED_OUT:
            _HANDED_OUT.add(got)
            return got
    raise OSError(f"no free TCP port on {host}")


_HANDED_OUT: set[int] = set()  # ports free_port returned in this process (none is returned twice)


def stop_process(proc, grace_s: float) -> int | None:
    """SIGTERM ``proc`` (a ``subprocess.Popen``) by PID, SIGKILL after ``grace_s``; returns its exit code."""
    return stop_processes([proc], grace_s)[0]


def stop_processes(procs, grace_s: float) -> list[int | None]:
    """SIGTERM every one of ``procs`` (``subprocess.Popen``) by PID at once, then wait for them all: each
    that is still running ``grace_s`` after the signals gets SIGKILL. They stop side by side, so the
    wait is the slowest one's, not the sum. Their exit codes, in order."""
    import subprocess

    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in %.0fs: killing it", proc.pid, grace_s)
            proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # still tearing down (a GPU context): the others are stopped all the same
                log.warning("pid %d still running 10s after SIGKILL", proc.pid)
    return [proc.returncode for proc in procs]


TARGET_ACCURACY = 0.9
WINDOW_GROUPS = 50
"""Time to target: the moving mean accuracy of the last WINDOW_GROUPS trained groups reaches TARGET_ACCURACY."""


def group_accuracies(rows) -> list[tuple[int, float, float]]:
    """``(step, time, accuracy)`` of every trained group of ``metrics.jsonl`` rows, in training order."""
    return [(int(r["step"]), float(r["time"]), float(a)) for r in rows for a in r.get("group_accuracy") or []]


def target_reached(rows, target: float = TARGET_ACCURACY, window: int = WINDOW_GROUPS) -> tuple[int, float] | None:
    """``(step, time)`` at which the mean accuracy of the last ``window`` trained groups first reaches
    ``target`` (None if it never does)."""
    accs = group_accuracies(rows)
    total = 0.0
    for i, (_, _, a) in enumerate(accs):
        total += a
        if i >= window:
            total -= accs[i - window][2]
        if i >= window - 1 and total / window >= target - 1e-12:
            return accs[i][0], accs[i][1]
    return None


def _default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, set):
        return sorted(obj)
    return str(obj)


class MetricsPortTaken(ConfigError):
    """A fixed metrics port that another process on this host already serves (one line, no traceback)."""


def start_metrics(mcfg, run_dir: Path, role: str, health=None, hint: str | None = None):
    """Serve /metrics and /healthz on ``metrics.host:port`` (a :class:`~streamgrpo.config.MetricsConfig`);
    record the port in ``<run_dir>/ports/<role>.json``. A fixed port that is taken raises
    :class:`MetricsPortTaken` saying so in one line (``hint``: how this role gets another)."""
    import errno

    from streamgrpo.metrics import serve

    try:
        server = serve(mcfg.host, mcfg.port, health=health)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise MetricsPortTaken(
            f"{role}: metrics port {mcfg.port} on {mcfg.host} is taken by another process on this host: "
            f"{hint or 'set metrics.port=0 (a free port)'}; each process's port is written to "
            f"{run_dir / 'ports'}") from None
    write_json(run_dir / "ports" / f"{role}.json", {"metrics": server.port, "pid": os.getpid(), "started": time.time()})
    log.info("%s: metrics on port %d", role, server.port)
    return server


def queue_url(qcfg, run_dir: Path) -> str:
    """``queue.url`` (a :class:`~streamgrpo.config.QueueConfig`), ``STREAMGRPO_REDIS_URL``, or the embedded
    server's URL that `streamgrpo up` recorded in the run directory."""
    if qcfg.url:
        return qcfg.url
    env = os.environ.get("STREAMGRPO_REDIS_URL")
    if env:
        return env
    rec = run_dir / "redis.json"
    if rec.is_file():
        return json.loads(rec.read_text())["url"]
    raise NoRedisConfigured(
        "no Redis configured: set queue.url (redis://host:port/db) or start everything with `streamgrpo up`, "
        "which runs an embedded Redis (or set STREAMGRPO_REDIS_URL)"
    )


def setup_torch_threads() -> None:
    """Respect OMP_NUM_THREADS (default 1 here: two busy processes on 2 cores otherwise crawl)."""
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, n))
