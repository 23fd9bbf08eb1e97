"""The ``metrics`` section: Prometheus endpoint, progress lines, wandb."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from streamgrpo.sections import Section


class WandbConfig(Section):
    project: Optional[str] = None
    """wandb project (null: `streamgrpo`, and offline unless `mode` or WANDB_MODE say otherwise)."""
    run_name: Optional[str] = None
    """wandb run name (default: the run directory's name)."""
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    """null: the WANDB_MODE environment variable when it is set, else online when `project` is set and offline when not; offline writes a local run directory that `wandb sync` can upload later."""


class MetricsConfig(Section):
    host: str = "127.0.0.1"
    """Interface of the /metrics and /healthz HTTP server: this machine only by default; 0.0.0.0 lets a Prometheus on another host or container scrape it (docker-compose.yml and deploy/k8s set that)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of /metrics (0 = pick a free one and log it)."""
    log_every: int = Field(1, ge=1)
    """Print a progress line every this many steps."""
    sample_every: int = Field(50, ge=1)
    """Log a table of sample completions every this many steps."""
    wandb: Optional[WandbConfig] = None
    """wandb logging (null = off)."""
