"""`streamgrpo ...` (the CLI's own main) on a device that holds at most ``--max-rows`` sequences in
one forward: a forward over more raises ``torch.OutOfMemoryError``, as a GPU does. Run directly for
one process, or under torchrun (``--rank R``: only that rank runs out). The rest of the arguments
are the CLI's."""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-rows", type=int, required=True)
    ap.add_argument("--rank", type=int, default=None, help="only this rank runs out (default: every rank)")
    args, rest = ap.parse_known_args()
    import torch

    from streamgrpo.learner import trainer

    real = trainer.PolicyLogprobs.forward
    rank = int(os.environ.get("RANK", "0"))

    def limited(self, batch, *a, **k):
        if (args.rank is None or args.rank == rank) and batch.completion_mask.shape[0] > args.max_rows:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {batch.completion_mask.shape[0]} sequences "
                                         f"> {args.max_rows})")
        return real(self, batch, *a, **k)

    trainer.PolicyLogprobs.forward = limited
    from streamgrpo.cli import main as cli

    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
