"""ScoredGroup wire format: encode + decode throughput vs a numpy memcpy of the same bytes.

For groups of ``--sizes`` MB (uint8 video frames, 112x112, plus 8 completions of 256 tokens with
behaviour log-probs, as a generator sends them) this process measures, interleaved round by round:

* ``wire_<S>MB_zero_copy_GBps``: message bytes / (``encode_parts(group)`` + ``decode(bytes)``), the
  path the queue takes: ``encode_parts`` validates and returns the header plus the arrays' own
  buffers (XADD writes them to the socket unjoined), ``decode`` parses the header and returns
  zero-copy array views (then validates). Neither touches a frame byte: what is left is a fixed
  cost per message (~20 arrays in a G=8 group), which one memcpy of the same bytes outruns only
  for small messages;
* ``wire_<S>MB_encode_decode_GBps``: the same with ``encode(group)``, which joins the pieces into one
  fresh ``bytes`` (one copy of the frames, plus page faults on the new allocation at large sizes);
  for callers that need one contiguous buffer;
* context (in the json, not a figure): encode alone, decode alone, ``encode_parts`` alone;
* baseline: ``np.copyto`` of the same number of bytes into a preallocated buffer (one memcpy, the
  speed of light for anything that has to touch every byte once).

ratio = ours / baseline (1.0 = as fast as one memcpy). Medians over ``--rounds``.

Prints ``name: value (baseline: value, ratio: x)`` lines and writes
``benchmarks/results/bench_wire.json`` with machine info.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_wire [--sizes 1,4,16,64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from benchmarks.common import emit, figure, machine_info, make_group, write_result
from streamgrpo.wire import decode, encode, encode_parts


def _best_time(fn, min_s: float) -> float:
    """Seconds per call: calls repeated for at least ``min_s`` (>= 3 calls), best call kept."""
    best, spent, n = float("inf"), 0.0, 0
    while n < 3 or spent < min_s:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def measure(mb: float, rounds: int, min_s: float) -> dict:
    g = make_group(mb)
    data = encode(g)
    nbytes = len(data)
    back = decode(data)
    if not np.array_equal(back.visuals[0].frames, g.visuals[0].frames):
        raise SystemExit("decode(encode(g)) differs from g")
    src = np.frombuffer(data, dtype=np.uint8).copy()
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in

    def joined() -> None:
        decode(encode(g))

    def zero_copy() -> None:
        encode_parts(g)
        decode(data)

    per_round = []
    for _ in range(rounds):
        t_enc = _best_time(lambda: encode(g), min_s / 4)
        t_dec = _best_time(lambda: decode(data), min_s / 4)
        t_both = _best_time(joined, min_s / 2)
        t_parts = _best_time(lambda: encode_parts(g), min_s / 4)
        t_zero = _best_time(zero_copy, min_s / 2)
        t_copy = _best_time(lambda: np.copyto(dst, src), min_s / 2)
        per_round.append({"encode_s": t_enc, "decode_s": t_dec, "encode_decode_s": t_both,
                          "encode_parts_s": t_parts, "zero_copy_s": t_zero, "memcpy_s": t_copy})
    med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    gb = nbytes / 1e9
    return {
        "message_bytes": nbytes, "rounds": per_round, "median_s": med,
        "encode_decode_GBps": gb / med["encode_decode_s"],
        "zero_copy_GBps": gb / med["zero_copy_s"],
        "ratio_zero_copy": statistics.median(r["memcpy_s"] / r["zero_copy_s"] for r in per_round),
        "encode_parts_ms": med["encode_parts_s"] * 1e3,
        "encode_GBps": gb / med["encode_s"], "decode_GBps": gb / med["decode_s"],
        "memcpy_GBps": gb / med["memcpy_s"],
        "ratio_encode_decode": statistics.median(r["memcpy_s"] / r["encode_decode_s"] for r in per_round),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_wire", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16,64", help="group sizes in MB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-seconds", type=float, default=0.4, help="time spent per measurement and round")
    ap.add_argument("--out", default=None, help="result json (default benchmarks/results/bench_wire.json)")
    args = ap.parse_args(argv)
    machine = machine_info(packages=("numpy", "msgpack"))
    figures, results = [], {}
    for mb in [float(s) for s in args.sizes.split(",")]:
        r = measure(mb, args.rounds, args.min_seconds)
        key = f"{mb:g}MB"
        results[key] = r
        figures.append(emit(figure(f"wire_{key}_zero_copy_GBps", r["zero_copy_GBps"], r["memcpy_GBps"],
                                   r["ratio_zero_copy"], unit="GB/s",
                                   note="encode_parts + decode (the queue's path); baseline = one np.copyto. Goal >= 0.8")))
        figures.append(emit(figure(f"wire_{key}_encode_decode_GBps", r["encode_decode_GBps"], r["memcpy_GBps"],
                                   r["ratio_encode_decode"], unit="GB/s",
                                   note=f"{r['message_bytes']} B; baseline = one np.copyto of the same bytes")))
        print(f"#   encode {r['encode_GBps']:.2f} GB/s, decode {r['decode_GBps']:.1f} GB/s (zero-copy views), "
              f"encode_parts {r['encode_parts_ms']:.3f} ms", flush=True)
    write_result("bench_wire", figures, machine, vars(args), {"results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
