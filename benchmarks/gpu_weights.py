"""Weight sync at real size on a GPU: a learner step + publish cycle, and a same-host generator applying it.

Builds (once, into ``--model-dir``) a random-weight Qwen2.5-VL at the real 3B or 7B layer sizes
(``streamgrpo model tiny --size 3b``), loads it as the real :class:`~streamgrpo.learner.trainer.Learner`
(fp32 master weights, bf16 autocast, gradient checkpointing, frozen vision tower) and trains on
synthetic groups: ``--groups`` per step of G=8 completions x ``--completion-len`` tokens sharing one
``--frames``-frame 448x448 video prompt (2048 video tokens at 16 frames). Then:

* ``step_s``: a training step alone (median of ``--steps``).
* ``cycle_stall_s``: learner-visible cost of publishing a version: median of (``learner.publish`` +
  the step that runs behind its device->host copies) - median of a plain step, in interleaved pairs
  (so drifting step times hit both). Goal: <= 0.3 of ``step_s``. The loop before it publishes after
  every step, which is what the latency below is measured on.
* ``publish_call_s``: how long ``learner.publish`` blocks the Python thread.
* ``export_gpu_s``: ``learner.publish`` followed by a CUDA synchronise: the whole cast + device->host
  copy of a version (an upper bound of the stall).
* ``export_fp32_pageable_s`` (baseline): ``learner.policy_tensors()``, the fp32 pageable-memory export
  the learner used to publish (and still uses for checkpoints).
* ``sync_to_applied_<transport>_s``: a generator process on this host (the model in bf16 on the
  same GPU) receives every version over TCP loopback or ``ipc://`` and applies it in place;
  publish-to-applied latency per version (median). Goal: <= ``step_s``.

Prints ``name: value (baseline: value, ratio: x)`` lines, writes ``benchmarks/results/gpu_weights.json``.
Needs CUDA (says so and exits 0 without it).

    python -m benchmarks.gpu_weights --model-dir /tmp/qwen25vl-3b [--size 3b] [--steps 4] [--transports tcp,ipc]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import child_pythonpath, emit, figure, machine_info, module_argv, write_result

WAIT_S = 600.0
"""The longest any wait of this benchmark lasts (the generator for a version, the driver for the generator)."""


def _groups(proc, a, n: int, seed: int = 0):
    """``n`` Accepted groups: one video prompt, G completions of random non-vision tokens, 0/1 rewards."""
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
        frames = rng.integers(0, 255, (a.frames, 448, 448, 3), dtype=np.uint8)
        visual = Visual("video", frames, fps=2.0, frame_indices=np.arange(a.frames, dtype=np.int32))
        msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way does it move?"}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        inputs = processor_inputs(proc, text, [visual])
        comps = [Completion(rng.choice(allowed, a.completion_len), np.full(a.completion_len, -1.0, np.float32),
                            "x", "length", {"r": float(k % 2)}, float(k % 2)) for k in range(8)]
        g = ScoredGroup(f"p{i}", "g0", 0, "m", np.asarray(inputs["input_ids"]).reshape(-1).astype(np.int32), [visual],
                        "A", comps, prompt_text=text, meta={"temperature": 1.0})
        out.append(Accepted(f"{i}-0", g, inputs, 0))
    return out


def _sub(a) -> None:
    """Generator role: the model in bf16 on this GPU; apply every version in place, report latencies."""
    import torch
    from transformers import AutoModelForImageTextToText

    from streamgrpo.models.apply import apply_to_model
    from streamgrpo.transport.weights.subscriber import WeightSubscriber

    cuda = torch.cuda.is_available()
    model = AutoModelForImageTextToText.from_pretrained(a.model_dir, dtype=torch.bfloat16)
    model = model.to("cuda" if cuda else "cpu").eval()
    sub = WeightSubscriber("127.0.0.1", a.port, a.snap, pin_memory=cuda, ipc_dir=a.ipc_dir or None)
    print(json.dumps({"event": "ready"}), flush=True)
    last = time.monotonic()
    while True:
        got = sub.poll(120.0)
        if got is None:
            if time.monotonic() - last > WAIT_S:
                sys.exit(f"gpu_weights generator: no weight version for {WAIT_S:.0f}s; giving up")
            continue
        last = time.monotonic()
        received = time.time()
        version, tensors = got
        apply_to_model(model, tensors)  # pinned -> device, asynchronous copies, one synchronise
        applied = time.time()
        sub.mark_applied()
        print(json.dumps({"event": "applied", "version": version, "published_at": sub.published_at,
                          "received": received, "applied": applied, "stats": sub.stats}), flush=True)
        if version >= a.last:
            break
    sub.close()


def _spawn(a, port: int, snap: int, ipc_dir: str, last: int):
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    args = module_argv("gpu_weights", "--role", "sub", "--model-dir", a.model_dir, "--port", str(port), "--snap",
                       str(snap), "--last", str(last), *(["--ipc-dir", ipc_dir] if ipc_dir else []))
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    child.lines = queue.Queue()  # its JSON lines, then None at its end (read by a thread: waits can time out)

    def pump() -> None:
        for line in child.stdout:
            if line.startswith("{"):
                child.lines.put(json.loads(line))
        child.lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return child


def _read(child, want: str, timeout_s: float | None = None) -> dict:
    """The generator process's next ``want`` message; a clear error when it ends or stays silent too long."""
    timeout_s = WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            msg = child.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise RuntimeError(f"no '{want}' from the generator process in {timeout_s:.0f}s (rc {child.poll()})") from None
        if msg is None:
            raise RuntimeError(f"generator process ended (rc {child.wait()}) before '{want}'")
        if msg["event"] == want:
            return msg


def run(a) -> dict:
    import torch

    from streamgrpo.config import build_config
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.models.tiny import build_tiny
    from streamgrpo.transport.weights.publisher import WeightPublisher

    cuda = torch.cuda.is_available()
    if not (Path(a.model_dir) / "config.json").exists():
        t0 = time.perf_counter()
        build_tiny(a.model_dir, size=a.size if cuda else "tiny")
        print(f"# built random {a.size} model in {time.perf_counter() - t0:.1f}s", flush=True)
    cfg = build_config({}, [f"model.name_or_path={a.model_dir}", "model.dtype=bfloat16", "learner.bf16=true",
                            f"learner.device={'cuda' if cuda else 'cpu'}", "learner.gradient_checkpointing=true", "model.tune_mm_vision=false",
                            f"loss.beta={a.beta}", f"learner.groups_per_step={a.groups}",
                            f"rollout.max_completion_length={a.completion_len}", "rollout.num_generations=8"])
    t0 = time.perf_counter()
    learner = Learner(cfg)
    print(f"# learner loaded in {time.perf_counter() - t0:.1f}s: {learner.total / 1e9:.3f}B parameters, "
          f"{learner.trainable / 1e9:.3f}B trainable", flush=True)
    batch = _groups(learner.processor, a, a.groups)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        out = learner.train_step(batch)
        assert out is not None, "step skipped (non-finite loss)"
        learner.state.version += 1

    for _ in range(2):
        step()
    sync()
    step_times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        sync()
        step_times.append(time.perf_counter() - t0)
    step_s = statistics.median(step_times)
    res: dict = {"step_s": step_times, "params": learner.total, "trainable": learner.trainable,
                 "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}

    t0 = time.perf_counter()
    old = learner.policy_tensors()
    res["export_fp32_pageable_s"] = time.perf_counter() - t0
    res["export_fp32_bytes"] = sum(t.numel() * t.element_size() for t in old.values())
    del old

    tmp = tempfile.mkdtemp(prefix="sg-ipc-")
    pub = WeightPublisher("127.0.0.1", 0, 0, chunk_mib=a.chunk_mib, ipc_dir=tmp, io_threads=a.io_threads)
    transports = [t for t in a.transports.split(",") if t]
    n_cycles = a.steps
    per_transport = 2 + 2 * n_cycles  # a warm-up version, one export-only version, one per step, one per pair
    res["transports"] = {}
    version = learner.state.version
    for transport in transports:
        last = version + per_transport
        child = _spawn(a, pub.pub_port, pub.snapshot_port, tmp if transport == "ipc" else "", last)
        _read(child, "ready")
        learner.publish(pub, version + 1)  # warm-up: pinned buffers on both sides
        first = _read(child, "applied")
        # export alone: publish, then wait for every device->host copy
        sync()
        t0 = time.perf_counter()
        learner.publish(pub, version + 2)
        call = time.perf_counter() - t0
        sync()
        export_s = time.perf_counter() - t0
        applied = [_read(child, "applied")]
        # steady state: publish after every step; the next step runs behind the copies
        calls = [call]
        sync()
        t0 = time.perf_counter()
        for k in range(n_cycles):
            step()
            t1 = time.perf_counter()
            learner.publish(pub, version + 3 + k)
            calls.append(time.perf_counter() - t1)
        step()
        sync()
        stall_loop = (time.perf_counter() - t0 - (n_cycles + 1) * step_s) / n_cycles
        while applied[-1]["version"] < last - n_cycles:  # versions overtaken in flight are skipped by the subscriber
            applied.append(_read(child, "applied"))
        # the stall, paired: a plain step, then (publish + the step behind its copies), medians of each
        plain, behind = [], []
        for k in range(n_cycles):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            learner.publish(pub, last - n_cycles + 1 + k)
            step()
            sync()
            behind.append(time.perf_counter() - t0)
        stall = statistics.median(behind) - statistics.median(plain)
        while applied[-1]["version"] < last:
            applied.append(_read(child, "applied"))
        child.wait(60)
        lat = [m["applied"] - m["published_at"] for m in applied]
        res["transports"][transport] = {
            "stall_s": stall, "stall_every_step_s": stall_loop, "plain_step_s": plain, "publish_and_step_s": behind,
            "publish_call_s": calls, "export_gpu_s": export_s, "applied_latency_s": lat,
            "apply_s": [m["applied"] - m["received"] for m in applied], "first": first, "stats": applied[-1]["stats"],
        }
        version = last
    pub.close()
    res["payload_bytes"] = sum(p.numel() for p in learner.module.parameters() if p.requires_grad) * 2
    res["step_s_median"] = step_s
    return res


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_weights", description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["main", "sub"], default="main")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "streamgrpo-qwen25vl-3b"))
    ap.add_argument("--size", choices=["3b", "7b"], default="3b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--completion-len", type=int, default=256)
    ap.add_argument("--beta", type=float, default=0.0, help="0: no reference model (room for the generator's copy)")
    ap.add_argument("--chunk-mib", type=float, default=8.0)
    ap.add_argument("--io-threads", type=int, default=1)
    ap.add_argument("--transports", default="tcp,ipc")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="run the whole script on CPU with the tiny model (a check)")
    ap.add_argument("--port", type=int)
    ap.add_argument("--snap", type=int)
    ap.add_argument("--last", type=int)
    ap.add_argument("--ipc-dir", default="")
    a = ap.parse_args()
    if a.role == "sub":
        _sub(a)
        return 0
    import torch

    if not torch.cuda.is_available() and not a.cpu_smoke:
        print("gpu_weights: no CUDA device here; nothing measured")
        return 0
    res = run(a)
    step_s = res["step_s_median"]
    figures = [emit(figure("step_s", step_s, None, unit="s", note=f"{res['params'] / 1e9:.3f}B params, "
                                                                   f"peak {res['peak_gib']:.1f} GiB"))]
    for transport, r in res["transports"].items():
        stall = max(0.0, r["stall_s"])
        figures.append(emit(figure(f"cycle_stall_{transport}_s", stall, step_s, unit="s",
                                   note="publish + step minus a plain step (paired medians); baseline: the step. "
                                        "Goal: ratio <= 0.3")))
        figures.append(emit(figure(f"publish_call_{transport}_s", statistics.median(r["publish_call_s"]), step_s,
                                   unit="s", note="Python-thread block of learner.publish; baseline: the step")))
        figures.append(emit(figure(f"export_gpu_{transport}_s", r["export_gpu_s"], res["export_fp32_pageable_s"],
                                   res["export_fp32_pageable_s"] / max(r["export_gpu_s"], 1e-9), unit="s",
                                   note="ratio: speed-up; ""cast + device->host copy of a version; baseline: fp32 pageable "
                                                  "export (the old publish path)")))
        figures.append(emit(figure(f"sync_to_applied_{transport}_s", statistics.median(r["applied_latency_s"]), step_s,
                                   unit="s", note="publish -> applied on a same-host generator; baseline: the step. "
                                                  "Goal: ratio <= 1")))
    print(f"# payload {res['payload_bytes'] / 1e9:.2f} GB bf16 (trainable parameters); "
          f"fp32 pageable export {res['export_fp32_bytes'] / 1e9:.2f} GB in {res['export_fp32_pageable_s']:.2f}s")
    info = machine_info(packages=("torch", "transformers", "pyzmq"),
                        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    write_result("gpu_weights", figures, info, {k: v for k, v in vars(a).items() if k not in ("port", "snap", "last")},
                 res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
