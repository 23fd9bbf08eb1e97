"""learner.dist_backend: which process-group backend and devices the learner ranks of one host take; which ranks read the queue (pure)."""

from __future__ import annotations

import pytest

from streamgrpo.learner.distributed import (
    DistInfo,
    RankPlan,
    ReadLayout,
    hand_out,
    local_world_size,
    plan_ranks,
)


@pytest.mark.parametrize(("requested", "cuda", "devices", "local", "want"), [
    ("auto", True, 8, 8, RankPlan("nccl", True)),  # a GPU per rank
    ("auto", True, 1, 1, RankPlan("nccl", True)),
    ("auto", True, 1, 2, RankPlan("gloo", False)),  # two ranks, one GPU: no cuda.set_device(1)
    ("auto", False, 0, 2, RankPlan("gloo", False)),  # CPU
    ("gloo", True, 2, 2, RankPlan("gloo", True)),  # gloo asked for: ranks keep their GPUs when they go round
    ("gloo", True, 1, 2, RankPlan("gloo", False)),
    ("gloo", False, 0, 1, RankPlan("gloo", False)),
    ("nccl", True, 4, 2, RankPlan("nccl", True)),
])
def test_plan_ranks(requested, cuda, devices, local, want):
    assert plan_ranks(requested, cuda_available=cuda, device_count=devices, local_world_size=local) == want


def test_nccl_without_a_gpu_per_rank_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device for each of the 2 learner rank.*1 are visible"):
        plan_ranks("nccl", cuda_available=True, device_count=1, local_world_size=2)
    with pytest.raises(RuntimeError, match="0 are visible"):
        plan_ranks("nccl", cuda_available=False, device_count=0, local_world_size=1)
    with pytest.raises(ValueError, match="mpi"):
        plan_ranks("mpi", cuda_available=False, device_count=0, local_world_size=1)


def test_local_world_size_from_the_launchers():
    assert local_world_size({"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "3", "WORLD_SIZE": "16"}) == 4  # torchrun
    assert local_world_size({"LOCAL_SIZE": "3", "WORLD_SIZE": "16"}) == 3  # deepspeed launcher
    assert local_world_size({"WORLD_SIZE": "16"}) == 16  # an upper bound every rank reads alike
    assert local_world_size({}) == 1


def test_train_device_follows_the_plan():
    assert str(DistInfo(1, 2, 1, device="cpu").train_device()) == "cpu"
    assert str(DistInfo(1, 2, 1, device="cuda:1").train_device()) == "cuda:1"
    import torch

    assert DistInfo(0, 1, 0).train_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_free_port_is_below_the_ephemeral_range_and_bindable(tmp_path):
    import socket

    from streamgrpo.runtime.processes import ephemeral_low, free_port

    (tmp_path / "range").write_text("32768\t60999\n")
    assert ephemeral_low(str(tmp_path / "range")) == 32768
    assert ephemeral_low(str(tmp_path / "missing")) is None
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    if low and low > 11_000:  # Linux: never a port the kernel may give an outgoing connection meanwhile
        assert all(10_000 <= p < low for p in ports)
    assert len(ports) > 1  # picked at random, not one fixed port
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_auto_says_in_one_line_when_it_falls_back_to_the_cpu_with_cuda_visible():
    plan = plan_ranks("auto", cuda_available=True, device_count=1, local_world_size=2)
    assert plan.backend == "gloo" and not plan.cuda
    assert "\n" not in plan.warning and "2 learner rank(s)" in plan.warning and "1 visible CUDA device(s)" in plan.warning
    assert "learner.dist_backend=nccl" in plan.warning
    for quiet in (plan_ranks("auto", cuda_available=False, device_count=0, local_world_size=2),  # a CPU machine
                  plan_ranks("auto", cuda_available=True, device_count=2, local_world_size=2),  # NCCL
                  plan_ranks("gloo", cuda_available=True, device_count=1, local_world_size=2)):  # asked for
        assert quiet.warning is None


def test_the_first_rank_of_each_sequence_parallel_group_reads_its_replicas_share():
    layouts = [ReadLayout(r, 8, 4) for r in range(8)]  # 2 replicas of 4 sequence-parallel ranks
    assert [x.reads for x in layouts] == [True, False, False, False, True, False, False, False]
    assert [x.reader for x in layouts] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [x.share(6) for x in layouts] == [3, 0, 0, 0, 3, 0, 0, 0] and layouts[0].replicas == 2
    assert [x.helpers for x in layouts] == [[1, 2, 3], [], [], [], [5, 6, 7], [], [], []]  # whose deaths it judges
    plain = [ReadLayout(r, 2) for r in range(2)]  # without sequence parallelism every rank reads its own share
    assert [(x.reads, x.reader, x.share(4), x.helpers) for x in plain] == [(True, 0, 2, []), (True, 1, 2, [])]
    assert hand_out(["a"], plain[1], None) == ["a"]  # nothing to hand out: no collective
    for bad in ((0, 6, 4), (2, 2, 2), (0, 2, 0)):
        with pytest.raises(ValueError, match="sequence_parallel"):
            ReadLayout(*bad)
