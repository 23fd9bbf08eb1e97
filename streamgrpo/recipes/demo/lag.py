"""The staleness benchmark's lag (``demo.weight_apply_delay: k``): a generator that applies the
version ``k`` receipts behind the newest, so its groups arrive ``k`` versions staler than they
would. The core generator knows nothing of it; ``streamgrpo generator`` hands this applier to
``run_generator`` when the demo section asks for a lag."""

from __future__ import annotations

from streamgrpo import metrics as M
from streamgrpo.generator.applier import WeightApplier


class LaggedApplier(WeightApplier):
    """A :class:`WeightApplier` that keeps ``delay`` received versions back."""

    def __init__(self, weights, load_weights, audit, name: str, *, delay: int):
        super().__init__(weights, load_weights, audit, name)
        self.delay = delay

    def pick(self):
        return self.pending[-1 - self.delay] if len(self.pending) > self.delay else None

    def applied(self, version: int) -> float | None:
        M.POLICY_VERSION.labels(role="generator").set(version)  # not the newest: no publish-to-applied latency
        return None


def applier_for(demo):
    """The applier class a generator runs with under this demo section (the plain one without a lag)."""
    if not demo.weight_apply_delay:
        return WeightApplier
    return lambda *args: LaggedApplier(*args, delay=demo.weight_apply_delay)
