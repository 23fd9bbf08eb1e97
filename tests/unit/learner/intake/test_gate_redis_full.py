"""How a learner rank collects a step when Redis nears or reaches ``maxmemory`` (pure logic of
:func:`streamgrpo.learner.intake.gate.collect_groups`; the queue and the gate are stand-ins that hand out
nothing, the real ones are in tests/integration/learner/intake/test_redis_full.py)."""

from __future__ import annotations

from types import SimpleNamespace

from streamgrpo.config import LossConfig
from streamgrpo.learner.distributed import DistInfo
from streamgrpo.learner.intake import gate as gate_mod
from streamgrpo.learner.intake.gate import CommitFirst, collect_groups
from streamgrpo.learner.state import LearnerState


class NoGroups:
    """A queue with nothing to read (the generators are refused at maxmemory)."""

    def __init__(self):
        self.reads = 0

    def get(self, n, timeout_s):
        self.reads += 1
        return []


class StopAfter:
    """A stop flag that turns true after ``n`` looks (so a test that would wait forever ends)."""

    def __init__(self, n):
        self.n = n

    def __bool__(self):
        self.n -= 1
        return self.n < 0


def _gate():
    return SimpleNamespace(state=LearnerState(), loss=LossConfig(), admit=lambda d: None)


def test_a_full_batch_checkpoints_first_when_redis_nears_maxmemory():
    carry = ["a", "b", "c", "d"]  # a full step at hand: before, the pressure was read only when short
    got = collect_groups(NoGroups(), _gate(), StopAfter(100), DistInfo(), 4, carry, timeout_s=0.0,
                         pressure=lambda: "Redis uses 85% of its maxmemory")
    assert isinstance(got, CommitFirst) and got.carry == carry and "85%" in got.why


def test_redis_full_and_nothing_coming_trains_the_groups_at_hand(monkeypatch):
    monkeypatch.setattr(gate_mod, "STARVED_S", 0.05)
    queue = NoGroups()
    got = collect_groups(queue, _gate(), StopAfter(10_000), DistInfo(), 4, ["a", "b"], timeout_s=0.0,
                         redis_full=lambda: True)
    assert got == ["a", "b"] and queue.reads >= 1


def test_without_a_full_redis_a_short_step_waits(monkeypatch):
    monkeypatch.setattr(gate_mod, "STARVED_S", 0.0)
    assert collect_groups(NoGroups(), _gate(), StopAfter(50), DistInfo(), 4, ["a", "b"], timeout_s=0.0,
                          redis_full=lambda: False) is None  # waited until stopped: never a short step
    assert collect_groups(NoGroups(), _gate(), StopAfter(50), DistInfo(), 4, [], timeout_s=0.0,
                          redis_full=lambda: True) is None  # nothing at hand: nothing to train


class OneDelivery:
    """A queue that hands out one stand-in delivery, then nothing."""

    def __init__(self):
        self.given = False

    def get(self, n, timeout_s):
        if self.given:
            return []
        self.given = True
        return [SimpleNamespace(stream_id="1-0")]


def _rank(rank: int, port: int, out) -> None:
    """One of two real gloo ranks collecting a step: rank 1's media root is unusable (its admit raises)."""
    from datetime import timedelta

    import torch.distributed as dist

    from streamgrpo.learner.intake.media import MediaUnavailable

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        def admit(d):
            raise MediaUnavailable("stopping: the media root /data is missing here")

        gate = SimpleNamespace(state=LearnerState(), loss=LossConfig(), admit=admit if rank == 1 else (lambda d: None))
        queue = OneDelivery() if rank == 1 else NoGroups()
        collect_groups(queue, gate, StopAfter(10_000), DistInfo(rank=rank, world_size=2), 4, [], timeout_s=0.0)
        out.put((rank, "returned"))
    except MediaUnavailable as exc:
        out.put((rank, str(exc)))
    except Exception as exc:  # what a rank left waiting in a collective gets
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def test_a_rank_whose_media_root_is_unusable_stops_every_rank():
    """MediaUnavailable on one rank: every rank stops with it (none is left in a collective)."""
    import multiprocessing as mp

    from streamgrpo.runtime.processes import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert "the media root /data is missing here" in got[1]
    assert got[0] == "stopping with learner rank(s) 1, whose media root is unusable (their log says why)", got
