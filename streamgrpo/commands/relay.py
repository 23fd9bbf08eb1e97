"""``streamgrpo relay``: one copy of each weight version per host (a generator starts it on its own)."""

from __future__ import annotations

from streamgrpo.commands.args import load
from streamgrpo.relay.loop import IDLE_EXIT_S, run_relay


def main(args) -> int:
    cfg = load(args)
    if args.run_dir:
        cfg.run_dir = args.run_dir
    return run_relay(cfg, client_key=args.client_key,
                     idle_exit_s=IDLE_EXIT_S if args.idle_exit_s is None else args.idle_exit_s)
