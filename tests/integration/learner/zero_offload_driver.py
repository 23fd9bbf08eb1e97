"""Run by test_zero_offload.py in its own process (one DeepSpeed rank on the CPU, a gloo group).

Trains the tiny model on the same groups with ZeRO-2 (``zero2.json``), ZeRO-2 with the optimizer
offloaded to the host (``zero2_offload.json``) and ZeRO-3 (``zero3.json``, the shipped 7B config's), and
the offload and ZeRO-3 learners checkpointed asynchronously after step 2 (host copies, then two more steps,
then the write), loaded by a fresh Learner and trained on. Writes
``--out`` (JSON): each run's per-step losses and grad norms and every trained weight at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgpack
import torch

from tests.paths import REPO


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--groups", required=True, help="msgpack list of wire-encoded ScoredGroups")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from streamgrpo.config import load_config
    from streamgrpo.learner.distributed import init_distributed
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.wire import decode

    deploy = REPO / "streamgrpo" / "configs" / "deepspeed"
    groups = [decode(b) for b in msgpack.unpackb(Path(args.groups).read_bytes())]
    batches = [groups[i:i + 2] for i in range(0, len(groups), 2)]
    dist = init_distributed("deepspeed", dist_backend="gloo")

    def learner(name: str, run: str) -> Learner:
        cfg = load_config("demo", [f"model.name_or_path={args.model}", f"run_dir={Path(args.run_dir) / run}",
                                   "learner.groups_per_step=2", "loss.loss_type=dapo", "learner.learning_rate=1e-3",
                                   "learner.backend=deepspeed", f"learner.deepspeed_config={deploy / name}"])
        torch.manual_seed(0)
        return Learner(cfg, dist=dist)

    def train(lrn: Learner, parts, start: int = 0) -> list[list[float]]:
        out = []
        for i, part in enumerate(parts):
            step = lrn.train_step(Accepted.directly(part, lrn.processor, version=start + i))
            assert step is not None
            lrn.state.step += 1
            lrn.state.version += 1
            out.append([step.loss, step.grad_norm, step.stats.kl])
        return out

    def weights(lrn: Learner) -> dict[str, list[float]]:  # gathered under ZeRO-3
        return {n: t.double().flatten().tolist() for n, t in lrn.policy_tensors().items()}

    result = {}
    for name in ("zero2.json", "zero2_offload.json", "zero3.json"):
        lrn = learner(name, name)
        result[name] = {"steps": train(lrn, batches), "weights": weights(lrn),
                        "optimizer": type(lrn.optimizer.optimizer).__name__,
                        "reference_partitioned": all(hasattr(p, "ds_id") for p in lrn.ref.parameters()),
                        "state_devices": sorted({str(t.device) for s in lrn.optimizer.optimizer.state.values()
                                                 for t in s.values() if torch.is_tensor(t)})}
        del lrn
    from streamgrpo.learner.checkpoint.files import load_tree

    for name in ("zero2_offload.json", "zero3.json"):
        first = learner(name, f"resume-{name}")
        steps = train(first, batches[:2])
        root = Path(args.run_dir) / f"resume-{name}" / "checkpoints"
        snap = first.snapshot(root)  # an asynchronous checkpoint: host copies now, written later
        train(first, batches[2:], start=2)  # training goes on before the write: none of it may reach the files
        first.write_snapshot(root, snap)
        first.finalise_write(root, snap.step)
        ckpt = root / f"step-{snap.step:06d}"
        del first
        resumed = learner(name, f"resume-{name}")
        resumed.load(ckpt)
        steps += train(resumed, batches[2:], start=2)
        state_files = sorted((ckpt / "deepspeed" / "state").iterdir())  # DeepSpeed's names, our safetensors engine
        result[f"resumed {name}"] = {"steps": steps, "weights": weights(resumed),
                                     "state_files": {p.name: load_tree(p) is not None for p in state_files}}
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
