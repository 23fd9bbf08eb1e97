"""The long-video frontier in the memory plan: the most frames per video that fit one GPU, and what limits.

For Qwen2.5-VL-3B and 7B (config-only models at the published layer sizes, ``streamgrpo.models.tiny.write_config``:
no weights, no GPU), at Video-R1's per-frame budget (128 x 28 x 28 pixels, 64 video tokens a frame) and at
448 x 448 (128 a frame), it bisects ``data.max_frames`` (even counts up to the config's bound, 4096) with
``data.total_pixels`` raised to match, for

* the learner: full weights (torch backend, bf16, gradient checkpointing, frozen vision, beta 0.04) and
  LoRA r=64 (dropout 0.05); each with the G rows of a group in one micro-batch, with one row a micro-batch
  (``learner.micro_batch_tokens`` at its least: what the OOM retry ends at), and with ``learner.shared_prompt``;
  sdpa attention (no flash-attn: the GPU runs of docs/gpu.md);
* the HF generator: bf16 weights, G = 8 completions of one prompt (``rollout.prompts_per_batch: 1``);

G = 8 completions x 256 tokens, one group a step. The plan is :func:`~streamgrpo.learner.memory.plan.plan_memory`
(static parts and a step's) and :func:`~streamgrpo.learner.memory.step.generator_parts`, the frontier
:func:`~streamgrpo.learner.memory.frontier.max_frames`. Planned figures, not measured.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_frontier [--gpu-gib 79.2] [--markdown]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

from streamgrpo.config import build_config
from streamgrpo.learner.memory.frontier import Frontier, max_frames
from streamgrpo.learner.memory.plan import GiB, Placement, plan_memory
from streamgrpo.learner.memory.step import generator_parts, prompt_tokens, workload
from streamgrpo.models.params import count_params, model_shape

BUDGETS = {"128x28x28": 128 * 28 * 28, "448x448": 448 * 448}
LEARNERS = {
    "full, rows": ({}, {}),
    "full, one row a micro-batch": ({}, {"micro_batch_tokens": 16}),
    "full, shared prompt": ({}, {"shared_prompt": True}),
    "LoRA r=64, rows": ({"lora": {"r": 64}}, {}),
    "LoRA r=64, one row a micro-batch": ({"lora": {"r": 64}}, {"micro_batch_tokens": 16}),
    "LoRA r=64, shared prompt": ({"lora": {"r": 64}}, {"shared_prompt": True}),
}
MOST = 4096  # data.max_frames' bound


def config(model_dir: str, pixels: int, frames: int, model: dict | None = None, learner: dict | None = None):
    tree = {"model": {"name_or_path": model_dir, "tune_mm_vision": False, "dtype": "bfloat16",
                      "attn_implementation": "sdpa", **copy.deepcopy(model or {})},
            "learner": {"bf16": True, "gradient_checkpointing": True, "groups_per_step": 1, **(learner or {})},
            "rollout": {"num_generations": 8, "max_completion_length": 256, "prompts_per_batch": 1,
                        "engine": "hf"},
            "data": {"max_frames": frames, "min_frames": 2, "max_pixels": pixels, "min_pixels": min(pixels, 128 * 28 * 28),
                     "total_pixels": frames * pixels},
            "loss": {"beta": 0.04}}
    return build_config(tree)


def learner_frontier(model_dir: str, pixels: int, model: dict, learner: dict, capacity: float) -> Frontier:
    cfg = config(model_dir, pixels, 2, model, learner)
    counts, shape, place = count_params(cfg), model_shape(cfg), Placement.from_config(cfg)
    static = plan_memory(counts, place).device

    def parts(frames: int) -> dict[str, float]:
        return plan_memory(counts, place, shape,
                           workload(config(model_dir, pixels, frames, model, learner), shape, flash_attn=False)).step

    return max_frames(parts, capacity, most=MOST, static=static)


def generator_frontier(model_dir: str, pixels: int, capacity: float) -> Frontier:
    cfg = config(model_dir, pixels, 2)
    counts, shape = count_params(cfg), model_shape(cfg)
    return max_frames(lambda f: generator_parts(config(model_dir, pixels, f), shape), capacity, most=MOST,
                      static={"weights": 2.0 * counts.total})


def _cell(f: Frontier, tokens_per_frame: float) -> tuple[str, str]:
    if not f.frames:
        return "none", f"the static parts alone ({sum(f.parts.values()) / GiB:.1f} GiB planned at 2 frames)"
    frames = f"{f.frames}" + ("+" if f.capped else "")
    share = f.parts[f.limit] / GiB
    return f"{frames} ({f.frames * tokens_per_frame:,.0f} video tokens)", f"{f.limit} ({share:.1f} GiB)"


def rows(gpu_gib: float) -> list[tuple[str, str, str, str, str]]:
    from streamgrpo.models.tiny import write_config

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in ("3b", "7b"):
            model_dir = str(write_config(Path(tmp) / size, size=size))
            for budget, pixels in BUDGETS.items():
                shape = model_shape(config(model_dir, pixels, 2))
                per_frame = (prompt_tokens(config(model_dir, pixels, 64), shape) - prompt_tokens(
                    config(model_dir, pixels, 32), shape)) / 32
                cap = gpu_gib * GiB
                for name, (model, learner) in LEARNERS.items():
                    f = learner_frontier(model_dir, pixels, model, learner, cap)
                    out.append((size.upper(), budget, f"learner, {name}", *_cell(f, per_frame)))
                f = generator_frontier(model_dir, pixels, cap)
                out.append((size.upper(), budget, "HF generator, G = 8", *_cell(f, per_frame)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-gib", type=float, default=79.2, help="one GPU's memory (an H100 80GB: 79.2 GiB)")
    ap.add_argument("--markdown", action="store_true", help="print the table as docs/performance.md has it")
    args = ap.parse_args(argv)
    table = rows(args.gpu_gib)
    if args.markdown:
        print("| model | pixels a frame | role | most frames a video | limited by (its GiB there) |")
        print("|---|---|---|---:|---|")
        for r in table:
            print("| " + " | ".join(r) + " |")
    else:
        for r in table:
            print(f"{r[0]} {r[1]:<10} {r[2]:<36} {r[3]:<28} {r[4]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
