"""``streamgrpo evaluator``: held-out results at the weight versions the learner publishes."""

from __future__ import annotations

from streamgrpo.commands.args import load
from streamgrpo.evaluator.loop import run_evaluator


def main(args) -> int:
    cfg = load(args)
    if args.run_dir:
        cfg.run_dir = args.run_dir
    return run_evaluator(cfg)
