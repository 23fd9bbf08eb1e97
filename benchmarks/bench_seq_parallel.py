"""The CPU proxy cost of ``learner.sequence_parallel``: a forward and backward of the completion log-probs of one
long-video group on one rank, and split over two gloo ranks (streamgrpo/models/ulysses.py), in the same run.

The tiny Qwen2.5-VL (random weights, float32, sdpa), one group: a video of ``--frames`` frames at 112 x 112 (16
video tokens a frame pair) and G = 4 completions of 64 tokens, rows and shared prompt. Rank 0 times the step
alone (rank 1 waits), then both ranks time it split; the median of ``--repeat`` runs each. On a CPU the exchange
is a socket copy and the two ranks share the machine's cores, so the ratio is an upper bound of the cost on GPUs
(NVLink), where sequence parallelism is for memory: each rank holds 1/2 of the decoder's activations.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_seq_parallel [--frames 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _group(proc, frames: int):
    from streamgrpo.models.batching import GroupInputs, vision_token_ids

    rng = np.random.default_rng(0)
    video = rng.integers(0, 255, (frames, 112, 112, 3), dtype=np.uint8)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]}],
                                    add_generation_prompt=True, tokenize=False)
    feats = proc(text=[text], videos=[video], return_tensors="pt", videos_kwargs={
        "do_sample_frames": False,
        "video_metadata": [{"fps": 2.0, "frames_indices": list(range(frames)), "total_num_frames": frames}]})
    banned = set(vision_token_ids(proc))
    g = torch.Generator().manual_seed(0)
    comps = []
    for _ in range(4):
        ids = [t for t in torch.randint(0, len(proc.tokenizer), (200,), generator=g).tolist() if t not in banned]
        comps.append(torch.tensor(ids[:64]))
    return GroupInputs.from_processor(feats, comps)


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def worker(args) -> int:
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from streamgrpo.models.batching import build_batch
    from streamgrpo.models.logprobs import completion_logprobs
    from streamgrpo.models.sp_group import new_groups

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sp = new_groups(dist.get_world_size(), rank, dist.get_world_size())
    proc = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    batch = build_batch([_group(proc, args.frames)], proc.tokenizer.pad_token_id, model=model)
    out = {"tokens": int(batch.input_ids.shape[1]), "sequences": int(batch.input_ids.shape[0])}
    for shared in (False, True):
        def step(group=None, shared=shared):
            model.zero_grad(set_to_none=True)
            lp, _ = completion_logprobs(model, batch, shared_prompt=shared, seq_parallel=group)
            lp.sum().backward()

        one = _time(step, args.repeat) if rank == 0 else 0.0
        dist.barrier()
        split = _time(lambda: step(sp), args.repeat)
        out["shared" if shared else "rows"] = {"one_rank_s": one, "two_ranks_s": split}
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", help="(internal) the tiny model's directory")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:
        return worker(args)
    from streamgrpo.models.tiny import build_tiny
    from streamgrpo.runtime.processes import free_port

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny(Path(tmp) / "tiny", arch="qwen2_5_vl", seed=0)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "benchmarks.bench_seq_parallel", "--frames", str(args.frames),
               "--repeat", str(args.repeat), "--model", str(model)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode:
            print(res.stderr[-3000:], file=sys.stderr)
            return res.returncode
        out = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    print(f"{cpu}, {time.strftime('%Y-%m-%d')}: tiny Qwen2.5-VL, {args.frames} frames at 112x112, G=4 x 64 tokens "
          f"({out['sequences']} rows of {out['tokens']} tokens); forward + backward of the log-probs, median of "
          f"{args.repeat}")
    for layout in ("rows", "shared"):
        r = out[layout]
        print(f"  {layout:<7} one rank {r['one_rank_s']:.3f} s, sequence parallel over 2 gloo ranks "
              f"{r['two_ranks_s']:.3f} s: x{r['two_ranks_s'] / r['one_rank_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
