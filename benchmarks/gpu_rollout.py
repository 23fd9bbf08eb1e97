"""Rollout throughput on a GPU: the vLLM engine against the HF engine (baseline), same process.

Both engines sample the same prompts (real records: videos/images through the generator's own
prompt and processor path) with the same G, temperature and token budget, in batches of
``--prompts-per-batch``; each does one warm-up batch first. Throughput = groups (prompts x G
completions) per second of ``generate`` calls; completion tokens per second is printed too
(completions stop at the end token, so the engines' token counts differ a little). The HF engine
runs first and is freed before vLLM takes ``--gpu-memory-utilization`` of the GPU.

Prints ``name: value (baseline: value, ratio: x)`` lines and writes
``benchmarks/results/gpu_rollout.json``. Needs CUDA and vLLM (``pip install 'streamgrpo[gpu]'``);
without CUDA it says so and exits 0, unless ``--allow-cpu`` (a smoke run, e.g. in .venv-vllm).

    python -m benchmarks.gpu_rollout --model Qwen/Qwen2.5-VL-3B-Instruct --data data/demo/train.jsonl \\
        [--groups 64] [--num-generations 8] [--max-tokens 256] [--prompts-per-batch 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time

from benchmarks.common import emit, figure, machine_info, write_result


def _config(args):
    from streamgrpo.config import build_config

    sets = [f"model.name_or_path={args.model}", f"model.dtype={args.dtype}", f"data.train_path={args.data}",
            f"rollout.num_generations={args.num_generations}", f"rollout.max_completion_length={args.max_tokens}",
            f"rollout.temperature={args.temperature}", f"rollout.prompts_per_batch={args.prompts_per_batch}",
            f"rollout.vllm.gpu_memory_utilization={args.gpu_memory_utilization}", *args.set]
    if args.max_model_len:
        sets.append(f"rollout.vllm.max_model_len={args.max_model_len}")
    return build_config({}, sets)


def _requests(cfg, processor, n: int):
    from streamgrpo.data.dataset import iter_samples
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs, vision_factors
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.base import PromptRequest

    records = load_records(cfg.data.train_path, cfg.data)
    factor, temporal = vision_factors(processor)
    samples = iter_samples(records, cfg.data, shard=0, num_shards=1, seed=cfg.seed, epochs=None, factor=factor,
                           temporal_patch=temporal)
    out = []
    for record, visuals in itertools.islice(samples, n):
        text = build_prompt_text(processor, record, cfg.data)
        out.append(PromptRequest(text, visuals, processor_inputs(processor, text, visuals), record.id))
    return out


def _run(engine, requests, sampling, batch: int) -> dict:
    engine.generate(requests[:batch], sampling)  # warm-up (compilation, caches, allocator)
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(requests), batch):
        for group in engine.generate(requests[i:i + batch], sampling):
            tokens += sum(len(c.token_ids) for c in group)
    seconds = time.perf_counter() - t0
    return {"groups": len(requests), "seconds": seconds, "groups_per_s": len(requests) / seconds,
            "tokens_per_s": tokens / seconds, "completion_tokens": tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="hub id or directory of a Qwen2.5-VL / Qwen3-VL checkpoint")
    p.add_argument("--data", required=True, help="training records (JSONL) whose prompts are sampled")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompts-per-batch", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--engines", default="hf,vllm", help="comma list; the ratio needs both")
    p.add_argument("--set", action="append", default=[], help="extra config override section.key=value")
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (a smoke run, not a figure)")
    p.add_argument("--out", default=None, help="result json path (default benchmarks/results/gpu_rollout.json)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("# gpu_rollout: no CUDA device here: nothing measured (use --allow-cpu for a smoke run)")
        return 0
    from streamgrpo.engines.base import SamplingParams
    from streamgrpo.models.loading import load_processor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = _config(args)
    processor = load_processor(cfg.model.name_or_path, cfg.model.revision)
    requests = _requests(cfg, processor, args.groups)
    sampling = SamplingParams.from_config(cfg.rollout)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    results: dict[str, dict] = {}
    if "hf" in engines:
        from streamgrpo.engines.hf import HFEngine
        from streamgrpo.models.loading import load_model

        engine = HFEngine(load_model(cfg.model, device), processor, device=device)
        results["hf"] = _run(engine, requests, sampling, args.prompts_per_batch)
        print(f"# hf: {results['hf']}")
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if "vllm" in engines:
        from streamgrpo.engines.vllm import VLLMEngine

        t0 = time.perf_counter()
        engine = VLLMEngine.from_config(cfg, processor)
        start_s = time.perf_counter() - t0
        results["vllm"] = {**_run(engine, requests, sampling, args.prompts_per_batch), "engine_start_s": start_s}
        print(f"# vllm: {results['vllm']}")
        engine.close()
    hf, vl = results.get("hf", {}), results.get("vllm", {})
    note = f"{args.model}, G={args.num_generations}, max {args.max_tokens} tokens, {args.prompts_per_batch} prompts/call"
    figs = [emit(figure("vllm_rollout_groups_per_s", vl.get("groups_per_s"), hf.get("groups_per_s"),
                        unit="groups/s", note=note + " (baseline: HF engine)")),
            emit(figure("vllm_rollout_tokens_per_s", vl.get("tokens_per_s"), hf.get("tokens_per_s"),
                        unit="tokens/s", note="completion tokens per second"))]
    write_result("gpu_rollout", figs, machine_info(("torch", "transformers", "vllm"), device=device),
                 args=vars(args), data=results, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
