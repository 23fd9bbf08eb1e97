"""``streamgrpo model tiny | merge | export``: a random tiny model, a LoRA adapter merged, a checkpoint in the Hub's
layout (``model push`` uploads it: :mod:`streamgrpo.commands.model_push`)."""

from __future__ import annotations

from streamgrpo.commands.args import load
from streamgrpo.commands.infer import checkpoint_of
from streamgrpo.config import ConfigError
from streamgrpo.config.recipes import hooks
from streamgrpo.config.schema import RECIPES
from streamgrpo.models.export import export_checkpoint
from streamgrpo.models.lora import merge_adapter
from streamgrpo.models.tiny import build_tiny, write_config


def tiny(args) -> int:
    if args.config_only:
        print(f"{args.size} {args.arch} config.json written to {write_config(args.out, args.arch, args.size)}")
        return 0
    out = build_tiny(args.out, arch=args.arch, seed=args.seed, size=args.size, layers=args.layers)
    if args.warm_format:
        warm = hooks(RECIPES, "warm_start")
        if not warm:
            raise ConfigError("--warm-format: no installed recipe has a warm start (the demo's registers one: "
                              "pip install -e .)")
        cfg = load(args) if args.config else None  # default: the recipe's own prompts (the colour demo's)
        warm[0][1](out, cfg, seed=args.seed, steps=args.warm_steps)
    print(f"{args.size} {args.arch} model (random weights) written to {out}")
    return 0


def merge(args) -> int:
    merge_adapter(args.adapter, args.out, base=args.base)
    print(f"merged model written to {args.out}")
    return 0


def export(args) -> int:
    out = export_checkpoint(checkpoint_of(args.checkpoint), args.out, adapter=args.adapter, base=args.base,
                            config=args.config)
    print(f"exported to {out} (`streamgrpo model push {out} --repo ORG/NAME` uploads it)")
    return 0
