"""What the role commands check before they load a model, so that a mistake ends them within seconds."""

from __future__ import annotations

from pathlib import Path

from streamgrpo.config import Config
from streamgrpo.data.records import require_data_path
from streamgrpo.transport.queue.base import QueueStopped
from streamgrpo.transport.queue.factory import open_queue, queue_url


def check_before_loading(cfg: Config, role: str, *, data: bool = False, queue: bool = True) -> None:
    """What can never work, found in a second instead of after loading a model: a missing data
    file, no Redis configured, a Redis that refuses this URL (password, TLS, ACL). An unreachable
    Redis is left to the queue, which waits for it (``stop=True`` ends this one try at once)."""
    if data:
        from streamgrpo.recipes.demo.assets import (
            prepare_data,  # the demo recipe's data set, when its config asks
        )

        prepare_data(cfg.demo, cfg.data.train_path)
        require_data_path(cfg.data.train_path)
    if not queue:
        return
    url = queue_url(cfg.queue, Path(cfg.run_dir))
    try:
        open_queue(cfg.queue, url, consumer=f"{role}-check", stop=True).close()
    except QueueStopped:
        pass
