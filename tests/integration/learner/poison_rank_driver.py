"""`streamgrpo ...` (the CLI's own main) where one learner rank's step raises on one group: ``--rank R`` (under
torchrun, the rank whose ``RANK`` it is) raises ``ValueError`` in ``Learner.train_step`` whenever the step holds
the group ``--group``, as a decoder bug that one rank's share of the sequences trips. The rest of the arguments
are the CLI's."""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--group", required=True)
    args, rest = ap.parse_known_args()
    if int(os.environ.get("RANK", "0")) == args.rank:
        from streamgrpo.learner import trainer

        real = trainer.Learner.train_step

        def poisoned(self, batch, *a, **k):
            if any(x.group.group_id == args.group for x in batch):
                raise ValueError(f"injected on rank {args.rank}: group {args.group} trips this rank's step")
            return real(self, batch, *a, **k)

        trainer.Learner.train_step = poisoned
    from streamgrpo.cli import main as cli

    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
