"""The learner's compute path at the 3B layer shapes on a CPU: what a step issues, before vs after each lever.

``python -m benchmarks.bench_learner --proxy`` builds (into ``--model-dir``) a random Qwen2.5-VL with
Qwen2.5-VL-3B's layer shapes (decoder hidden 2048 / MLP 11008, vision 1280 / 3420, 16 heads, 112-pixel
windows, the merger into 2048), two decoder layers and two vision blocks, and the tokenizer's own small
vocabulary (the embeddings and LM head are not what is counted here). Each variant runs the real
:class:`~streamgrpo.learner.trainer.Learner` (torch backend, activation
checkpointing, ``loss.beta`` 0.04: a reference model) in its own process for one step on one group of
``--G`` completions x ``--completion-len`` tokens over a ``--frames`` x ``--size``² video, under
:class:`benchmarks.op_counts.OpCounter`:

* ``before``: the learner as it was (float32 parameters under autocast; the vision tower run by the
  reference and by the policy); ``before_fp32`` the same without bf16 (a CPU runs bf16 ~10x slower);
* ``vision_once`` (``vision_once_fp32``): the frozen trunk once per micro-batch (:mod:`streamgrpo.models.vision_trunk`);
* ``master``: and ``learner.master_weights`` (bf16 parameters, float32 masters in the optimizer);
* ``compiled`` (``compiled_fp32`` on top of ``vision_once_fp32``): and ``learner.compile`` (each decoder layer
  compiled by inductor); ``compiled_matmuls_fp32``: and ``learner.checkpoint_matmuls`` (the recompute keeps
  the matmul and attention outputs); ``matmuls_fp32``: that without the compile (what it keeps: the step's peak).
* ``vision_batched`` (on ``master``; ``vision_batched_fp32`` on ``vision_once_fp32``, each its baseline): the
  vision attention's windows in one packed call per block (:mod:`streamgrpo.models.vision_attention`); the
  other variants run transformers' per-chunk vision attention, as before it.

``--counter profiler`` (what a compiled step can be counted with: under the dispatch mode nothing compiles)
counts each variant's second step (the first compiles) from torch.profiler's events: every ``aten::`` op and
every kernel inductor generated (:func:`benchmarks.op_counts.profiled`); and runs it again with one decoder
layer fewer: the difference is one decoder layer's ops and kernels a step, forward, recompute and backward.

Per variant: aten ops per step (and per layer of each region, forward and recompute), vision attention
calls per layer and vision passes, fp32->bf16 weight casts per step, the step's peak resident memory above
what was resident before it (sampled every 2 ms), and its wall time (a CPU, for the record only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BF16 = ["model.dtype=bfloat16", "learner.bf16=true"]
FP32 = ["model.dtype=float32", "learner.bf16=false"]
VARIANTS = {  # the first of each precision is the baseline of the others
    "before_fp32": dict(share_vision=False, sets=FP32),
    "vision_once_fp32": dict(share_vision=True, sets=FP32),
    "before": dict(share_vision=False, sets=BF16),
    "vision_once": dict(share_vision=True, sets=BF16),
    "master": dict(share_vision=True, sets=[*BF16, "learner.master_weights=true"]),
    # learner.compile (item 5): counted with --counter profiler only (under the dispatch mode nothing compiles)
    "compiled_fp32": dict(share_vision=True, sets=[*FP32, "learner.compile=true"]),
    "compiled": dict(share_vision=True, sets=[*BF16, "learner.master_weights=true", "learner.compile=true"]),
    "vision_batched_fp32": dict(share_vision=True, sets=FP32, packed_vision=True),
    "vision_batched": dict(share_vision=True, sets=[*BF16, "learner.master_weights=true"], packed_vision=True),
    # learner.checkpoint_matmuls (selective checkpointing), eager (its step's peak memory) and on top of compiled_fp32
    "matmuls_fp32": dict(share_vision=True, sets=[*FP32, "learner.checkpoint_matmuls=true"]),
    "compiled_matmuls_fp32": dict(share_vision=True, sets=[*FP32, "learner.compile=true",
                                                           "learner.checkpoint_matmuls=true"]),
}
BASELINES = {"vision_batched_fp32": "vision_once_fp32", "vision_batched": "master"}  # else the first of the precision


def baseline_of(name: str) -> str:
    return BASELINES.get(name) or ("before_fp32" if name.endswith("_fp32") else "before")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The largest resident set size seen while the block runs, sampled every 2 ms."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def keep_decoder_layers(learner, n: int) -> None:
    """Run only the first ``n`` decoder layers of the policy and the reference (``--decoder-layers``: a step with one
    layer fewer gives one layer's ops by difference; the others' parameters stay, without gradients)."""
    for m in (learner.module, learner.ref):
        if m is not None:
            lm = m.model.language_model
            lm.layers = lm.layers[:n]
            lm.config.num_hidden_layers = n


def run_profiled(name: str, a) -> dict:
    """One variant counted by torch.profiler (``--counter profiler``): a first step (it compiles what
    ``learner.compile`` compiles), then the counted step."""
    import torch

    from benchmarks.gpu_learner import synthetic_groups
    from benchmarks.op_counts import profiled, record_kernels
    from streamgrpo.config import build_config
    from streamgrpo.learner.trainer import Learner

    record_kernels()
    torch.manual_seed(0)
    learner = Learner(build_config({}, variant_sets(name, a)))
    learner.share_vision_trunk = VARIANTS[name]["share_vision"]
    vision_attention_of(name, learner)
    if a.decoder_layers:
        keep_decoder_layers(learner, a.decoder_layers)
    batch = synthetic_groups(learner.processor, 1, frames=a.frames, size=a.size, G=a.G, completion_len=a.completion_len)
    t0 = time.perf_counter()
    assert learner.train_step(batch) is not None, "step skipped"
    first = time.perf_counter() - t0
    with profiled() as p:
        t0 = time.perf_counter()
        out = learner.train_step(batch)
        wall = time.perf_counter() - t0
    assert out is not None, "step skipped"
    return {"variant": name, "counter": "profiler", "decoder_layers": len(learner.module.model.language_model.layers),
            **p, "first_step_s": first, "step_s": wall, "loss": out.loss}


def vision_attention_of(name: str, learner) -> None:
    """load_model packs the vision attention (one call per block): per chunk, as before it, unless the variant asks."""
    from streamgrpo.models.vision_attention import install

    for m in (learner.module, learner.ref):
        if m is not None:
            install(m, on=VARIANTS[name].get("packed_vision", False))


def variant_sets(name: str, a) -> list[str]:
    return [f"model.name_or_path={a.model_dir}", "learner.device=cpu", "learner.gradient_checkpointing=true",
            "loss.beta=0.04", "learner.groups_per_step=1", f"rollout.num_generations={a.G}",
            f"rollout.max_completion_length={a.completion_len}", "model.tune_mm_vision=false", *VARIANTS[name]["sets"]]


def run_variant(name: str, a) -> dict:
    """One variant in this process (``--proxy-variant``): its counts as a dict."""
    import torch

    from benchmarks.gpu_learner import synthetic_groups
    from benchmarks.op_counts import counting
    from streamgrpo.config import build_config
    from streamgrpo.learner.trainer import Learner

    if getattr(a, "counter", "dispatch") == "profiler":
        return run_profiled(name, a)
    if name.startswith("compiled"):
        raise SystemExit(f"{name}: count it with --counter profiler (under a TorchDispatchMode nothing compiles)")
    v = VARIANTS[name]
    torch.manual_seed(0)
    learner = Learner(build_config({}, variant_sets(name, a)))
    learner.share_vision_trunk = v["share_vision"]
    vision_attention_of(name, learner)
    batch = synthetic_groups(learner.processor, 1, frames=a.frames, size=a.size, G=a.G, completion_len=a.completion_len)
    with PeakRSS() as mem, counting(learner.module, learner.ref) as c:
        t0 = time.perf_counter()
        out = learner.train_step(batch)
        wall = time.perf_counter() - t0
    assert out is not None, "step skipped"
    s = c.summary()
    layers = len(learner.module.model.language_model.layers)
    blocks = len(learner.module.model.visual.blocks)
    vis, dec = s.get("vision", {}), s.get("decoder", {})
    passes = max(vis.get("passes", 0), 1)
    return {
        "variant": name, "total_ops": s["total"]["ops"], "weight_casts": s["total"]["weight_casts"],
        "ops_per_vision_block": vis.get("ops", 0) / blocks, "ops_per_decoder_layer": dec.get("ops", 0) / layers,
        "vision_passes": vis.get("passes", 0), "vision_attention_per_block": vis.get("attention", 0) / blocks,
        "vision_attention_per_block_per_pass": vis.get("attention", 0) / blocks / passes,
        "peak_rss_step_mib": (mem.peak - mem.start) / 2**20, "step_s": wall, "loss": out.loss,
        "counts": s,
    }


def build_model(a) -> None:
    from streamgrpo.models.tiny import build_tiny

    if not (Path(a.model_dir) / "config.json").is_file():
        build_tiny(a.model_dir, size="3b", layers=2, vocab=0)


def _subprocess_variant(name: str, a, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_learner", "--proxy-variant", name, "--model-dir", a.model_dir,
           "--G", str(a.G), "--frames", str(a.frames), "--size", str(a.size),
           "--completion-len", str(a.completion_len), "--counter", a.counter, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode or not line:
        raise RuntimeError(f"variant {name} failed:\n{res.stderr[-3000:]}")
    return json.loads(line[-1])


def _profiled_row(name: str, a) -> dict:
    """A profiler-counted variant: the step with every decoder layer and with one fewer; their difference is one
    decoder layer's ops and kernels a step (forward, recompute, backward)."""
    full = _subprocess_variant(name, a)
    fewer = _subprocess_variant(name, a, "--decoder-layers", str(full["decoder_layers"] - 1))
    for key in ("aten_ops", "kernels", "ops_and_kernels", "launches"):
        full[f"{key}_per_decoder_layer"] = full[key] - fewer[key]
    names = {k: n - fewer["by_name"].get(k, 0) for k, n in full.pop("by_name").items()}
    full["top_per_decoder_layer"] = dict(sorted(((k, n) for k, n in names.items() if n), key=lambda kv: -kv[1])[:25])
    fewer.pop("by_name")
    full["fewer_layers"] = fewer
    print(f"#   {name}: {full['aten_ops']} aten ops + {full['kernels']} compiled kernels a step; one decoder layer: "
          f"{full['aten_ops_per_decoder_layer']} + {full['kernels_per_decoder_layer']} (fwd, recompute, bwd), "
          f"{full['launches_per_decoder_layer']} of them kernel launches; "
          f"step {full['step_s']:.1f} s (first {full['first_step_s']:.1f} s)", flush=True)
    return full


def run_all(a) -> list[dict]:
    """Every variant in a fresh process (so that each peak is its own), in order."""
    build_model(a)
    rows = []
    for name in a.variants.split(","):
        if a.counter == "profiler":
            rows.append(_profiled_row(name, a))
            continue
        rows.append(_subprocess_variant(name, a))
        r = rows[-1]
        print(f"#   {name}: {r['total_ops']} aten ops, {r['ops_per_decoder_layer']:.0f}/decoder layer, "
              f"{r['ops_per_vision_block']:.0f}/vision block, vision passes {r['vision_passes']}, "
              f"attention/block/pass {r['vision_attention_per_block_per_pass']:.1f}, "
              f"weight casts {r['weight_casts']}, step peak +{r['peak_rss_step_mib']:.0f} MiB, {r['step_s']:.1f} s",
              flush=True)
    return rows
