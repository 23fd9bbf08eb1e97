"""The parent's side of ``benchmarks/bench_cluster.py``: reports from the roles, a Redis probe, CPU
accounting from /proc, and stopping the roles by PID.

CPU: ``/proc/<pid>/stat`` (utime + stime of every thread; cutime + cstime of reaped children, e.g.
redis-server's AOF rewrites) and ``/proc/<pid>/schedstat`` (time the main thread was runnable but
waiting for a core: how much a CPU-starved host held it back); the host's busy share from
``/proc/stat`` (every process's load, not only ours).
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import time
from typing import Any

from benchmarks.cluster_roles import NAMESPACE, Channels

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime + stime, cutime + cstime) of ``pid`` in seconds, from /proc/<pid>/stat; (nan, nan) if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return float("nan"), float("nan")
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces: split after it
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / _CLK_TCK, (cutime + cstime) / _CLK_TCK


def proc_wait_seconds(pid: int) -> float:
    """Seconds ``pid``'s main thread was runnable but waiting for a CPU (/proc/<pid>/schedstat); nan if unknown."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def host_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat (busy = total - idle - iowait)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(parts)
    return total - parts[3] - parts[4], total


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------------ the cell
class RedisProbe:
    """Samples the stream's length and Redis's memory (every ``every_s``, from the parent) while a cell
    runs; returns a reason to stop the cell early once Redis holds more than ``limit_bytes``."""

    def __init__(self, url: str, limit_bytes: int, every_s: float = 0.25) -> None:
        import redis

        self._r = redis.Redis.from_url(url, socket_timeout=30.0)
        self.limit, self.every_s, self._next = limit_bytes, every_s, 0.0
        self.xlen_max, self.mem_max = 0, 0

    def __call__(self) -> str | None:
        now = time.monotonic()
        if now < self._next:
            return None
        p = self._r.pipeline(transaction=False)
        p.xlen(f"{NAMESPACE}:groups")
        p.info("memory")
        xlen, mem = p.execute()
        self._next = time.monotonic() + self.every_s
        self.xlen_max = max(self.xlen_max, int(xlen))
        self.mem_max = max(self.mem_max, int(mem["used_memory"]))
        if self.mem_max > self.limit:
            return f"redis held {self.mem_max / 2**30:.1f} GiB (limit {self.limit / 2**30:.1f} GiB)"
        return None

    def close(self) -> None:
        self._r.close()


class Collector:
    """Drains the roles' reports while the parent waits; fails fast when a role dies; runs the probe."""

    def __init__(self, reports, procs: list) -> None:
        self.reports, self.procs = reports, procs
        self.ready: set[tuple[str, int]] = set()
        self.ports: tuple[int, int] | None = None
        self.published: dict[int, float] = {}
        self.publish_s: list[float] = []
        self.received: dict[int, dict[int, float]] = {}
        self.finals: dict[tuple[str, int], tuple] = {}
        self.probe: RedisProbe | None = None
        self.probe_stats: dict[str, int] = {}
        self.abort: str | None = None  # why the cell was stopped early

    def _take(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            self.ready.add((msg[1], msg[2]))
        elif kind == "ports":
            self.ports = (msg[1], msg[2])
        elif kind == "pub":
            self.published[msg[1]] = msg[2]
            self.publish_s.append(msg[3])
        elif kind == "ver":
            self.received.setdefault(msg[2], {})[msg[1]] = msg[3]
        elif kind in ("gen", "learner"):
            self.finals[(kind, msg[1])] = msg
        elif kind == "error":
            raise RuntimeError(f"{msg[1]} {msg[2]} failed:\n{msg[3]}")

    def pump(self, until: float, done=None) -> bool:
        """Take reports until monotonic ``until`` or until ``done()`` is true or the probe says stop (True)."""
        while True:
            if done is not None and done():
                return True
            if self.probe is not None:
                self.abort = self.abort or self.probe()
                if self.abort is not None:
                    return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            try:
                self._take(self.reports.get(timeout=min(left, 0.1)))
            except queue_mod.Empty:
                dead = [p for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{dead[0].name} (pid {dead[0].pid}) exited with {dead[0].exitcode}") from None

    def subscribers_have(self, version: int, n_subs: int) -> bool:
        """Every subscriber (generators 0..n_subs-1) got ``version`` or a newer one."""
        return len({i for v, got in self.received.items() if v >= version for i in got}) >= n_subs


def cpu_snapshot(procs: dict[str, list], redis_pid: int) -> dict[str, Any]:
    return {"t": time.monotonic(), "host": host_cpu_ticks(),
            "roles": {role: [proc_cpu_seconds(p.pid)[0] for p in ps] for role, ps in procs.items()},
            "wait": {role: [proc_wait_seconds(p.pid) for p in ps] for role, ps in procs.items()},
            "redis": proc_cpu_seconds(redis_pid), "redis_wait": proc_wait_seconds(redis_pid)}


def cpu_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    busy, total = b["host"][0] - a["host"][0], b["host"][1] - a["host"][1]
    out: dict[str, Any] = {"host_busy": busy / total if total > 0 else None}
    for role in a["roles"]:
        out[role] = [y - x for x, y in zip(a["roles"][role], b["roles"][role])]
    out["redis"] = b["redis"][0] - a["redis"][0]
    out["redis_children"] = b["redis"][1] - a["redis"][1]
    ours = sum(x for xs in out.values() if isinstance(xs, list) for x in xs if not math.isnan(x))
    ours += out["redis"] + out["redis_children"]  # children: AOF rewrites (counted once reaped)
    out["ours_busy"] = ours / ((b["t"] - a["t"]) * (os.cpu_count() or 1))
    out["wait"] = {role: [y - x for x, y in zip(a["wait"][role], b["wait"][role])] for role in a["wait"]}
    out["wait"]["redis"] = b["redis_wait"] - a["redis_wait"]
    return out


def aof_delayed_fsync(url: str) -> int | None:
    """Redis's count of AOF writes it had to make without waiting for a slow fsync (None: no answer)."""
    import redis

    r = redis.Redis.from_url(url, socket_timeout=30.0)
    try:
        return int(r.info("persistence").get("aof_delayed_fsync", 0))
    except redis.RedisError:
        return None
    finally:
        r.close()


def stop_all(procs: list, ch: Channels, grace_s: float = 10.0) -> None:
    """Ask every role to stop, then end what is left by PID (SIGTERM, then SIGKILL)."""
    ch.stop.set()
    ch.go.set()  # roles still waiting for the start see the stop at once
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(3.0)
        if p.is_alive():
            p.kill()
            p.join(3.0)
