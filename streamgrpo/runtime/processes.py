"""A process's life: stop requests (:class:`StopFlag`), dying with its parent, stopping children by PID, the
torch threads it may use, and free ports for the servers it starts."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

log = logging.getLogger("streamgrpo.runtime")


def die_with_parent() -> None:
    """``preexec_fn`` of a child that must not outlive its parent whatever ends the parent (``kill -9``
    too): the kernel then sends the child SIGTERM (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


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


def stop_process(proc, grace_s: float) -> int | None:
    """SIGTERM ``proc`` (a ``subprocess.Popen``) by PID, SIGKILL after ``grace_s``; returns its exit code."""
    return stop_processes([proc], grace_s)[0]


def stop_processes(procs, grace_s: float) -> list[int | None]:
    """SIGTERM every one of ``procs`` (``subprocess.Popen``) by PID at once, then wait for them all: each
    that is still running ``grace_s`` after the signals gets SIGKILL. They stop side by side, so the
    wait is the slowest one's, not the sum. Their exit codes, in order."""

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


def setup_torch_threads() -> None:
    """Respect OMP_NUM_THREADS (default 1 here: two busy processes on 2 cores otherwise crawl)."""
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, n))


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int | None:
    """The lowest port the kernel hands to outgoing connections (Linux), None where unknown."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


_HANDED_OUT: set[int] = set()  # ports free_port returned in this process (none is returned twice)


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

