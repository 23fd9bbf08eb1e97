"""A run directory's ownership and history: one process of a kind per run directory (:class:`RunLock`), and
the outputs of an earlier run moved aside before a fresh start (:func:`archive_previous`)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from streamgrpo.config import ConfigError

log = logging.getLogger("streamgrpo.runtime")


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
