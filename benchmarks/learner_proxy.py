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
* ``vision_batched`` (on ``master``; ``vision_batched_fp32`` on ``vision_once_fp32``, each its baseline): the
  vision attention's windows in one packed call per block (:mod:`streamgrpo.models.vision_attention`); the
  other variants run transformers' per-chunk vision attention, as before it.

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
    "vision_batched_fp32": dict(share_vision=True, sets=FP32, packed_vision=True),
    "vision_batched": dict(share_vision=True, sets=[*BF16, "learner.master_weights=true"], packed_vision=True),
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


def run_variant(name: str, a) -> dict:
    """One variant in this process (``--proxy-variant``): its counts as a dict."""
    import torch

    from benchmarks.gpu_learner import synthetic_groups
    from benchmarks.op_counts import counting
    from streamgrpo.config import build_config
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.models.vision_attention import install as install_packed_vision_attention

    v = VARIANTS[name]
    sets = [f"model.name_or_path={a.model_dir}", "learner.device=cpu", "learner.gradient_checkpointing=true", "loss.beta=0.04", "learner.groups_per_step=1",
            f"rollout.num_generations={a.G}", f"rollout.max_completion_length={a.completion_len}",
            "model.tune_mm_vision=false", *v["sets"]]
    torch.manual_seed(0)
    learner = Learner(build_config({}, sets))
    learner.share_vision_trunk = v["share_vision"]
    for m in (learner.module, learner.ref):  # load_model packs the vision attention: per chunk unless asked
        if m is not None:
            install_packed_vision_attention(m, on=v.get("packed_vision", False))
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


def run_all(a) -> list[dict]:
    """Every variant in a fresh process (so that each peak is its own), in order."""
    build_model(a)
    rows = []
    for name in a.variants.split(","):
        cmd = [sys.executable, "-m", "benchmarks.bench_learner", "--proxy-variant", name, "--model-dir", a.model_dir,
               "--G", str(a.G), "--frames", str(a.frames), "--size", str(a.size),
               "--completion-len", str(a.completion_len)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if res.returncode or not line:
            raise RuntimeError(f"variant {name} failed:\n{res.stderr[-3000:]}")
        rows.append(json.loads(line[-1]))
        r = rows[-1]
        print(f"#   {name}: {r['total_ops']} aten ops, {r['ops_per_decoder_layer']:.0f}/decoder layer, "
              f"{r['ops_per_vision_block']:.0f}/vision block, vision passes {r['vision_passes']}, "
              f"attention/block/pass {r['vision_attention_per_block_per_pass']:.1f}, "
              f"weight casts {r['weight_casts']}, step peak +{r['peak_rss_step_mib']:.0f} MiB, {r['step_s']:.1f} s",
              flush=True)
    return rows
