"""Run under torchrun (2 gloo ranks on the CPU) by test_zero3_lockstep.py: two DeepSpeed ZeRO-3 ranks, each a
data-parallel replica with its own group, whose micro-batches need different numbers of LM head calls: rank 0's
group has completions long enough for two chunks of ``CHUNK_TOKENS`` rows, rank 1's one chunk. ZeRO-3 gathers the
head's weight at every call, collectively (``--deepspeed-config``: every weight, none kept whole). Each rank
counts its head's calls in forward and backward and writes them, with the step's results, to ``--out``-rank<N>.json.
Then a step over ``--mixed`` (an image group and a video group): rank 0 trains both, rank 1 the video group alone;
then one where rank 0 trains a ``--text`` group (no visual) and rank 1 the video group; each counts its vision
encoder's calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np


def _long(group, tokens: int):
    """The group with every completion ``tokens`` long (its own tokens repeated; behaviour log-probs as given)."""
    def grow(c):
        reps = -(-tokens // len(c.token_ids))
        ids = np.tile(c.token_ids, reps)[:tokens]
        return replace(c, token_ids=ids, logprobs=np.tile(c.logprobs, reps)[:tokens],
                       versions=None if c.versions is None else np.tile(c.versions, reps)[:tokens])
    return replace(group, completions=[grow(c) for c in group.completions])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--groups", required=True, help="msgpack list of two wire-encoded ScoredGroups")
    ap.add_argument("--mixed", required=True, help="msgpack list of an image group and a video group")
    ap.add_argument("--text", required=True, help="msgpack list of a group without visuals")
    ap.add_argument("--deepspeed-config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch.distributed as dist

    from streamgrpo.config import load_config
    from streamgrpo.learner.distributed import init_distributed
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.models.batching import unwrap_model
    from streamgrpo.models.logprobs import CHUNK_TOKENS
    from streamgrpo.wire import decode

    info = init_distributed("deepspeed", dist_backend="gloo")
    rank = dist.get_rank()
    groups = [decode(b) for b in msgpack.unpackb(Path(args.groups).read_bytes())]
    per_row = CHUNK_TOKENS // len(groups[0].completions) + 8  # rank 0: just over one chunk
    mine = _long(groups[0], per_row) if rank == 0 else groups[1]
    cfg = load_config("demo", [f"model.name_or_path={args.model}", f"run_dir={args.run_dir}",
                               "learner.backend=deepspeed", f"learner.deepspeed_config={args.deepspeed_config}",
                               "learner.groups_per_step=2", "learner.micro_batch_tokens=100000",
                               "learner.async_checkpoint=false", f"rollout.max_completion_length={per_row}"])
    lrn = Learner(cfg, dist=info)
    head = unwrap_model(lrn.module).lm_head
    calls = {"forward": 0, "backward": 0}
    head.register_forward_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))
    head.register_full_backward_hook(lambda *_: calls.__setitem__("backward", calls["backward"] + 1))
    losses = []
    for _ in range(2):
        res = lrn.train_step(Accepted.directly([mine], lrn.processor, version=0))
        losses.append(None if res is None else res.loss)
    tokens = sum(len(c.token_ids) for c in mine.completions)
    image, video = (decode(b) for b in msgpack.unpackb(Path(args.mixed).read_bytes()))
    text = decode(msgpack.unpackb(Path(args.text).read_bytes())[0])
    vision = []
    unwrap_model(lrn.module).model.visual.register_forward_hook(lambda *_: vision.append(1))
    steps = {}
    for name, mine in (("mixed", [image, video] if rank == 0 else [video]), ("text", [text] if rank == 0 else [video])):
        vision.clear()
        res = lrn.train_step(Accepted.directly(mine, lrn.processor, version=0))
        steps[name] = {"kinds": sorted({v.kind for g in mine for v in g.visuals}), "vision_calls": len(vision),
                       "loss": None if res is None else res.loss}
    Path(f"{args.out}-rank{rank}.json").write_text(json.dumps({"losses": losses, "calls": calls, "tokens": tokens,
                                                               **steps}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
