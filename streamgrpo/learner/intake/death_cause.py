"""Why the last learner died: its own doing (a crash, out of memory) or a kill from outside.

The crash-loop breaker (:mod:`streamgrpo.learner.intake.crash_loop`) counts a start against the groups of the step the
last learner died in. That is right when the group killed it (a decoder that segfaults, an allocation the
out-of-memory killer answers) and wrong when someone else did (``kill -9`` by a user, a scheduler, a chaos test):
four such kills in a row must not dead-letter an innocent group. A dead process cannot say which, so it leaves
two witnesses behind before it steps:

* a :class:`Witness` in its step mark: the host, the boot and the out-of-memory kill counters when it marked the
  step: its memory cgroup's (cgroup v2 ``memory.events``, v1 ``memory.oom_control``) and the host's
  (``/proc/vmstat``, which a start in another cgroup can still read);
* a crash record: :mod:`faulthandler` writes the fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) and every
  thread's stack into ``<run>/crash/<consumer>.txt`` as the process dies of it.

:func:`judge` reads them at the next start. A crash record, or an out-of-memory counter that rose, is the learner's
own death: counted. A counter that did not rise and no crash record is a kill from outside: not counted. Where the
evidence is missing (no counter readable, the mark made on another host or before a reboot, a mark in the old
format) the death is counted, as before: a group that kills the learner is never trained forever.
"""

from __future__ import annotations

import faulthandler
import os
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Witness:
    """What a learner about to step leaves for the next start to judge its death by."""

    host: str
    boot: str
    oom_kills: dict[str, int]  # counter file -> out-of-memory kills so far (its cgroup's first, the host's last)

    def to_json(self) -> dict:
        return {"host": self.host, "boot": self.boot, "oom_kills": self.oom_kills}

    @classmethod
    def from_json(cls, d) -> Witness | None:
        if not isinstance(d, dict) or not isinstance(d.get("oom_kills"), dict):
            return None
        counts = {str(k): v for k, v in d["oom_kills"].items() if isinstance(v, int)}
        return cls(str(d.get("host", "")), str(d.get("boot", "")), counts)


@dataclass(frozen=True)
class Cause:
    own: bool  # the learner's own death (count it for the groups it died with)
    why: str


def judge(then: Witness | None, host: str, boot: str, now: dict[str, int | None], crash: str | None) -> Cause:
    """The cause of a death: ``then`` the witness of the dead learner's mark; this start's ``host``, ``boot`` and
    the counts ``now`` in the counter files ``then`` named (None: unreadable now); ``crash`` the first line of the
    dead learner's crash record (None: none)."""
    if crash:
        return Cause(True, f"it crashed ({crash})")
    if then is None:
        return Cause(True, "its mark has no witness: the cause is unknown")
    if (then.host, then.boot) != (host, boot):
        return Cause(True, f"it ran on {then.host or 'another host'} (or before a reboot): the cause is unknown")
    for path, before in then.oom_kills.items():  # the first counter readable both times decides
        after = now.get(path)
        if after is None:
            continue
        if after > before:
            return Cause(True, f"out of memory ({path}: oom_kill {before} -> {after})")
        return Cause(False, f"killed from outside (no out-of-memory kill in {path}, no crash of its own)")
    return Cause(True, "no out-of-memory counter is readable here: the cause is unknown")


# --------------------------------------------------------------------------- the out-of-memory counter
def oom_counter_files(proc_cgroup: str, mountinfo: str) -> list[str]:
    """The files that may hold the out-of-memory kill count of the process whose ``/proc/<pid>/cgroup`` and
    ``/proc/<pid>/mountinfo`` are given, in mount order: cgroup v2's ``memory.events``, v1's ``memory.oom_control``
    (a v1 machine may mount an empty v2 hierarchy too: the caller takes the first that reads)."""
    found = []
    paths: dict[str, str] = {}  # controller ("" for v2) -> cgroup path
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for ctl in parts[1].split(",") if parts[1] else [""]:
                paths[ctl] = parts[2]
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], tail[0], tail[2].split(",")
        if fstype == "cgroup2" and "" in paths:
            name, own = "memory.events", paths[""]
        elif fstype == "cgroup" and "memory" in options and "memory" in paths:
            name, own = "memory.oom_control", paths["memory"]
        else:
            continue
        rel = own[len(root):] if root != "/" and own.startswith(root) else (own if root == "/" else "")
        found.append(os.path.join(point, rel.lstrip("/"), name))
    return found


def count_in(text: str) -> int | None:
    """The ``oom_kill N`` line of ``memory.events``, ``memory.oom_control`` or ``/proc/vmstat``."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _read(path: str | None) -> str:
    try:
        return Path(path).read_text() if path else ""
    except OSError:
        return ""


class Witnessing:
    """This process's witnesses: its out-of-memory counters (found once) and its crash record."""

    def __init__(self, crash_path: Path | None = None):
        self.host = socket.gethostname()
        self.boot = _read("/proc/sys/kernel/random/boot_id").strip()
        files = oom_counter_files(_read("/proc/self/cgroup"), _read("/proc/self/mountinfo"))
        self.counters = [f for f in [*files, "/proc/vmstat"] if count_in(_read(f)) is not None][:1]
        if self.counters and self.counters[0] != "/proc/vmstat" and count_in(_read("/proc/vmstat")) is not None:
            self.counters.append("/proc/vmstat")  # the host's: what a start in another cgroup can still read
        self.crash_path = crash_path
        self._record = None

    def now(self) -> Witness:
        return Witness(self.host, self.boot, {f: n for f in self.counters if (n := count_in(_read(f))) is not None})

    def judge(self, then: Witness | None, crash_path: Path | None) -> Cause:
        """The cause of the death of the learner that left witness ``then`` and crash record ``crash_path``."""
        now = {f: count_in(_read(f)) for f in (then.oom_kills if then is not None else ())}
        return judge(then, self.host, self.boot, now, self.crash_of(crash_path))

    @staticmethod
    def crash_of(path: Path | None) -> str | None:
        """The first line of a dead process's crash record (e.g. ``Fatal Python error: Segmentation fault``)."""
        return next((line.strip() for line in _read(str(path) if path else None).splitlines() if line.strip()), None)

    def arm(self) -> None:
        """Record this process's own fatal signal in its crash record (emptied: an earlier one was read)."""
        if self.crash_path is None:
            return
        try:
            self.crash_path.parent.mkdir(parents=True, exist_ok=True)
            self._record = open(self.crash_path, "w")  # noqa: SIM115 - open as long as the process lives
        except OSError:
            return
        faulthandler.enable(file=self._record, all_threads=True)
