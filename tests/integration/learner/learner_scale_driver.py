"""Run under torchrun by test_learner_scale.py: DeepSpeed learner ranks, a resume, then a replay.

1. ``run_learner`` for ``--first`` steps (every rank consumes from the Redis stream), checkpoint;
2. ``run_learner`` again with ``learner.resume`` up to ``--total`` steps (the checkpoint is loaded);
3. replay: a fresh Learner trains, uninterrupted, on exactly the groups each rank trained at each
   step (read back from the rank's audit log); its final weights must equal the resumed run's.

Rank 0 writes ``--out`` (JSON) with what the test checks.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import msgpack
import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--groups", required=True, help="msgpack list of wire-encoded ScoredGroups")
    ap.add_argument("--first", type=int, required=True)
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from streamgrpo.config import load_config
    from streamgrpo.learner.distributed import barrier, init_distributed, share
    from streamgrpo.learner.loop import run_learner
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.models.files import read_model_tensors, to_model_names
    from streamgrpo.runtime.processes import StopFlag
    from streamgrpo.wire import decode

    cfg = load_config(args.config)
    dist = init_distributed("deepspeed", dist_backend=cfg.learner.dist_backend)
    run_dir = Path(cfg.run_dir)
    run_learner(cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_steps": args.first})}),
                stop=StopFlag(install=False), dist=dist)
    resumed = cfg.learner.model_copy(update={"max_steps": args.total, "resume": True})
    run_learner(cfg.model_copy(update={"learner": resumed}), stop=StopFlag(install=False), dist=dist)

    # replay the same per-rank, per-step groups through one uninterrupted learner
    groups = {g.group_id: g for g in (decode(b) for b in msgpack.unpackb(Path(args.groups).read_bytes()))}
    audit = run_dir / "audit" / ("learner.jsonl" if dist.is_main else f"learner-rank{dist.rank}.jsonl")
    steps = [r for r in map(json.loads, audit.read_text().splitlines()) if r["event"] == "trained"]
    replay_cfg = cfg.model_copy(update={"run_dir": str(run_dir / "replay")})
    torch.manual_seed(cfg.seed)  # as run_learner does: the same initial adapters in LoRA mode
    learner = Learner(replay_cfg, dist=dist)
    for i, rec in enumerate(steps):
        out = learner.train_step(Accepted.directly([groups[g] for g in rec["group_ids"]], learner.processor, version=i))
        assert out is not None, f"replay step {i + 1} skipped"
        learner.state.step += 1
    replayed = learner.policy_tensors()
    checksum = share(dist, learner.replicas_agree())
    barrier(dist)
    if dist.is_main:
        saved = read_model_tensors(run_dir / "checkpoints" / f"step-{args.total:06d}")
        replayed = {n.replace(".default.", "."): t for n, t in replayed.items()}  # LoRA: peft saves without it
        saved = to_model_names(saved, replayed.keys())
        diff = max(float((saved[n].float() - t.float()).abs().max()) for n, t in replayed.items())
        same = all(torch.equal(saved[n], t) for n, t in replayed.items())
        Path(args.out).write_text(json.dumps({
            "replay_steps": len(steps), "replay_equal": same, "max_abs_diff": diff,
            "replay_checksums": checksum.tolist(), "world_size": dist.world_size,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
