"""`streamgrpo ...` (the CLI's own main) with its background checkpoint writes changed, as only tests need:
run under torchrun by test_async_checkpoint_ranks.py. The rest of the arguments are the CLI's.

* ``--sleep S``: each background write starts S seconds late (training goes on meanwhile); when it has
  written, the rank appends ``{"rank", "step", "live_step"}`` (the step the learner had reached by then)
  to ``<--out>/writes-rank<R>.jsonl``;
* ``--hold-step N``: the write of checkpoint N creates ``<--out>/writing-rank<R>`` and never ends (a kill -9
  lands in it);
* ``--fail-rank R``: rank R's write fails as a full disk does (ENOSPC); the other ranks write;
* ``--fail-stage N``: rank 0 cannot create ``step-N.tmp`` (EACCES, as a stale folder it may not remove);
* ``--fail-sync-rank R --fail-step N``: rank R's part of DeepSpeed's ``save_checkpoint`` for checkpoint N fails
  as a full disk does, in the training thread (a synchronous checkpoint, between DeepSpeed's collectives)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--hold-step", type=int, default=None)
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--fail-stage", type=int, default=None)
    ap.add_argument("--fail-sync-rank", type=int, default=None)
    ap.add_argument("--fail-step", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("."))
    args, rest = ap.parse_known_args()
    from streamgrpo.learner.checkpoint import files as checkpoint
    from streamgrpo.learner.checkpoint import ranks as checkpoint_ranks
    from streamgrpo.learner.trainer import Learner

    rank = int(os.environ.get("RANK", "0"))
    real_write, real_rank = Learner.write_snapshot, checkpoint_ranks.write_rank

    def write(self, root, snap):
        if args.hold_step == snap.step:
            (args.out / f"writing-rank{rank}").write_text(str(snap.step))
            threading.Event().wait()
        time.sleep(args.sleep)
        out = real_write(self, root, snap)
        with open(args.out / f"writes-rank{rank}.jsonl", "a") as fh:
            fh.write(json.dumps({"rank": rank, "step": snap.step, "live_step": self.state.step}) + "\n")
        return out

    def full_disk(learner, snap):
        if rank == args.fail_rank:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(snap.tmp / "deepspeed"))
        return real_rank(learner, snap)

    real_stage, real_tree = checkpoint_ranks.staging_dir, checkpoint.save_tree

    def stale_folder(root, step):
        if step == args.fail_stage:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(Path(root) / f"step-{step:06d}.tmp"))
        return real_stage(root, step)

    def sync_full_disk(obj, path):
        if rank == args.fail_sync_rank and f"step-{args.fail_step:06d}.tmp" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_tree(obj, path)

    Learner.write_snapshot = write
    checkpoint_ranks.write_rank = full_disk
    checkpoint_ranks.staging_dir = stale_folder
    checkpoint.save_tree = sync_full_disk
    from streamgrpo.cli import main as cli

    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
