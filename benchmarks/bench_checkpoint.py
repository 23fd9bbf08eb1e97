"""Checkpoint stall: how long a checkpoint keeps the learner from training, asynchronous vs synchronous.

A torch-backend :class:`~streamgrpo.learner.trainer.Learner` on the CPU at Qwen2.5-VL-3B's layer shapes
with ``--layers`` (2) decoder layers and vision blocks (``streamgrpo model tiny --size 3b``;
``--vocab`` embedding rows, default the real 151,936), vision frozen, full weights otherwise, trains
synthetic video groups (``benchmarks.gpu_learner.synthetic_groups``). In the same process:

* ``step_s``: the median step without checkpoints;
* synchronous (the baseline): ``Learner.save`` after a step, every file fsynced and renamed: the
  stall is the whole write;
* asynchronous (``learner.async_checkpoint``): ``Learner.snapshot`` (host copies) and a background
  ``write_snapshot`` (the same files, fsynced and renamed) while the next steps train; the stall is
  the copy plus what the steps that overlap the write lose to it (their time above ``step_s``).

Figures: ``checkpoint_stall_s`` (async vs sync; ratio = sync / async, the reduction) and
``checkpoint_stall_steps`` (the stall in steps; the target is at most 1). Medians over
``--checkpoints``. Writes ``benchmarks/results/bench_checkpoint.json`` with machine info.

``--ranks N`` (N > 1): the same on N DeepSpeed ZeRO-2 ranks (gloo, CPU; the script relaunches itself under
``torch.distributed.run``): synchronous ``Learner.save`` on every rank against each rank's ``snapshot`` and
background ``write_snapshot``, the ranks agreeing at each step boundary (one all-reduce) and rank 0 renaming
(``finalise_write``) once every rank has written; the stall is the slowest rank's copy plus what its
overlapping steps lose plus the rename. Writes ``bench_checkpoint_ranks.json``.

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.bench_checkpoint [--layers 2] [--vocab 151936] [--checkpoints 3]
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_checkpoint --ranks 2 --vocab 32000
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import emit, figure, machine_info, write_result


def _learner(model_dir: Path, a, dist=None, *more: str):
    from streamgrpo.config import build_config
    from streamgrpo.learner.trainer import Learner

    sets = [f"model.name_or_path={model_dir}", "model.dtype=float32", "learner.device=cpu", "learner.bf16=false",
            "loss.beta=0", "model.tune_mm_vision=false", "learner.groups_per_step=1",
            f"rollout.num_generations={a.G}", f"rollout.max_completion_length={a.completion_len}",
            "learner.save_total_limit=1", "learner.gradient_checkpointing=true", *more]
    return Learner(build_config({}, sets), dist=dist) if dist is not None else Learner(build_config({}, sets))


def _step(learner, batch) -> float:
    t0 = time.perf_counter()
    if learner.train_step(batch) is None:
        raise RuntimeError("step skipped (non-finite loss)")
    learner.state.step += 1
    return time.perf_counter() - t0


def measure(a, model_dir: Path, root: Path) -> dict:
    from benchmarks.gpu_learner import synthetic_groups
    from streamgrpo.learner.checkpoint.background import BackgroundWrite

    learner = _learner(model_dir, a)
    batch = synthetic_groups(learner.processor, 1, frames=a.frames, size=a.frame_size, G=a.G,
                             completion_len=a.completion_len)
    _step(learner, batch)  # warm-up
    clean = [_step(learner, batch) for _ in range(a.steps)]
    step_s = statistics.median(clean)
    sync, copy_s, overlap, write_s, during = [], [], [], [], []
    for _ in range(a.checkpoints):
        _step(learner, batch)
        t0 = time.perf_counter()
        learner.save(root / "sync")
        sync.append(time.perf_counter() - t0)
    for _ in range(a.checkpoints):
        _step(learner, batch)
        t0 = time.perf_counter()
        snap = learner.snapshot()
        step = learner.state.step
        write = BackgroundWrite(step, lambda snap=snap: learner.write_snapshot(root / "async", snap))
        t1 = time.perf_counter()
        copy_s.append(t1 - t0)
        steps = []
        while not write.done:  # training goes on meanwhile
            steps.append(_step(learner, batch))
        write.result()
        write_s.append(time.perf_counter() - t1)
        during.append(len(steps))
        overlap.append(max(0.0, sum(steps) - step_s * len(steps)))
        del snap
        gc.collect()
    stall_async = [c + o for c, o in zip(copy_s, overlap)]
    return {"params": learner.total, "trainable": learner.trainable, "step_s": step_s, "clean_steps_s": clean,
            "sync_stall_s": sync, "async_copy_s": copy_s, "async_overlap_loss_s": overlap,
            "async_write_s": write_s, "steps_during_write": during, "async_stall_s": stall_async,
            "checkpoint_bytes": sum(f.stat().st_size for f in (root / "sync").rglob("*") if f.is_file())}


def measure_ranks(a, model_dir: Path, root: Path) -> dict:
    """Every rank (under torchrun): the synchronous and the asynchronous stall of a ZeRO-2 learner, per rank; the
    figures are the slowest rank's (every rank waits for it at the next collective)."""
    from benchmarks.gpu_learner import synthetic_groups
    from streamgrpo.learner.checkpoint.background import FAILED, WRITTEN, BackgroundWrite, agree
    from streamgrpo.learner.distributed import barrier, init_distributed, share

    dist = init_distributed("deepspeed", dist_backend="gloo")
    learner = _learner(model_dir, a, dist, "learner.backend=deepspeed", "learner.deepspeed_config=zero2",
                       f"learner.groups_per_step={dist.world_size}")
    batch = synthetic_groups(learner.processor, 1, frames=a.frames, size=a.frame_size, G=a.G,
                             completion_len=a.completion_len)

    def slowest(x: float) -> float:
        return float(share(dist, [x]).max())

    _step(learner, batch)  # warm-up
    step_s = statistics.median([slowest(_step(learner, batch)) for _ in range(a.steps)])
    sync, stall, copy_s, rename_s, during = [], [], [], [], []
    for _ in range(a.checkpoints):
        _step(learner, batch)
        barrier(dist)
        t0 = time.perf_counter()
        learner.save(root / "sync")
        sync.append(slowest(time.perf_counter() - t0))
    for _ in range(a.checkpoints):
        _step(learner, batch)
        barrier(dist)
        t0 = time.perf_counter()
        snap = learner.snapshot(root / "async")
        step = learner.state.step
        write = BackgroundWrite(step, lambda snap=snap: learner.write_snapshot(root / "async", snap))
        copied = time.perf_counter() - t0
        lost, n = 0.0, 0
        while True:  # training goes on; the ranks agree at each step boundary, as Checkpointing.poll does
            lost += max(0.0, _step(learner, batch) - step_s)
            n += 1
            verdict = agree([int(v) for v in share(dist, [write.status])[:, 0]])
            if verdict == FAILED:
                write.result()
            if verdict == WRITTEN:
                break
        t1 = time.perf_counter()
        learner.finalise_write(root / "async", step)
        renamed = slowest(time.perf_counter() - t1)
        copy_s.append(slowest(copied))
        rename_s.append(renamed)
        during.append(n)
        stall.append(slowest(copied + lost) + renamed)
        del snap
        gc.collect()
    return {"ranks": dist.world_size, "is_main": dist.is_main, "params": learner.total, "step_s": step_s,
            "sync_stall_s": sync, "async_copy_s": copy_s, "async_rename_s": rename_s, "steps_during_write": during,
            "async_stall_s": stall,
            "checkpoint_bytes": sum(f.stat().st_size for f in (root / "sync").rglob("*") if f.is_file())}


def _relaunch(a, work: Path, model_dir: Path) -> None:
    """Run this benchmark on ``--ranks`` processes (torch.distributed.run), each given the model built here."""
    import os
    import subprocess
    import sys

    from streamgrpo.runtime.processes import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.ranks), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "-m", "benchmarks.bench_checkpoint", *sys.argv[1:],
           "--model-dir", str(model_dir), "--dir", str(work)]
    subprocess.run(cmd, check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})


def _stall_figures(r: dict, note: str) -> list:
    """The stall per checkpoint (seconds; in median steps) against the synchronous write's, printed."""
    sync, stall = statistics.median(r["sync_stall_s"]), statistics.median(r["async_stall_s"])
    return [
        emit(figure("checkpoint_stall_s", stall, sync, sync / stall if stall else None, unit="s", note=note)),
        emit(figure("checkpoint_stall_steps", stall / r["step_s"], sync / r["step_s"], unit="steps",
                    note="the stall in median steps (target <= 1); baseline = the synchronous write")),
    ]


def _report_ranks(a, r: dict) -> None:
    figures = _stall_figures(r, f"{r['ranks']} ZeRO-2 ranks; ratio = sync / async; async = slowest rank's copy + "
                                "what its overlapping steps lose + rank 0's rename")
    print(f"#   {r['ranks']} ranks, {r['params'] / 1e6:.0f}M parameters, checkpoint "
          f"{r['checkpoint_bytes'] / 2**30:.2f} GiB, step {r['step_s']:.2f}s, host copy "
          f"{statistics.median(r['async_copy_s']):.2f}s, rename {statistics.median(r['async_rename_s']):.3f}s, "
          f"written over {r['steps_during_write']} step(s)")
    write_result("bench_checkpoint_ranks", figures, machine_info(), vars(a), r, a.out)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_checkpoint", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="3b", choices=["tiny", "3b", "7b"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=None, help="embedding rows (default: the size's own)")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--frame-size", type=int, default=112)
    ap.add_argument("--steps", type=int, default=3, help="timed steps without checkpoints")
    ap.add_argument("--checkpoints", type=int, default=3, help="checkpoints of each kind")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--out", default=None, help="result json (default benchmarks/results/bench_checkpoint.json)")
    ap.add_argument("--ranks", type=int, default=1, help="DeepSpeed ZeRO-2 ranks (more than 1: under torchrun)")
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)  # the ranks' model, built by the launcher
    a = ap.parse_args()
    from streamgrpo.models.tiny import build_tiny

    if a.model_dir is not None:  # one rank of --ranks
        r = measure_ranks(a, Path(a.model_dir), Path(a.dir) / "checkpoints")
        if r["is_main"]:
            _report_ranks(a, r)
        return
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench_checkpoint-"))
    if a.ranks > 1:
        try:
            _relaunch(a, work, build_tiny(work / "model", size=a.size, layers=a.layers, vocab=a.vocab))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        model_dir = build_tiny(work / "model", size=a.size, layers=a.layers, vocab=a.vocab)
        r = measure(a, model_dir, work / "checkpoints")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = _stall_figures(r, "ratio = sync / async (the reduction); async = host copy + what overlapping steps lose")
    print(f"#   {r['params'] / 1e6:.0f}M parameters ({r['trainable'] / 1e6:.0f}M trained), checkpoint "
          f"{r['checkpoint_bytes'] / 2**30:.2f} GiB, step {r['step_s']:.2f}s, host copy "
          f"{statistics.median(r['async_copy_s']):.2f}s, background write {statistics.median(r['async_write_s']):.2f}s "
          f"over {r['steps_during_write']} step(s)")
    write_result("bench_checkpoint", figures, machine_info(), vars(a), r, a.out)


if __name__ == "__main__":
    main()
