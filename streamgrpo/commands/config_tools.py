"""``streamgrpo config show | memory | init | reference``: the config, its memory plan, a starter, the reference."""

from __future__ import annotations

import sys
from pathlib import Path

from streamgrpo.commands.args import load
from streamgrpo.config import ConfigError, load_config
from streamgrpo.config.launch import backend_for_ranks
from streamgrpo.config.reference import render_reference
from streamgrpo.config.starter import write_starter

FAILED_EXIT = 1


def show(args) -> int:
    sys.stdout.write(load(args).to_yaml(redact=True))  # passwords and keys masked, but shown to be set
    return 0


def memory(args) -> int:
    """A learner rank's memory plan for this config (static parts and what a step adds), from the model's
    config alone; exit 1 if it cannot fit.

    The ranks: ``--ranks``, else the config's ``launch.learner_ranks``; several ranks are planned on the
    deepspeed backend, as ``up`` runs them. A model config that cannot be read is one line (exit 2)."""
    from streamgrpo.models.model_config import config_json  # torch-free: read before torch loads

    cfg = load(args)
    ranks = args.ranks if args.ranks is not None else cfg.launch.learner_ranks
    if ranks < 1:
        raise ConfigError(f"--ranks {ranks}: at least one learner rank")
    backend = backend_for_ranks(cfg.learner.backend, ranks, cfg.learner.sequence_parallel)
    if backend != cfg.learner.backend:  # the torch backend is one process or one sequence-parallel group, as in `up`
        cfg.learner.backend = backend
        print(f"{ranks} learner ranks: planned with learner.backend=deepspeed, as `streamgrpo up` runs them "
              "(ZeRO-2 unless learner.deepspeed_config says otherwise)")
    config_json(cfg.model.name_or_path, cfg.model.revision)  # no model config: one line, before torch loads
    import torch

    from streamgrpo.learner.memory.plan import GiB, plan_for, report

    counts, place, plan = plan_for(cfg, ranks)
    gpu = args.gpu_gib * GiB if args.gpu_gib else (
        float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else 80 * GiB)
    lines, fits = report(counts, place, plan, gpu)
    print(f"{cfg.model.name_or_path}: " + "\n".join(lines))
    return 0 if fits else FAILED_EXIT


def init(args) -> int:
    """A commented starting config: a shipped one (``--from``) with each key's doc, checked by loading it."""
    out = write_starter(args.source, args.out, force=args.force)
    load_config(out)
    print(f"{out}: started from {args.source!r}; check it with `streamgrpo config show --config {out}` and "
          f"`streamgrpo up --config {out} --plan`")
    return 0


def reference(args) -> int:
    """docs/config.md from the config's field docstrings: printed, written to --out, or checked against it."""
    text = render_reference()
    if args.check:
        if not args.out:
            raise ConfigError("--check compares with a file: give it as --out PATH")
        out = Path(args.out)
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"streamgrpo config reference: {out} is {'stale' if out.is_file() else 'missing'}: regenerate it "
                  f"with `streamgrpo config reference --out {out}`", file=sys.stderr)
            return FAILED_EXIT
        print(f"{out} is up to date")
        return 0
    if not args.out:
        sys.stdout.write(text)
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"config reference written to {args.out}")
    return 0
