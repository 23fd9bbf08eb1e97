"""`streamgrpo ...` (the CLI's own main) with its background checkpoint writes changed, as only tests need:
run under torchrun by test_async_checkpoint_ranks.py. The rest of the arguments are the CLI's.

* ``--sleep S``: each background write starts S seconds late (training goes on meanwhile); when it has
  written, the rank appends ``{"rank", "step", "live_step"}`` (the step the learner had reached by then)
  to ``<--out>/writes-rank<R>.jsonl``;
* ``--hold-step N``: the write of checkpoint N creates ``<--out>/writing-rank<R>`` and never ends (a kill -9
  lands in it);
* ``--fail-rank R``: rank R's write fails as a full disk does (ENOSPC); the other ranks write."""

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
    ap.add_argument("--out", type=Path, default=Path("."))
    args, rest = ap.parse_known_args()
    from streamgrpo.learner import checkpoint_ranks
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

    Learner.write_snapshot = write
    checkpoint_ranks.write_rank = full_disk
    from streamgrpo.cli import main as cli

    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
