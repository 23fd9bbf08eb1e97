"""The learner's static memory plan (pure arithmetic) and the check that refuses what cannot fit.

Hand-computed bytes for each backend and ZeRO stage; the real Qwen2.5-VL 3B/7B sizes counted on the
meta device; and the plan as a lower bound of the CUDA peaks measured on an H100 (2026-11-23,
docs/gpu.md and benchmarks/gpu_weights.py: a plan above a measured peak would refuse configs that run).
"""

from __future__ import annotations

import json

import pytest
import torch

from streamgrpo.config import build_config
from streamgrpo.learner.deepspeed_setup import deepspeed_config
from streamgrpo.learner.memory.plan import (
    Capacity,
    GiB,
    MemoryPlan,
    MemoryPlanError,
    ParamCounts,
    Placement,
    check_fits,
    plan_memory,
)
from tests.paths import REPO

DEPLOY = REPO / "streamgrpo" / "configs" / "deepspeed"
FULL = ParamCounts(total=1000, trainable=600)
LORA = ParamCounts(total=1000, trainable=50, lora=True)


def test_torch_backend_bytes_by_hand():
    fp32 = plan_memory(FULL, Placement())
    assert fp32.device == {"weights": 4000, "gradients": 2400, "optimizer": 4800, "reference": 0}
    assert fp32.host_bytes == 0
    bf16 = plan_memory(FULL, Placement(bf16=True, reference_bytes=2))
    assert bf16.device == {"weights": 600 * 4 + 400 * 2, "gradients": 2400, "optimizer": 4800, "reference": 2000}
    guarded = plan_memory(FULL, Placement(update_guard=True))  # learner.max_update_kl: a copy of what trains
    assert guarded.device["step copy"] == 2400 and guarded.device_bytes == fp32.device_bytes + 2400
    assert Placement.from_config(build_config({"learner": {"max_update_kl": 0.05}})).update_guard
    # learner.master_weights: trained weights in bf16 (2), the optimizer's float32 masters beside the moments (12)
    master = plan_memory(FULL, Placement(bf16=True, master_weights=True, reference_bytes=2))
    assert master.device == {"weights": 600 * 2 + 400 * 2, "gradients": 2400, "optimizer": 600 * 12, "reference": 2000}
    assert master.device_bytes == bf16.device_bytes + 2 * 600  # 2 bytes more a trained parameter, as measured
    assert Placement.from_config(build_config({"learner": {"bf16": True, "master_weights": True}})).master_weights


def test_lora_holds_the_base_frozen_and_trains_only_the_adapters():
    assert LORA.frozen == 1000
    plan = plan_memory(LORA, Placement(bf16=True))
    assert plan.device == {"weights": 50 * 4 + 1000 * 2, "gradients": 200, "optimizer": 400, "reference": 0}
    assert plan_memory(LORA, Placement(bf16=True, quantize_4bit=True)).device["weights"] == 200 + 500  # NF4


@pytest.mark.parametrize("stage,world,expect", [
    # ZeRO-1: bf16 weights whole, bf16 grads whole, master + moments (12 B) over the ranks
    (1, 4, {"weights": 2000, "gradients": 1200, "optimizer": 12 * 600 / 4}),
    # ZeRO-2: float32 gradient partitions
    (2, 4, {"weights": 2000, "gradients": 4 * 600 / 4, "optimizer": 12 * 600 / 4}),
    (2, 1, {"weights": 2000, "gradients": 2400, "optimizer": 7200}),
    # ZeRO-3: the weights are partitioned too
    (3, 8, {"weights": 2000 / 8, "gradients": 4 * 600 / 8, "optimizer": 12 * 600 / 8}),
])
def test_deepspeed_bf16_by_stage(stage, world, expect):
    plan = plan_memory(FULL, Placement(backend="deepspeed", bf16=True, zero_stage=stage, world_size=world))
    assert plan.device == {**expect, "reference": 0} and plan.host_bytes == 0


def test_zero3_partitions_the_reference_and_stage2_keeps_it_whole():
    z2 = plan_memory(FULL, Placement(backend="deepspeed", bf16=True, zero_stage=2, world_size=4, reference_bytes=2))
    z3 = plan_memory(FULL, Placement(backend="deepspeed", bf16=True, zero_stage=3, world_size=4, reference_bytes=2))
    assert z2.device["reference"] == 2000 and z3.device["reference"] == 500
    off = plan_memory(FULL, Placement(backend="deepspeed", bf16=True, zero_stage=3, world_size=4, reference_bytes=2,
                                      offload_param="cpu"))
    assert off.device["reference"] == 0 and off.host["reference"] == 500
    fp32_ref = plan_memory(FULL, Placement(backend="deepspeed", bf16=True, zero_stage=3, world_size=4,
                                           reference_bytes=4))  # model.dtype float32: the bf16 engine casts it
    assert fp32_ref.device["reference"] == 500


def test_offload_moves_parts_to_the_host_and_nvme_to_neither():
    base = Placement(backend="deepspeed", bf16=True, zero_stage=3, world_size=2)
    on = plan_memory(FULL, base)
    cpu = plan_memory(FULL, Placement(**{**base.__dict__, "offload_optimizer": "cpu", "offload_param": "cpu"}))
    assert cpu.device_bytes == 0 and cpu.host_bytes == on.device_bytes
    nvme = plan_memory(FULL, Placement(**{**base.__dict__, "offload_optimizer": "nvme"}))
    assert nvme.device["optimizer"] == 0 and nvme.host_bytes == 0 and nvme.device["weights"] == on.device["weights"]


def test_placement_from_the_config_and_the_shipped_deepspeed_files():
    cfg = build_config({"learner": {"bf16": True}, "loss": {"beta": 0.04}, "model": {"dtype": "bfloat16"}})
    assert Placement.from_config(cfg) == Placement(bf16=True, reference_bytes=2)
    lora = build_config({"loss": {"beta": 0.04}, "model": {"lora": {"r": 8}}})
    assert Placement.from_config(lora).reference_bytes == 0  # the base with adapters off: no copy
    for name, stage, offload in (("zero1", 1, "none"), ("zero3", 3, "none"), ("zero2_offload", 2, "cpu")):
        ds_cfg = build_config({"learner": {"backend": "deepspeed", "bf16": True,
                                           "deepspeed_config": str(DEPLOY / f"{name}.json")}})
        place = Placement.from_config(ds_cfg, deepspeed_config(ds_cfg), world_size=8)
        assert (place.zero_stage, place.offload_optimizer, place.world_size, place.bf16) == (stage, offload, 8, True)


def test_offload_configs_let_our_adamw_run_on_the_host():
    from streamgrpo.learner.deepspeed_setup import offloads_optimizer

    cfg = build_config({"learner": {"backend": "deepspeed", "deepspeed_config": str(DEPLOY / "zero2_offload.json")}})
    ds = deepspeed_config(cfg)
    assert offloads_optimizer(ds) and ds["zero_force_ds_cpu_optimizer"] is False
    plain = deepspeed_config(build_config({"learner": {"backend": "deepspeed"}}))
    assert not offloads_optimizer(plain) and "zero_force_ds_cpu_optimizer" not in plain
    json.loads((DEPLOY / "zero2_offload.json").read_text())  # valid JSON as shipped


def test_check_fits_refuses_in_one_line_with_what_to_change():
    plan = MemoryPlan({"weights": 50 * GiB, "optimizer": 40 * GiB}, {})
    h100 = Capacity("cuda:0 (NVIDIA H100 80GB HBM3)", 79.2 * GiB, 128 * GiB)
    with pytest.raises(MemoryPlanError) as e:
        check_fits(plan, h100, FULL)
    msg = str(e.value)
    assert "\n" not in msg and "has 79.2 GiB" in msg and "at least 90.0 GiB" in msg
    assert "weights 50.0 + optimizer 40.0 GiB" in msg and "model.lora" in msg and "deepspeed_config: zero2_offload" in msg
    check_fits(MemoryPlan({"weights": 70 * GiB}, {}), h100, FULL)  # fits: nothing raised
    # offload: the host's memory, shared by the host's ranks
    off = MemoryPlan({"weights": 10 * GiB}, {"optimizer": 40 * GiB})
    check_fits(off, h100, FULL)
    with pytest.raises(MemoryPlanError, match="at least 160.0 GiB on it .* 4 rank"):
        check_fits(off, Capacity("cuda:0", 79.2 * GiB, 128 * GiB, ranks_per_host=4), FULL)
    # a CPU learner: device and host are one memory; an unknown host size checks nothing
    cpu = Capacity("cpu", 24 * GiB, 24 * GiB, device_is_host=True)
    with pytest.raises(MemoryPlanError, match="this host has 24.0 GiB"):
        check_fits(MemoryPlan({"weights": 20 * GiB}, {"optimizer": 5 * GiB}), cpu, FULL)
    check_fits(MemoryPlan({"weights": 1e15}, {}), Capacity("cpu", 0, 0, device_is_host=True), FULL)


# --------------------------------------------------------------------------- real sizes (meta device)
def _real_counts(size: str, lora_r: int = 0) -> ParamCounts:
    """Qwen2.5-VL-3B/7B's layer sizes built on the meta device, vision frozen (or LoRA on every decoder linear)."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    from streamgrpo.models.params import policy_counts
    from streamgrpo.models.tiny import _REAL_VISION, REAL_SIZES

    real = REAL_SIZES[size]
    config = Qwen2_5_VLConfig(text_config=dict(real["text"]), vision_config={**_REAL_VISION, **real["vision"]},
                              tie_word_embeddings=real["tie"])
    config.text_config.tie_word_embeddings = real["tie"]
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    model_cfg = build_config({"model": {"tune_mm_vision": False, "lora": {"r": lora_r} if lora_r else None}}).model
    return policy_counts(model, model_cfg)


def test_the_plan_is_below_the_peaks_measured_at_3b_on_an_h100():
    counts = _real_counts("3b")
    assert counts.total == pytest.approx(3.755e9, rel=1e-3) and counts.trainable == pytest.approx(3.123e9, rel=1e-3)
    # the torch learner before weights that do not train were kept in bf16 (fp32 everywhere, bf16 autocast)
    old_torch = Placement(bf16=False, reference_bytes=2)
    measured = [(old_torch, 67.8), (Placement(), 60.1),  # beta 0.04 (the reference in bf16) / beta 0
                (Placement(backend="deepspeed", bf16=True, zero_stage=2, reference_bytes=2), 65.3)]
    for place, peak_gib in measured:
        plan = plan_memory(counts, place).device_bytes / GiB
        assert 0.75 * peak_gib < plan < peak_gib, (place, plan)


def test_7b_on_one_80gb_gpu_lora_and_offload_fit_full_torch_does_not():
    h100 = Capacity("cuda:0 (H100)", 79.2 * GiB, 128 * GiB)
    full = _real_counts("7b")
    torch_full = plan_memory(full, Placement(bf16=True, reference_bytes=2))
    with pytest.raises(MemoryPlanError):
        check_fits(torch_full, h100, full)
    assert torch_full.device_bytes / GiB > 120
    lora = _real_counts("7b", lora_r=64)
    lora_plan = plan_memory(lora, Placement(bf16=True))
    assert lora_plan.device["weights"] / GiB < 17 and lora_plan.device_bytes / GiB < 20  # the base in bf16
    offload = plan_memory(full, Placement(backend="deepspeed", bf16=True, zero_stage=2, offload_optimizer="cpu",
                                          reference_bytes=2))
    check_fits(offload, h100, full)
    assert offload.device_bytes / GiB < 32 and 100 < offload.host_bytes / GiB < 128


def test_report_says_what_sits_where_and_whether_it_fits():
    from streamgrpo.learner.memory.plan import report

    place = Placement(backend="deepspeed", bf16=True, zero_stage=2, offload_optimizer="cpu", world_size=2)
    plan = plan_memory(ParamCounts(total=8 * 2**30, trainable=4 * 2**30), place)
    lines, fits = report(ParamCounts(total=8 * 2**30, trainable=4 * 2**30), place, plan, 80 * GiB)
    assert fits and lines[0].startswith("8.59B parameters, 4.29B training; deepspeed ZeRO-2, optimizer offload cpu")
    assert lines[2] == "  on the GPU:  weights 16.0 GiB = 16.0 GiB"
    assert lines[3] == "  on the host: gradients 8.0 + optimizer 24.0 GiB = 32.0 GiB"
    assert lines[-1] == "on a GPU of 80 GiB: fits (64.0 GiB left for activations)"
    lines, fits = report(FULL, Placement(), MemoryPlan({"weights": 90 * GiB}, {}), 80 * GiB)
    assert not fits and "does not fit" in lines[-1] and lines[3] == "  on the host: nothing"
