"""Small weight updates for the weight-channel tests (deltas, relays, probes): what an optimizer step
changes, compared bit for bit, and the counters the channel moves."""

from __future__ import annotations

import torch


def small_update(t: dict[str, torch.Tensor], k: int, every: int = 97) -> dict[str, torch.Tensor]:
    """A copy of ``t`` with every ``every``-th bf16 word of ``w`` (from ``k``) and one float32 value changed."""
    out = {n: v.clone() for n, v in t.items()}
    flat = out["w"].view(-1)
    flat[k::every] = flat[k::every] + torch.tensor(0.01, dtype=torch.bfloat16)
    out["f32"][k % 99] += 1.0
    return out


def same(a: dict, b: dict) -> bool:
    """The same names and bit-identical tensors."""
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def counter_value(counter, **labels) -> float:
    """A prometheus_client counter's (or one of its labelled children's) current value."""
    return (counter.labels(**labels) if labels else counter)._value.get()
