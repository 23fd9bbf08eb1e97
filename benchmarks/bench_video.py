"""Frame sampling speed: decord vs PyAV (both seek to the sampled frames) vs decoding every frame.

Samples ``--frames`` (16) evenly spaced frames from every video of two sets, measured in one run:

* ``demo``: the demo data set's clips (56x56, 8 frames at 4 fps: 16 samples repeat frames);
* ``long``: ``--long-videos`` clips of ``--long-frames`` frames (300 = 10 s at 30 fps), 224x224,
  libx264 with a key frame every 30 frames (what a phone or a transcoded data set looks like).

Methods (the same indices, frames checked identical): ``decord`` and ``pyav`` are the two
readers of :mod:`streamgrpo.data.decode` (open, probe, seek and decode only what is needed);
the baseline ``decode_all`` decodes every frame with PyAV and picks the indices. The frame
cache is not involved. Throughput = sampled frames delivered per second (best of ``--repeats``).

Prints ``name: value (baseline: value, ratio: x)`` lines and writes
``benchmarks/results/bench_video.json`` with machine info.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_video [--frames 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import emit, figure, machine_info, write_result
from streamgrpo.data import decode
from streamgrpo.data.sampling import evenly_spaced_indices
from streamgrpo.recipes.demo.data import make_demo, render, write_mp4


def _long_videos(d: Path, n: int, frames: int, size: int) -> list[Path]:
    out = []
    for i in range(n):
        colour = ("red", "green", "blue")[i % 3]
        direction = ("left", "right", "up", "down")[i % 4]
        clip = render(colour, direction, i % 12, size, frames)
        noise = np.random.default_rng(i).integers(0, 24, clip.shape, dtype=np.uint8)  # texture: real bitrate
        p = d / f"long_{i}.mp4"
        write_mp4(p, clip + noise, fps=30, gop=30)
        out.append(p)
    return out


def _read(method: str, path: Path, idx: list[int]) -> np.ndarray:
    if method == "decode_all":
        return decode.decode_all(str(path))[idx]
    reader = decode.open_video(str(path), method)
    try:
        return reader.read(idx)
    finally:
        reader.close()


def _measure(videos: list[Path], n_frames: int, repeats: int, methods: list[str]) -> dict:
    plans = []
    for p in videos:
        r = decode.open_video(str(p), "pyav")
        plans.append((p, evenly_spaced_indices(r.info.total_frames, n_frames)))
        r.close()
    ref = {str(p): _read("decode_all", p, idx) for p, idx in plans}
    res: dict = {}
    for method in methods:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for p, idx in plans:
                frames = _read(method, p, idx)
                if not np.array_equal(frames, ref[str(p)]):
                    raise SystemExit(f"{method} returned different frames for {p}")
            best = min(best, time.perf_counter() - t0)
        res[method] = {"seconds": best, "frames_per_s": len(plans) * n_frames / best}
    res["videos"] = len(plans)
    res["frames_per_video"] = n_frames
    res["source_frames_per_video"] = decode.open_video(str(videos[0]), "pyav").info.total_frames
    return res


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_video", description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=16, help="frames sampled per video")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--demo-n", type=int, default=400, help="demo records (distinct clips are reused)")
    ap.add_argument("--long-videos", type=int, default=12)
    ap.add_argument("--long-frames", type=int, default=300)
    ap.add_argument("--long-size", type=int, default=224)
    ap.add_argument("--out", default=None, help="result json (default benchmarks/results/bench_video.json)")
    args = ap.parse_args()

    methods = ["decode_all", "pyav"] + (["decord"] if decode._decord is not None else [])
    results: dict = {"sets": {}}
    machine = machine_info(packages=("numpy", "av", "decord"))
    with tempfile.TemporaryDirectory(prefix="bench_video_") as tmp:
        tmp = Path(tmp)
        demo = make_demo(tmp / "demo", n=args.demo_n, seed=0)
        sets = {
            "demo": sorted((demo / "videos").glob("*.mp4")),
            "long": _long_videos(tmp, args.long_videos, args.long_frames, args.long_size),
        }
        for name, videos in sets.items():
            results["sets"][name] = _measure(videos, args.frames, args.repeats, methods)

    figures = []
    for name, r in results["sets"].items():
        base = r["decode_all"]["frames_per_s"]
        for method in methods:
            if method == "decode_all":
                continue
            v = r[method]["frames_per_s"]
            r[method]["ratio_vs_decode_all"] = v / base
            figures.append(emit(figure(f"{name}_{method}_frames_per_s", v, base, unit="frames/s",
                                       note="baseline: decode every frame (PyAV), pick the indices")))
        if "decord" in r:
            d, p = r["decord"]["frames_per_s"], r["pyav"]["frames_per_s"]
            figures.append(emit(figure(f"{name}_decord_vs_pyav_frames_per_s", d, p, unit="frames/s")))
        print(f"# {name}: {r['videos']} videos x {r['frames_per_video']} sampled of "
              f"{r['source_frames_per_video']} frames, best of {args.repeats}")
    write_result("bench_video", figures, machine, vars(args), results, args.out)


if __name__ == "__main__":
    main()
