"""Learner step time: one vision pass per group vs the usual one pass per row.

A group of ``--G`` (8) completions of ``--completion-len`` (64) tokens shares one prompt with a
``--frames`` (16) frame video of ``--size`` x ``--size`` pixels, on the tiny random model of each
architecture (built offline into a temp dir). A step is ``completion_logprobs`` forward plus the
backward of a policy-gradient-shaped loss, all parameters trainable (the vision encoder too).

* ``step_shared_vision_<arch>_s``: ``shared_vision=True`` (the vision encoder runs once for the
  group); baseline: ``shared_vision=False`` (pixels repeated per row, the encoder runs G times,
  as TRL does), same batch, same process. ratio = baseline / value (speed-up).
* ``step_per_row_<arch>_s``: G separate plain forwards (one row each) as a second baseline,
  reported against the shared step the same way.

Prints ``name: value (baseline: value, ratio: x)`` lines and writes
``benchmarks/results/bench_learner.json`` with machine info. Medians over ``--repeats``.

``--proxy``: the learner's compute path at the 3B layer shapes (two decoder layers, two vision blocks):
aten ops, vision attention calls, weight casts and peak memory of one step, before vs after each lever of
issue 52 (:mod:`benchmarks.learner_proxy`), into ``benchmarks/results/bench_learner_proxy.json``.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_learner [--size 224] [--repeats 5] [--device cpu]
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_learner --proxy [--model-dir /tmp/qwen25vl-3b-l2]
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_learner --proxy --counter profiler \
        --variants before_fp32,vision_once_fp32,compiled_fp32      # learner.compile, counted as it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import emit, figure, machine_info, write_result


def learner_machine_info(device: str) -> dict:
    import torch

    info = machine_info(packages=("numpy", "torch", "transformers"), device=device)
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _group(proc, arch: str, a, seed: int = 0):
    """One GroupInputs: a moving-square video + question, G random completions (no vision tokens)."""
    import numpy as np
    import torch

    from streamgrpo.models.batching import GroupInputs, vision_token_ids

    rng = np.random.default_rng(seed)
    video = rng.integers(0, 60, (a.frames, a.size, a.size, 3), dtype=np.uint8)
    side = a.size // 4
    for t in range(a.frames):
        x = t * (a.size - side) // max(a.frames - 1, 1)
        video[t, a.size // 3 : a.size // 3 + side, x : x + side] = (220, 30, 30)
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What colour is the moving square?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    meta = {"fps": 2.0, "frames_indices": list(range(a.frames)), "total_num_frames": a.frames}
    feats = proc(text=[text], videos=[video], return_tensors="pt",
                 videos_kwargs={"do_sample_frames": False, "video_metadata": [meta]})
    banned = set(vision_token_ids(proc))
    allowed = torch.tensor([t for t in range(len(proc.tokenizer)) if t not in banned])
    g = torch.Generator().manual_seed(seed)
    comps = [allowed[torch.randint(0, len(allowed), (a.completion_len,), generator=g)] for _ in range(a.G)]
    return GroupInputs.from_processor(feats, comps)


def _time(fn, repeats: int, warmup: int, sync) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def run_arch(arch: str, a) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from streamgrpo.models.batching import build_batch
    from streamgrpo.models.logprobs import completion_logprobs, per_row_logprobs
    from streamgrpo.models.tiny import build_tiny

    with tempfile.TemporaryDirectory() as d:
        build_tiny(d, arch=arch, seed=0)
        proc = AutoProcessor.from_pretrained(d)
        model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
    model.to(a.device).train()
    group = _group(proc, arch, a)
    batch = build_batch([group], proc.tokenizer.pad_token_id, model=model).to(a.device)
    mask = batch.completion_mask
    adv = torch.randn(mask.shape[0], 1, device=a.device)

    def step(fn):
        def go():
            model.zero_grad(set_to_none=True)
            lp = fn()
            loss = -(adv * lp * mask).sum() / mask.sum()
            loss.backward()
        return go

    shared = step(lambda: completion_logprobs(model, batch, temperature=1.0, shared_vision=True)[0])
    naive = step(lambda: completion_logprobs(model, batch, temperature=1.0, shared_vision=False)[0])
    per_row = step(lambda: per_row_logprobs(model, batch, temperature=1.0)[0])
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        diff = (completion_logprobs(model, batch, shared_vision=True)[0]
                - completion_logprobs(model, batch, shared_vision=False)[0]).abs().max().item()
    # interleave the variants so that load drift hits all of them alike
    times: dict[str, list[float]] = {"shared": [], "naive": [], "per_row": []}
    for fn in (shared, naive, per_row):
        _time(fn, 0, a.warmup, sync)
    for _ in range(a.repeats):
        for name, fn in (("shared", shared), ("naive", naive), ("per_row", per_row)):
            times[name] += _time(fn, 1, 0, sync)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "arch": arch, "seq_len": int(batch.input_ids.shape[1]), "rows": batch.num_rows,
        "video_tokens": int((batch.input_ids[0] == model.config.video_token_id).sum()),
        "vision_patches_per_group": int(group.pixel_values_videos.shape[0]),
        "max_abs_logprob_diff_shared_vs_naive": diff,
        "times_s": times, "median_s": med,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_learner", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2_5_vl,qwen3_vl")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--size", type=int, default=224, help="frame side in pixels (a multiple of 28 and 32 is exact)")
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="result json (default benchmarks/results/bench_learner.json)")
    ap.add_argument("--proxy", action="store_true", help="the 3B-shape compute-path counts (see above)")
    ap.add_argument("--proxy-variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variants", default="before_fp32,vision_once_fp32,before,vision_once,master")
    ap.add_argument("--counter", choices=("dispatch", "profiler"), default="dispatch",
                    help="--proxy: count with a TorchDispatchMode (per region) or torch.profiler (compiled variants)")
    ap.add_argument("--decoder-layers", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "streamgrpo-qwen25vl-3b-l2"))
    a = ap.parse_args()
    if a.proxy_variant:
        from benchmarks.learner_proxy import run_variant

        print(json.dumps(run_variant(a.proxy_variant, a)), flush=True)
        return
    if a.proxy:
        return proxy_main(a)
    import torch

    torch.manual_seed(0)
    machine = learner_machine_info(a.device)
    results: dict = {"runs": {}}
    figures: list[dict] = []
    for arch in a.arch.split(","):
        r = run_arch(arch, a)
        results["runs"][arch] = r
        m = r["median_s"]
        figures.append(emit(figure(f"step_shared_vision_{arch}_s", m["shared"], m["naive"], m["naive"] / m["shared"],
                                   unit="s", note="ratio = speed-up; baseline = vision encoder once per row, batched")))
        figures.append(emit(figure(f"step_per_row_{arch}_s", m["shared"], m["per_row"], m["per_row"] / m["shared"],
                                   unit="s", note="ratio = speed-up; baseline = G separate single-row forwards")))
        print(f"#   {arch}: G={r['rows']} seq_len={r['seq_len']} video_tokens={r['video_tokens']} "
              f"patches/group={r['vision_patches_per_group']} max|shared-naive|={r['max_abs_logprob_diff_shared_vs_naive']:.2e}")
    write_result("bench_learner", figures, machine, vars(a), results, a.out)


def proxy_main(a) -> None:
    from benchmarks.learner_proxy import run_all

    machine = learner_machine_info("cpu")
    from benchmarks.learner_proxy import baseline_of

    rows = run_all(a)
    by_name = {r["variant"]: r for r in rows}
    figures = []
    for r in rows:
        v = r["variant"]
        base = by_name.get(baseline_of(v))
        if base is None or base is r:
            continue
        keys = ((("ops_and_kernels", "ops"), ("ops_and_kernels_per_decoder_layer", "ops"), ("kernels", "kernels"),
                 ("launches", "launches"), ("launches_per_decoder_layer", "launches"), ("step_s", "s")) if a.counter == "profiler" else
                (("total_ops", "ops"), ("ops_per_decoder_layer", "ops"), ("ops_per_vision_block", "ops"),
                 ("vision_attention_per_block", "calls"), ("weight_casts", "casts"), ("peak_rss_step_mib", "MiB")))
        for key, unit in keys:
            ratio = r[key] / base[key] if base[key] else None
            figures.append(emit(figure(f"proxy_{v}_{key}", r[key], base[key], ratio, unit=unit,
                                       note=f"baseline: {base['variant']}; ratio = value / baseline")))
    name = "bench_learner_proxy" + ("_profiler" if a.counter == "profiler" else "")
    write_result(name, figures, machine, vars(a), {"rows": rows}, a.out)


if __name__ == "__main__":
    main()
