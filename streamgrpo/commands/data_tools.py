"""``streamgrpo data check | demo``: a data set checked record by record; the demo recipe's synthetic clips."""

from __future__ import annotations

from streamgrpo.commands.args import load
from streamgrpo.data.check import run_check


def check(args) -> int:
    return run_check(args.path, load(args).data, workers=args.workers, allow_errors=args.allow_errors)


def demo(args) -> int:
    from streamgrpo.recipes.demo.data import make_demo  # the demo recipe's data set

    make_demo(args.out, n=args.n, seed=args.seed)
    print(f"demo data set written to {args.out}")
    return 0
