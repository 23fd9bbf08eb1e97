"""Visuals by reference against inline (``rollout.media``): message bytes, Redis memory, learner time
per step, and whether lossless compression of inline frames is worth it. Every figure is a ratio
against inline measured in the same run.

* ``media_3b_message_bytes``: one group at the 3B benchmark shape (16 frames of 448x448 decoded
  from a real H.264 mp4, G = 8 completions x 256 tokens) by reference; baseline: the same group
  inline. Goal: <= 1/50.
* ``media_3b_redis_bytes``: Redis ``used_memory`` growth while it holds ``--window`` such groups
  (an uncommitted window) by reference; baseline: inline.
* ``media_demo_window_redis_bytes``: the same for the demo's own uncommitted window
  (``learner.save_steps x groups_per_step`` of ``make demo``'s groups: 8 frames of 56x56).
* ``media_inline_zlib1_bytes``: zlib level 1 (the fastest lossless codec in the standard library)
  of the 3B group's frames; baseline: the raw frames; the note gives MB/s. Synthetic clips (a moving
  gradient with sensor-like noise) are kinder to compression than most camera video.
* ``media_learner_step_s_<shape>``: a real learner (``run_learner``, the tiny Qwen2.5-VL, a real
  redis-server holding every group before it starts) training ``--steps`` steps on groups sampled
  by the tiny model (``--demo-steps`` on the demo's clips, ``--steps`` on 448x448), wall seconds per step (the gaps between ``metrics.jsonl`` lines, the first
  step left out) with visuals by reference and the learner's frame cache off (every visual decoded);
  baseline: the same groups inline. Shapes: ``demo`` (8 frames of 56x56, the demo's clips) and
  ``448`` (16 frames of 448x448). Goal: <= 1.05. Runs alternate inline/reference ``--repeats`` times.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_media [--steps 6] [--demo-steps 30] [--repeats 3] [--window 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.common import emit, figure, machine_info, write_result


def _clip(path: Path, frames: int, size: int, seed: int) -> None:
    """A moving gradient with noise, H.264 (the demo's own writer)."""
    from streamgrpo.recipes.demo.data import write_mp4

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    out = np.empty((frames, size, size, 3), np.uint8)
    for t in range(frames):
        base = np.stack([(x + 7 * t) % 256, (y + 3 * t) % 256, (x + y + 5 * t) % 256], -1)
        out[t] = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
    write_mp4(path, out)


def _records(root: Path, n: int, frames: int, size: int) -> Path:
    (root / "videos").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        _clip(root / "videos" / f"c{i}.mp4", frames, size, i)
        lines.append(json.dumps({"id": f"r{i}", "video": f"videos/c{i}.mp4", "meta": {"kind": "direction"},
                                 "conversations": [{"from": "human", "value": "<video>\nWhich way? (A) left (B) right"},
                                                   {"from": "gpt", "value": "<answer>(A) left</answer>"}]}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root / "train.jsonl"


def _group_3b(root: Path):
    """One group at the 3B benchmark shape, its frames decoded from a real mp4 (16 x 448 x 448)."""
    from streamgrpo.data.video import decode_resized
    from streamgrpo.wire import Completion, MediaRef, ScoredGroup, Visual
    from streamgrpo.wire.media import frames_digest

    _records(root, 1, 16, 448)
    frames = decode_resized("video", str(root / "videos" / "c0.mp4"), list(range(16)), 448, 448, "auto")
    rng = np.random.default_rng(0)
    visual = Visual("video", frames, 24.0, np.arange(16, dtype=np.int32),
                    MediaRef("videos/c0.mp4", 448, 448, frames_digest(frames), "auto"))
    completions = [Completion(rng.integers(0, 150_000, 256).astype(np.int32),
                              -np.abs(rng.standard_normal(256)).astype(np.float32), "x" * 600, "stop",
                              {"accuracy": 1.0, "format": 1.0}, 1.0) for _ in range(8)]
    prompt = np.arange(16 // 2 * 16 * 16 + 60, dtype=np.int32)  # 2048 visual tokens and the question's
    return ScoredGroup("r0", "gen-0", 0, "Qwen/Qwen2.5-VL-3B-Instruct", prompt, [visual], "(A) left", completions,
                       prompt_text="q")


def _redis_bytes(groups: list, tmp: Path) -> int:
    """``used_memory`` growth of a fresh redis-server after it takes ``groups`` into the stream."""
    from streamgrpo.transport.queue.redis_stream import RedisQueue
    from streamgrpo.transport.queue.server import EmbeddedRedis

    with EmbeddedRedis(tmp, appendfsync="no") as srv:
        q = RedisQueue(srv.url, namespace="bench", consumer="p", max_pending=10**6, max_message_bytes=256 << 20)
        before = int(q.client.info("memory")["used_memory"])
        for i in range(0, len(groups), 8):
            q.put_many(groups[i:i + 8])
        after = int(q.client.info("memory")["used_memory"])
        q.close()
    return after - before


def _learner_step_s(groups: list, cfg_sets: list[str], run_dir: Path, steps: int) -> float:
    """Median wall seconds per step of a real learner over ``groups`` (all queued before it starts)."""
    from streamgrpo.config import load_config
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.transport.queue.redis_stream import RedisQueue
    from streamgrpo.transport.queue.server import EmbeddedRedis

    with EmbeddedRedis(run_dir / "redis", appendfsync="no") as srv:
        q = RedisQueue(srv.url, namespace="bench", consumer="p", max_pending=10**6, max_message_bytes=256 << 20)
        q.put_many(groups)
        q.close()
        cfg = load_config("demo", [f"run_dir={run_dir}", f"queue.url={srv.url}", "queue.namespace=bench",
                                   f"learner.max_steps={steps}", "learner.save_steps=1000", "weights.pub_port=0",
                                   "weights.snapshot_port=0", "metrics.port=0", "learner.max_staleness=1000",
                                   "learner.media_cache_mib=0", *cfg_sets])
        assert run_learner(cfg) == 0
    times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(times) != steps:
        raise RuntimeError(f"bench_media: the learner trained {len(times)} of {steps} steps")
    return statistics.median(np.diff(times).tolist())


def _learner_pair(model_dir: str, records: Path, shape_sets: list[str], steps: int, per_step: int, repeats: int,
                  tmp: Path, name: str) -> dict:
    from benchmarks.rollouts import sample_groups
    from streamgrpo.wire import inline

    n = steps * per_step + per_step  # the read-ahead takes one step more
    groups = sample_groups(model_dir, records, n, num_generations=4, max_tokens=32, data_overrides=shape_sets,
                           media="reference")
    sets = [f"model.name_or_path={model_dir}", f"data.train_path={records}", f"learner.groups_per_step={per_step}"]
    from streamgrpo import metrics as M

    ref_s, inline_s, waited = [], [], []
    for r in range(repeats):
        inline_s.append(_learner_step_s([inline(g) for g in groups], sets, tmp / f"{name}-inline-{r}", steps))
        w0 = M.MEDIA_WAIT_SECONDS._value.get()
        ref_s.append(_learner_step_s(groups, sets, tmp / f"{name}-ref-{r}", steps))
        waited.append(round((M.MEDIA_WAIT_SECONDS._value.get() - w0) / steps, 4))
    value, base = statistics.median(ref_s), statistics.median(inline_s)
    runs = f"ref {[round(x, 4) for x in ref_s]} inline {[round(x, 4) for x in inline_s]}"
    return figure(f"media_learner_step_s_{name}", value, base, unit="s/step",
                  note=f"reference/inline, {steps} steps of {per_step} groups; runs: {runs}; "
                       f"waited for decoding per step (reference): {waited} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="learner steps per timed run (16-frame 448x448 clips)")
    ap.add_argument("--demo-steps", type=int, default=30, help="learner steps per timed run on the demo's clips")
    ap.add_argument("--repeats", type=int, default=3, help="inline/reference run pairs per shape")
    ap.add_argument("--window", type=int, default=32, help="3B-shape groups held in Redis")
    a = ap.parse_args(argv)
    from streamgrpo.config import load_config
    from streamgrpo.models.tiny import build_tiny
    from streamgrpo.recipes.demo.data import make_demo
    from streamgrpo.wire import encode, inline

    figs = []
    with tempfile.TemporaryDirectory(prefix="bench_media_") as tmp_s:
        tmp = Path(tmp_s)
        g = _group_3b(tmp / "clip3b")
        by_ref, by_pixels = len(encode(g)), len(encode(inline(g)))
        figs.append(emit(figure("media_3b_message_bytes", by_ref, by_pixels, unit="bytes",
                                note="one group: 16 x 448 x 448 frames, G=8 x 256 tokens; reference/inline")))
        window = [replace(g, group_id=f"w{i}") for i in range(a.window)]
        figs.append(emit(figure("media_3b_redis_bytes", _redis_bytes(window, tmp / "r1"),
                                _redis_bytes([inline(x) for x in window], tmp / "r2"), unit="bytes",
                                note=f"Redis used_memory growth holding {a.window} such groups")))
        raw = np.ascontiguousarray(g.visuals[0].frames).tobytes()
        t0 = time.perf_counter()
        packed = zlib.compress(raw, 1)
        mbps = len(raw) / 1e6 / (time.perf_counter() - t0)
        figs.append(emit(figure("media_inline_zlib1_bytes", len(packed), len(raw), unit="bytes",
                                note=f"zlib level 1 of the inline frames at {mbps:.0f} MB/s")))

        model = str(build_tiny(tmp / "tiny"))
        demo = make_demo(tmp / "demo", n=64, seed=0)
        cfg = load_config("demo")
        n_window = cfg.learner.save_steps * cfg.learner.groups_per_step
        from benchmarks.rollouts import sample_groups

        few = sample_groups(model, demo / "train.jsonl", 8, num_generations=cfg.rollout.num_generations,
                            max_tokens=cfg.rollout.max_completion_length,
                            data_overrides=["data.min_frames=8", "data.max_frames=8"], media="reference")
        held = [replace(few[i % len(few)], group_id=f"d{i}") for i in range(n_window)]
        figs.append(emit(figure("media_demo_window_redis_bytes", _redis_bytes(held, tmp / "r3"),
                                _redis_bytes([inline(x) for x in held], tmp / "r4"), unit="bytes",
                                note=f"the demo's uncommitted window: {n_window} groups (save_steps x groups_per_step)")))
        figs.append(emit(_learner_pair(model, demo / "train.jsonl", ["data.min_frames=8", "data.max_frames=8"],
                                       a.demo_steps, 4, a.repeats, tmp, "demo")))
        big = _records(tmp / "clips448", a.steps * 4 + 4, 16, 448)
        figs.append(emit(_learner_pair(model, big, ["data.min_frames=16", "data.max_frames=16", "data.fps=24",
                                                     f"data.min_pixels={448 * 448}", f"data.max_pixels={448 * 448}",
                                                     f"data.total_pixels={16 * 448 * 448}"],
                                       a.steps, 4, a.repeats, tmp, "448")))
    write_result("bench_media", figs, machine_info(packages=("numpy", "torch", "transformers", "decord", "av")),
                 args=vars(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
