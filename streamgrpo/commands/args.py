"""What every command does with its ``--config`` and ``--set``: the config they name, loaded and checked."""

from __future__ import annotations

from streamgrpo.config import Config, load_config


def load(args) -> Config:
    """The config of ``--config`` (a file or a shipped name) with the ``--set`` overrides applied."""
    return load_config(args.config, args.overrides)
