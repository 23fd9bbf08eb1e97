"""``streamgrpo data check | <recipe>``: a data set checked record by record; a recipe's synthetic data set
(``data demo``: the demo's clips)."""

from __future__ import annotations

from streamgrpo.commands.args import load
from streamgrpo.config.recipes import hooks
from streamgrpo.config.schema import RECIPES
from streamgrpo.data.check import run_check


def check(args) -> int:
    return run_check(args.path, load(args).data, workers=args.workers, allow_errors=args.allow_errors)


def make(args) -> int:
    make_data = next(f for r, f in hooks(RECIPES, "make_data") if r.name == args.recipe)
    make_data(args.out, n=args.n, seed=args.seed)
    print(f"{args.recipe} data set written to {args.out}")
    return 0
