"""The generator's weight applier (pure logic with a stand-in subscriber): what it applies, and when."""

from __future__ import annotations

from streamgrpo.generator.applier import WeightApplier


class _Subscriber:
    def __init__(self, versions):
        self.queue = [(v, {"w": v}) for v in versions]
        self.marked = 0

    def poll(self, timeout_s=0.0):
        return self.queue.pop(0) if self.queue else None

    def mark_applied(self):
        self.marked += 1
        return 0.01


class _Audit:
    def __init__(self):
        self.rows = []

    def write(self, row):
        self.rows.append(row)


def test_in_flight_a_lower_version_waits_for_the_batch_boundary():
    applied = []
    sub = _Subscriber([3])  # a restarted learner rolled back to v3 while the engine runs v5
    apply = WeightApplier(sub, lambda v, t: applied.append(v), _Audit(), "g")
    apply(not_below=5)  # between decoding steps: token versions must not go back
    assert applied == [] and len(apply.pending) == 1
    apply()  # the next batch boundary
    assert applied == [3] and sub.marked == 1 and not apply.pending


def test_the_newest_version_is_applied_and_older_ones_skipped():
    applied = []
    apply = WeightApplier(_Subscriber([6, 7, 8]), lambda v, t: applied.append(v), _Audit(), "g")
    apply(not_below=5)
    assert applied == [8] and not apply.pending


def test_the_demo_lag_applies_the_version_k_receipts_behind_and_the_plain_applier_has_none():
    from streamgrpo.commands.generator import recipe_applier
    from streamgrpo.config import build_config
    from streamgrpo.generator.loop import run_generator
    from streamgrpo.recipes.demo.lag import LaggedApplier

    # the generator command asks the installed recipes (the demo's hook, found by its entry point)
    assert recipe_applier(build_config({})) is WeightApplier
    applied = []
    sub = _Subscriber([1, 2, 3])
    apply = recipe_applier(build_config({}, ["demo.weight_apply_delay=2"]))(sub, lambda v, t: applied.append(v), _Audit(), "g")
    assert isinstance(apply, LaggedApplier)
    apply()
    assert applied == [1] and [v for v, _ in apply.pending] == [2, 3] and sub.marked == 0
    sub.queue = [(4, {"w": 4})]
    apply()
    assert applied == [1, 2]
    import inspect

    assert "cfg.demo" not in inspect.getsource(run_generator)  # the generator's core reads no demo knob
