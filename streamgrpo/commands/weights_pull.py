"""``streamgrpo weights pull``: receive one weight version from the learner into a .safetensors file.

What a generator does on its first version (the snapshot a late joiner gets, or the next version
published), with the config's ``weights`` section (ports, CURVE keys, transport), then the tensors
as the learner named them are written with safetensors. For producers written outside streamgrpo
(docs/protocol.md): a way to check that they read the channel right, and to start a server with
the learner's current weights.
"""

from __future__ import annotations

import time
from pathlib import Path

from streamgrpo.commands.args import load
from streamgrpo.config import Config
from streamgrpo.transport.weights.factory import subscriber_from_config


def pull_weights(cfg: Config, out: str | Path, *, timeout_s: float = 600.0, client_key: str | None = None) -> int:
    from safetensors.torch import save_file


    sub = subscriber_from_config(cfg.weights, cfg.run_dir, client_key=client_key)
    try:
        deadline = time.monotonic() + timeout_s
        got = None
        while got is None and time.monotonic() < deadline:
            got = sub.poll(timeout_s=min(1.0, max(0.0, deadline - time.monotonic())))
        if got is None:
            why = sub.status() if hasattr(sub, "status") else None
            print(f"no weight version from {cfg.weights.connect_host}:{cfg.weights.pub_port} within {timeout_s:g}s"
                  + (f" ({why})" if why else ""))
            return 1
        version, tensors = got
        tensors = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
        sub.mark_applied()
    finally:
        sub.close()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"streamgrpo_version": str(version)})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"weights v{version}: {len(tensors)} tensors, {size / 2**20:.1f} MiB -> {out}")
    return 0


def main(args) -> int:
    return pull_weights(load(args), args.out, timeout_s=args.timeout_s, client_key=args.client_key)
