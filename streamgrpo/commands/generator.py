"""``streamgrpo generator``: one generator process (``--id`` of ``rollout.num_generators``)."""

from __future__ import annotations

from streamgrpo.commands.args import load
from streamgrpo.commands.checks import check_before_loading
from streamgrpo.config import Config, ConfigError
from streamgrpo.config.recipes import hooks
from streamgrpo.config.schema import RECIPES
from streamgrpo.generator.applier import WeightApplier
from streamgrpo.generator.loop import run_generator


def main(args) -> int:
    cfg = load(args)
    if args.run_dir:
        cfg.run_dir = args.run_dir
    if not 0 <= args.id < cfg.rollout.num_generators:
        raise ConfigError(f"--id {args.id} is outside 0..{cfg.rollout.num_generators - 1} (rollout.num_generators)")
    set_port(cfg, args.local_index)
    check_before_loading(cfg, f"generator-{args.id}", data=True)
    return run_generator(cfg, generator_id=args.id, applier=recipe_applier(cfg))


def set_port(cfg: Config, local: int) -> None:
    """A fixed ``metrics.port`` P: this generator serves P + its local index on the host (``--local-index``,
    default 0), as learner ranks serve P + LOCAL_RANK; 0 stays 0 (a free port)."""
    if local < 0:
        raise ConfigError(f"--local-index {local}: must be 0 or more")
    if cfg.metrics.port and local:
        if cfg.metrics.port + local > 65535:
            raise ConfigError(f"metrics.port {cfg.metrics.port} + local index {local} is past 65535")
        cfg.metrics.port += local


def recipe_applier(cfg: Config):
    """The weight applier the first recipe that asks for one hands out (the demo's lag: the staleness
    benchmark), else the plain :class:`WeightApplier`."""
    for recipe, applier_of in hooks(RECIPES, "generator_applier"):
        applier = applier_of(getattr(cfg, recipe.name))
        if applier is not None:
            return applier
    return WeightApplier
