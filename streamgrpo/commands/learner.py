"""``streamgrpo learner``: one learner (one rank of it under torchrun)."""

from __future__ import annotations

from streamgrpo.commands.args import load
from streamgrpo.commands.checks import check_before_loading
from streamgrpo.learner.loop import run_learner


def main(args) -> int:
    cfg = load(args)
    if args.resume:
        cfg.learner.resume, cfg.learner.fresh = True, False
    if args.fresh:
        cfg.learner.resume, cfg.learner.fresh = False, True
    if args.run_dir:
        cfg.run_dir = args.run_dir
    if args.from_weights:
        cfg.learner.from_weights = args.from_weights
    check_before_loading(cfg, "learner")
    return run_learner(cfg)
