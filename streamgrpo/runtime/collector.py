"""Python's cyclic garbage collector, paused while a process starts.

Importing torch and transformers and building a model make about 750,000 objects and almost no garbage
cycles, yet the collector walked them again and again as they piled up: 0.8-1 CPU-s of each role's 6-7 s
start on 2 cores (docs/performance.md, the test suite's wall time). ``python -m streamgrpo`` pauses it
first thing; a role calls :func:`started` once its model is built: what exists then moves to the permanent
generation (``gc.freeze``: never walked again, so each later full collection is cheaper as well) and
collection resumes. A command that never says so gets collection back after ``limit_s`` anyway, and a
forked child at once (it does not inherit the timer). Reference counting frees as always meanwhile: only
objects in cycles wait.
"""

from __future__ import annotations

import gc
import os
import threading

LIMIT_S = 60.0  # the longest a process runs without cyclic collection when nothing calls started()

_timer: threading.Timer | None = None


def pause(limit_s: float = LIMIT_S) -> None:
    """Collection off until :func:`started`, or ``limit_s`` from now."""
    global _timer
    gc.disable()
    _timer = threading.Timer(limit_s, started)
    _timer.daemon = True
    _timer.name = "gc-after-startup"
    _timer.start()


def started() -> None:
    """The process has built what it runs with: freeze it, and collect from here on (idempotent; nothing unless
    :func:`pause` ran in this process or the one it was forked from: a collector disabled by other code stays so)."""
    if _timer is None:
        return
    if _timer is not threading.current_thread() and _timer.is_alive():
        _timer.cancel()
        _timer.join()  # it wakes at once: no timer left behind
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


os.register_at_fork(after_in_child=started)
