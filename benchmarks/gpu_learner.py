"""The learner at real size: step time, tokens/s, MFU and peak memory per backend and training mode.

Builds (once, into ``--model-dir``) a random-weight Qwen2.5-VL at the real 3B or 7B layer sizes
(``streamgrpo model tiny --size 3b|7b``: Qwen2.5-VL-3B/7B-Instruct's published configs, nothing
downloaded), or the tiny model with ``--size tiny`` (a CPU smoke run in seconds), and loads it as the real
:class:`~streamgrpo.learner.trainer.Learner` once per combination of

* backend: ``torch`` and ``deepspeed`` (built-in ZeRO-2, one rank; left out when DeepSpeed is not importable),
  and on request ``deepspeed_offload`` (the shipped ``zero2_offload``: AdamW's states and the
  float32 master weights on the host, the step fused on its cores);
* mode: ``full`` (decoder + merger train, vision tower frozen: the default), ``full_vision`` (the vision
  tower trains too), ``lora`` (LoRA adapters on the decoder, r=``--lora-r``; everything else frozen),
  ``full_shared`` (``full`` with ``learner.shared_prompt``: each group's prompt through the decoder once),
  ``full_compiled`` (``full`` with ``learner.compile``; with ``deepspeed``: compiled layers under ZeRO-2).

Each trains on synthetic groups: ``--groups`` per step of G=``--G`` completions x ``--completion-len``
tokens sharing one ``--frames``-frame ``--frame-size``² video prompt. After ``--warmup`` steps, ``--steps``
timed steps (median); with ``--profile DIR`` one more step under torch.profiler (its top ops by self time
in ``DIR``, and the aten ops and GPU kernels it issued). Per combination: step seconds, prompt + completion tokens per second, model FLOPs
per step (:mod:`streamgrpo.learner.flops`), MFU against the device's peak (``--peak-tflops`` or the table by the
GPU's name; none on a CPU without it), CUDA peak memory and the learner's static memory plan
(:mod:`streamgrpo.learner.memory.plan`, a lower bound). A combination whose plan alone is over the device's memory is
refused before its model loads and recorded as ``wont_fit`` (7B full training with the torch backend: 16
bytes per trained parameter, ~124 GB); one that runs out of GPU memory anyway is recorded as ``oom``.

Figures: ``step_<backend>_<mode>_s`` against the torch ``full`` step of the same run (ratio = value /
baseline), and ``mfu_<backend>_<mode>`` (no baseline). Prints one line per combination and writes
``benchmarks/results/gpu_learner.json`` (its ``rows``). Without CUDA only ``--size tiny`` runs.

    python -m benchmarks.gpu_learner --size 3b [--model-dir /tmp/qwen25vl-3b] [--groups 1] [--steps 3]
    python -m benchmarks.gpu_learner --size tiny --steps 1 --warmup 0     # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.common import emit, figure, machine_info, write_result

MODES = {
    "full": ["model.tune_mm_vision=false"],
    "full_vision": ["model.tune_mm_vision=true"],
    "lora": ["model.tune_mm_vision=false"],  # the LoRA r is added from --lora-r (to every lora* mode)
    # learner.compile refuses LoRA dropout in recomputed layers: the compile lever measured against lora_nodropout
    "lora_nodropout": ["model.tune_mm_vision=false", "model.lora.dropout=0"],
    "lora_compiled": ["model.tune_mm_vision=false", "model.lora.dropout=0", "learner.compile=true"],
    "full_shared": ["model.tune_mm_vision=false", "learner.shared_prompt=true"],
    # issue 52's levers, one at a time from the learner as it was (full_unshared: the frozen vision tower run by
    # the reference and the policy alike; full: once per micro-batch; full_master: and bf16 parameters with
    # float32 master weights in the optimizer)
    "full_unshared": ["model.tune_mm_vision=false"],
    "full_master": ["model.tune_mm_vision=false", "learner.master_weights=true"],
    "full_shared_master": ["model.tune_mm_vision=false", "learner.shared_prompt=true", "learner.master_weights=true"],
    # learner.compile on top of full_master: each decoder layer compiled by inductor (its warm-up step compiles)
    "full_master_compiled": ["model.tune_mm_vision=false", "learner.master_weights=true", "learner.compile=true"],
    # the vision attention packed into one call per block (sdpa: what flash-attn's varlen call does anyway) vs
    # transformers' call per window (full_master_sdpa_per_chunk)
    "full_master_sdpa": ["model.tune_mm_vision=false", "learner.master_weights=true", "model.attn_implementation=sdpa"],
    "full_master_sdpa_per_chunk": ["model.tune_mm_vision=false", "learner.master_weights=true",
                                   "model.attn_implementation=sdpa"],
    # and learner.checkpoint_matmuls: the recompute keeps the matmul and attention outputs (not in learner3b's
    # default modes: MODES=full_master_compiled,full_master_compiled_matmuls bash benchmarks/gpu_session.sh learner3b)
    "full_master_compiled_matmuls": ["model.tune_mm_vision=false", "learner.master_weights=true",
                                     "learner.compile=true", "learner.checkpoint_matmuls=true"],
    # learner.compile with either backend (DeepSpeed: ZeRO-0/1/2, the reduce hooks run from the compiled layers'
    # backward; DeepSpeed's bf16 mode has bf16 weights and float32 masters already): against full of the backend
    "full_compiled": ["model.tune_mm_vision=false", "learner.compile=true"],
}
LEARNER_ATTRS = {"full_unshared": {"share_vision_trunk": False}}  # set on the Learner after it is built
PER_CHUNK_VISION = {"full_master_sdpa_per_chunk"}  # modes whose vision attention is transformers' per-chunk loop
BACKENDS = {  # name -> learner.backend and its DeepSpeed config (None: the built-in ZeRO-2)
    "torch": ("torch", None),
    "deepspeed": ("deepspeed", None),
    "deepspeed_offload": ("deepspeed", "zero2_offload.json"),  # ZeRO-2, AdamW and master weights on the host
}
DEEPSPEED_DIR = Path(__file__).resolve().parents[1] / "streamgrpo" / "configs" / "deepspeed"


def synthetic_groups(proc, n: int, *, frames: int, size: int, G: int, completion_len: int, seed: int = 0):
    """``n`` Accepted groups: one ``frames`` x ``size``² video prompt each, G completions of random
    non-vision tokens with 0/1 rewards (every group has a gradient)."""
    import numpy as np

    from streamgrpo.data.prompts import processor_inputs
    from streamgrpo.learner.trainer import Accepted
    from streamgrpo.models.batching import vision_token_ids
    from streamgrpo.wire import Completion, ScoredGroup, Visual

    rng = np.random.default_rng(seed)
    banned = set(vision_token_ids(proc))
    allowed = np.array([t for t in range(len(proc.tokenizer)) if t not in banned], dtype=np.int32)
    out = []
    for i in range(n):
        video = rng.integers(0, 255, (frames, size, size, 3), dtype=np.uint8)
        visual = Visual("video", video, fps=2.0, frame_indices=np.arange(frames, dtype=np.int32))
        msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way does it move?"}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        inputs = processor_inputs(proc, text, [visual])
        comps = [Completion(rng.choice(allowed, completion_len), np.full(completion_len, -1.0, np.float32),
                            "x", "length", {"r": float(k % 2)}, float(k % 2)) for k in range(G)]
        g = ScoredGroup(f"p{i}", "g0", 0, "m", np.asarray(inputs["input_ids"]).reshape(-1).astype(np.int32),
                        [visual], "A", comps, prompt_text=text, meta={"temperature": 1.0})
        out.append(Accepted(f"{i}-0", g, inputs, 0))
    return out


def combo_sets(a, backend: str, mode: str, cuda: bool) -> list[str]:
    """The config overrides of one combination (pure)."""
    sets = [f"model.name_or_path={a.model_dir}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
            f"learner.bf16={str(a.bf16).lower()}", f"learner.device={'cuda' if cuda else 'cpu'}",
            f"learner.gradient_checkpointing={str(a.gradient_checkpointing).lower()}",
            *([f"learner.checkpoint_every={a.checkpoint_every}",
               f"learner.checkpoint_offload={str(a.checkpoint_offload).lower()}"] if a.gradient_checkpointing else []),
            f"learner.backend={BACKENDS[backend][0]}",
            f"loss.beta={a.beta}", f"learner.groups_per_step={a.groups}", f"rollout.num_generations={a.G}",
            f"rollout.max_completion_length={a.completion_len}",
            # the memory plan sizes a prompt from the data limits: those of the synthetic video measured
            "data.min_frames=1", f"data.max_frames={a.frames}", "data.min_pixels=784",
            f"data.max_pixels={a.frame_size ** 2}", f"data.total_pixels={a.frames * a.frame_size ** 2}", *MODES[mode]]
    if BACKENDS[backend][1]:
        sets.append(f"learner.deepspeed_config={DEEPSPEED_DIR / BACKENDS[backend][1]}")
    if mode.startswith("lora"):
        sets.append(f"model.lora.r={a.lora_r}")
    if a.peak_tflops:
        sets.append(f"learner.peak_tflops={a.peak_tflops}")
    return sets + list(a.set)


def profile_step(learner, batch, cuda: bool, path: Path) -> dict:
    """One more step under torch.profiler: the top ops by self time go to ``path`` (a text table); returns
    how many aten ops the CPU issued and how many kernels ran on the GPU in that step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        learner.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
    avg = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(avg.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=30))
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"aten_ops": sum(e.count for e in avg if e.key.startswith("aten::")), "gpu_kernels": kernels if cuda else None}


def measure(a, backend: str, mode: str, cuda: bool) -> dict:
    """One combination: a fresh Learner, warm-up steps, timed steps. Returns its row."""
    import torch

    from streamgrpo.config import build_config
    from streamgrpo.learner.memory.plan import GiB, MemoryPlanError
    from streamgrpo.learner.trainer import Learner

    row: dict = {"backend": backend, "mode": mode}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    learner = None
    try:
        learner = Learner(build_config({}, combo_sets(a, backend, mode, cuda)))
        for key, value in LEARNER_ATTRS.get(mode, {}).items():
            setattr(learner, key, value)
        if mode in PER_CHUNK_VISION:
            from streamgrpo.models.vision_attention import install

            for m in (learner.module, learner.ref):
                if m is not None:
                    install(m, on=False)
        batch = synthetic_groups(learner.processor, a.groups, frames=a.frames, size=a.frame_size, G=a.G,
                                 completion_len=a.completion_len)
        times, out = [], None
        for i in range(a.warmup + a.steps):
            sync()
            t0 = time.perf_counter()
            out = learner.train_step(batch)
            sync()
            if out is None:
                raise RuntimeError("step skipped (non-finite loss)")
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        peak = learner.work.peak_flops
        row.update(status="ok", step_s=step_s, steps_s=times, seq_tokens=out.seq_tokens, flops=out.flops,
                   tokens_per_s=out.seq_tokens / step_s, peak_flops=peak,
                   mfu=out.flops / (step_s * peak) if peak else None, params=learner.total, trainable=learner.trainable,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                   plan_gib=learner.memory.device_bytes / GiB, plan_host_gib=learner.memory.host_bytes / GiB,
                   static_gib=learner.memory.static_bytes / GiB,
                   static_host_gib=sum(learner.memory.host.values()) / GiB)
        if a.profile:
            row["profile"] = profile_step(learner, batch, cuda, Path(a.profile) / f"{backend}_{mode}.txt")
    except MemoryPlanError as exc:  # refused before loading: the static memory alone is over the device's
        row.update(status="wont_fit", error=str(exc))
    except torch.cuda.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - one combination failing (a compiler error, say) is its row's answer
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        row.update(status="error", error=f"{type(exc).__name__}: {' | '.join(lines[:2])[:400]}")
        traceback.print_exc()  # the whole story on stderr (the log); the row keeps its first lines
    finally:
        del learner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def fmt_row(r: dict) -> str:
    if r.get("status") != "ok":
        return f"# {r['backend']:9s} {r['mode']:11s} {r.get('status')}: {r.get('error', '')}"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    mem = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB"
    host = f" + host {r['plan_host_gib']:.3g}" if r.get("plan_host_gib") else ""
    prof = r.get("profile")
    ops = f"  {prof['aten_ops']} aten ops" + (f", {prof['gpu_kernels']} kernels" if prof["gpu_kernels"] else "") \
        if prof else ""
    return (f"# {r['backend']:9s} {r['mode']:11s} step {r['step_s']:.3f}s  {r['tokens_per_s']:.0f} tok/s{ops}  "
            f"{r['flops']:.3e} FLOP/step  MFU {mfu}  peak {mem} (static plan {r['plan_gib']:.3g} GiB{host})  "
            f"({r['trainable'] / 1e9:.3f}B of {r['params'] / 1e9:.3f}B trainable)")


def figures(rows: list[dict]) -> list[dict]:
    """Step time against the torch ``full`` row, and MFU, per measured combination (pure)."""
    base = next((r["step_s"] for r in rows if (r["backend"], r["mode"], r.get("status")) == ("torch", "full", "ok")),
                None)
    out = []
    for r in rows:
        ok = r.get("status") == "ok"
        name = f"{r['backend']}_{r['mode']}"
        out.append(figure(f"step_{name}_s", r["step_s"] if ok else None, base, unit="s",
                          note="baseline: torch backend, full (vision frozen)"))
        out.append(figure(f"mfu_{name}", r.get("mfu") if ok else None, None, unit="ratio"))
    return out


def deepspeed_importable() -> bool:
    try:
        from streamgrpo.learner.deepspeed_setup import import_deepspeed

        import_deepspeed()
    except Exception:  # noqa: BLE001 - any import failure means: measure torch only
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_learner", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="3b", choices=["tiny", "3b", "7b"])
    p.add_argument("--model-dir", default=None, help="built once if missing (default: /tmp/streamgrpo-qwen25vl-<size>)")
    p.add_argument("--backends", default="torch,deepspeed", help=f"of {', '.join(BACKENDS)}")
    p.add_argument("--modes", default="full,full_vision,lora,full_shared",
                   help=f"of {', '.join(MODES)} (the *_master modes: torch backend, bf16 only)")
    p.add_argument("--groups", type=int, default=1, help="groups per step")
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--frame-size", type=int, default=448)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--peak-tflops", type=float, default=None, help="peak of the device (default: by its name)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 learner (default: bf16 on CUDA)")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    p.add_argument("--checkpoint-every", type=int, default=1, help="recompute every n-th layer only "
                   "(learner.checkpoint_every)")
    p.add_argument("--checkpoint-offload", action="store_true", help="checkpointed inputs in pinned host memory "
                   "(learner.checkpoint_offload, CUDA)")
    p.add_argument("--set", action="append", default=[], help="extra config override section.key=value")
    p.add_argument("--profile", default=None, metavar="DIR", help="after the timed steps, profile one more step "
                   "per combination: DIR/<backend>_<mode>.txt (top ops by self time), aten ops and GPU kernels counted")
    p.add_argument("--out", default=None, help="result json (default benchmarks/results/gpu_learner.json)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and a.size != "tiny":
        print(f"# gpu_learner: no CUDA device here: nothing measured at size {a.size} (--size tiny runs on a CPU)")
        return 0
    if not cuda:
        a.bf16 = a.gradient_checkpointing = False  # the CPU smoke run: plain fp32
    from streamgrpo.models.tiny import build_tiny

    tmp = tempfile.TemporaryDirectory(prefix="sg-gpu-learner-") if a.model_dir is None and a.size == "tiny" else None
    a.model_dir = a.model_dir or (tmp.name if tmp else f"/tmp/streamgrpo-qwen25vl-{a.size}")
    if not (Path(a.model_dir) / "config.json").exists():
        t0 = time.perf_counter()
        build_tiny(a.model_dir, size=a.size)
        print(f"# built random {a.size} model in {time.perf_counter() - t0:.1f}s", flush=True)
    backends = [b for b in a.backends.split(",") if b]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        p.error(f"--backends: unknown {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
    uses_ds = [b for b in backends if BACKENDS[b][0] == "deepspeed"]
    if uses_ds and not deepspeed_importable():
        print("# deepspeed is not importable: torch backend only", flush=True)
        backends = [b for b in backends if b not in uses_ds]
    elif uses_ds:
        from streamgrpo.learner.distributed import init_distributed

        init_distributed("deepspeed")  # one rank; its device and backend by learner.dist_backend=auto
    rows = []
    for backend in backends:
        for mode in [m for m in a.modes.split(",") if m]:
            rows.append(measure(a, backend, mode, cuda))
            print(fmt_row(rows[-1]), flush=True)
    figs = [emit(f) for f in figures(rows)]
    info = machine_info(("torch", "transformers", "deepspeed", "peft"), device="cuda" if cuda else "cpu")
    write_result("gpu_learner", figs, info, args=vars(a), data={"rows": rows}, out=a.out)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
