"""``streamgrpo generator``: one generator process (``--id`` of ``rollout.num_generators``)."""

from __future__ import annotations

from streamgrpo.commands.args import load
from streamgrpo.commands.checks import check_before_loading
from streamgrpo.config import Config, ConfigError
from streamgrpo.generator.loop import run_generator


def main(args) -> int:
    from streamgrpo.recipes.demo.lag import (
        applier_for,  # the demo's lagging applier (the staleness benchmark)
    )

    cfg = load(args)
    if args.run_dir:
        cfg.run_dir = args.run_dir
    if not 0 <= args.id < cfg.rollout.num_generators:
        raise ConfigError(f"--id {args.id} is outside 0..{cfg.rollout.num_generators - 1} (rollout.num_generators)")
    set_port(cfg, args.local_index)
    check_before_loading(cfg, f"generator-{args.id}", data=True)
    return run_generator(cfg, generator_id=args.id, applier=applier_for(cfg.demo))


def set_port(cfg: Config, local: int) -> None:
    """A fixed ``metrics.port`` P: this generator serves P + its local index on the host (``--local-index``,
    default 0), as learner ranks serve P + LOCAL_RANK; 0 stays 0 (a free port)."""
    if local < 0:
        raise ConfigError(f"--local-index {local}: must be 0 or more")
    if cfg.metrics.port and local:
        if cfg.metrics.port + local > 65535:
            raise ConfigError(f"metrics.port {cfg.metrics.port} + local index {local} is past 65535")
        cfg.metrics.port += local
