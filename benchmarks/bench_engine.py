"""HF rollout engine: sampling with in-loop behaviour log-probs vs plain ``model.generate`` on the same inputs.

``--prompts`` video prompts (``--frames`` frames of ``--size`` pixels), G = ``--n`` completions each,
``--max-tokens`` new tokens, on the tiny random model of ``--arch`` (built offline into a temp dir), or with
``--model-size 3b|7b`` on Qwen2.5-VL's real sizes with random weights (bf16 on a GPU), all prompts in one call. The three variants sample the same tokens (same seed, same processed distribution):

* ``hf_engine_generate_s``: ``HFEngine.generate`` (log-probs captured by a logits processor, cut at the
  stop token, decoded); baseline: plain ``model.generate`` with the same settings and no log-probs
  (what sampling costs by itself). ratio = value / baseline (the engine's overhead; 1 is free).
* ``hf_engine_vs_output_scores_s``: the same engine call against the previous implementation
  (``output_scores=True``, every step's processed logits stacked into a float32 (B, L, V) tensor,
  ``log_softmax`` over it, gather). ratio = value / baseline.
* ``logprob_capture_bytes``: bytes the log-prob capture holds at the end of a call, ours (one step's
  (B, V) row + (B, L) floats) against the stacked scores (B x L x V floats), from the shapes of this run.
* ``hf_prompt_once_long_video_s``: ``HFEngine.generate`` at a long video (``--long-frames`` frames of
  ``--size`` pixels, the same prompts, G and token budget), each prompt prefilled once and its KV cache
  repeated for the G samples (the default); baseline: the same engine with ``prompt_once=False``, the whole
  prompt given to ``generate`` G times (the previous path). Both sample the same tokens (checked).
* ``hf_vision_cache_hit_long_video_s``: the same call with ``vision_cache_mib`` and the video's features
  already kept (a video that returns: another epoch, another question on it); baseline: the prompt-once
  engine without the cache, which runs the vision tower.

Medians over ``--repeats`` interleaved rounds (the variants alternate, so load drift hits all alike).
Prints ``name: value (baseline: value, ratio: x)`` lines, writes ``benchmarks/results/bench_engine.json``.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_engine [--arch qwen2_5_vl] [--prompts 2] [--n 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import emit, figure, machine_info, write_result


def _requests(proc, a, frames: int | None = None):
    import numpy as np

    from streamgrpo.engines.base import PromptRequest
    from streamgrpo.wire import Visual

    rng = np.random.default_rng(0)
    out = []
    frames = frames or a.frames
    for i in range(a.prompts):
        video = rng.integers(0, 255, (frames, a.size, a.size, 3), dtype=np.uint8)
        msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": f"What colour? ({i})"}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        meta = {"fps": 2.0, "frames_indices": list(range(frames)), "total_num_frames": frames}
        inputs = proc(text=[text], videos=[video], return_tensors="pt",
                      videos_kwargs={"do_sample_frames": False, "video_metadata": [meta]})
        out.append(PromptRequest(text, [Visual("video", video, 2.0, np.arange(frames, dtype=np.int32))], inputs))
    return out


def _plain_kwargs(engine, sampling, **extra) -> dict:
    """generate() settings of the plain baselines: generate's own warpers, the engine's stop/suppress ids."""
    from streamgrpo.engines.hf import NEUTRAL_GENERATION

    return dict(NEUTRAL_GENERATION, max_new_tokens=sampling.max_tokens, num_return_sequences=sampling.n,
                eos_token_id=engine.stop_ids, pad_token_id=engine.pad_id, suppress_tokens=engine.suppress_ids,
                do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=None, **extra)


def run(a) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from streamgrpo.engines.base import SamplingParams
    from streamgrpo.engines.hf import HFEngine, collate_prompts
    from streamgrpo.models.loading import load_processor
    from streamgrpo.models.tiny import build_tiny

    device = torch.device(a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.model_size == "tiny":
        with tempfile.TemporaryDirectory() as d:
            build_tiny(d, arch=a.arch, seed=0)
            proc = load_processor(d)
            model = AutoModelForImageTextToText.from_pretrained(d, dtype=dtype).to(device).eval()
    else:  # Qwen2.5-VL's real layer sizes, random weights, built once (the directory gpu_learner.py uses)
        d = a.model_dir or f"/tmp/streamgrpo-qwen25vl-{a.model_size}"
        if not (Path(d) / "config.json").exists():
            build_tiny(d, size=a.model_size)
        proc = load_processor(d)
        model = AutoModelForImageTextToText.from_pretrained(d, dtype=dtype).to(device).eval()
    engine = HFEngine(model, proc, device=device)
    reqs = _requests(proc, a)
    sampling = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=0)
    batch = {k: v.to(device) if hasattr(v, "to") else v
             for k, v in collate_prompts([r.inputs for r in reqs], engine.pad_id).items()}
    width = batch["input_ids"].shape[1]
    shapes: dict = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def ours():
        return engine.generate(reqs, sampling)

    @torch.no_grad()
    def plain():
        torch.manual_seed(0)
        return model.generate(**batch, **_plain_kwargs(engine, sampling))

    @torch.no_grad()
    def stacked():
        torch.manual_seed(0)
        out = model.generate(**batch, **_plain_kwargs(engine, sampling, output_scores=True, return_dict_in_generate=True))
        new = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()
        shapes["stacked"] = tuple(scores.shape)
        return torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)

    fns = {"engine": ours, "plain": plain, "output_scores": stacked}
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(a.repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    rows, steps, vocab = shapes["stacked"]
    got = ours()
    tokens = sum(len(c.token_ids) for g in got for c in g)
    long = _long_video({"once": engine, "per_sample": HFEngine(model, proc, device=device, prompt_once=False),
                        "cached": HFEngine(model, proc, device=device, vision_cache_mib=4096)},
                       _requests(proc, a, a.long_frames), sampling, a.repeats, sync)
    return {"times_s": times, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "rows": rows, "steps": steps, "vocab": vocab, "completion_tokens": tokens, "prompt_width": int(width),
            "bytes_ours": 4 * (rows * vocab + rows * steps), "bytes_stacked": 4 * rows * steps * vocab, "long": long}


def _long_video(engines: dict, reqs, sampling, repeats: int, sync) -> dict:
    """Interleaved rounds of the engines at a long video (prompt once, per sample, prompt once with the video's
    vision features kept); all sample the same tokens."""
    tokens = {name: [c.token_ids.tolist() for g in eng.generate(reqs, sampling) for c in g]  # warm-up, the check
              for name, eng in engines.items()}
    if any(t != tokens["once"] for t in tokens.values()):
        raise SystemExit("bench_engine: the engine variants gave different tokens at the long video")
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(repeats):
        for name, eng in engines.items():
            sync()
            t0 = time.perf_counter()
            eng.generate(reqs, sampling)
            sync()
            times[name].append(time.perf_counter() - t0)
    width = max(int(r.inputs["input_ids"].shape[-1]) for r in reqs)
    return {"times_s": times, "median_s": {k: statistics.median(v) for k, v in times.items()}, "prompt_width": width,
            "completion_tokens": sum(len(t) for t in tokens["once"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--long-frames", type=int, default=256, help="frames of the long video (prompt-once figure)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model-size", default="tiny", choices=["tiny", "3b", "7b"],
                    help="tiny (built in a temp dir), or Qwen2.5-VL's real 3B/7B sizes with random weights")
    ap.add_argument("--model-dir", default=None, help="3b/7b: where the model is (built once if missing; default "
                    "/tmp/streamgrpo-qwen25vl-<size>, as gpu_learner.py)")
    ap.add_argument("--device", default="auto", help="auto: cuda (bf16) when there is one, else cpu (fp32)")
    ap.add_argument("--out", default=None, help="result json (default benchmarks/results/bench_engine.json)")
    a = ap.parse_args(argv)
    import torch

    torch.manual_seed(0)
    r = run(a)
    m = r["median_s"]
    model_name = f"tiny {a.arch}" if a.model_size == "tiny" else f"random Qwen2.5-VL {a.model_size}"
    note = (f"{model_name}, {a.prompts} prompts x G={a.n}, {a.max_tokens} new tokens max, "
            f"{r['completion_tokens']} sampled")
    figures = [
        emit(figure("hf_engine_generate_s", m["engine"], m["plain"], unit="s",
                    note=note + "; baseline: plain model.generate, no log-probs (ratio = overhead)")),
        emit(figure("hf_engine_vs_output_scores_s", m["engine"], m["output_scores"], unit="s",
                    note="baseline: output_scores stacked into (B, L, V) float32, log_softmax, gather")),
        emit(figure("logprob_capture_bytes", r["bytes_ours"], r["bytes_stacked"], unit="B",
                    note=f"(B, V) + (B, L) floats vs B x L x V = {r['rows']} x {r['steps']} x {r['vocab']} "
                         f"(at Qwen's 151936 vocabulary the stacked tensor is {r['rows'] * r['steps'] * 151936 * 4 / 2**20:.0f} MiB)")),
        emit(figure("hf_prompt_once_long_video_s", r["long"]["median_s"]["once"], r["long"]["median_s"]["per_sample"],
                    unit="s", note=f"{model_name}, {a.prompts} prompts x G={a.n} at {a.long_frames} frames of {a.size}px "
                                   f"({r['long']['prompt_width']} prompt tokens), {r['long']['completion_tokens']} sampled; "
                                   "baseline: the whole prompt given to generate G times (prompt_once=False)")),
        emit(figure("hf_vision_cache_hit_long_video_s", r["long"]["median_s"]["cached"], r["long"]["median_s"]["once"],
                    unit="s", note="the same call with the video's vision features kept (rollout.vision_cache_mib); "
                                   "baseline: prompt once without the cache (the vision tower runs)")),
    ]
    write_result("bench_engine", figures, machine_info(("numpy", "torch", "transformers")), vars(a), r, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
