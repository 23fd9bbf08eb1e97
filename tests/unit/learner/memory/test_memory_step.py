"""The memory plan's step terms (optimizer temporaries, activations, logits, the reference's forward,
a generator's KV cache) by hand, and the full plan against CUDA peaks measured on one H100 80 GB.

Measured 2026-11-26 on one H100 80 GB (79.2 GiB usable), random-weight Qwen2.5-VL at the published
sizes; bf16, vision frozen, G=8 completions x 256 tokens, 16 frames of 448x448 (2048 video tokens),
gradient checkpointing, one group per micro-batch. The plan is computed here from config-only models
(``streamgrpo.models.tiny.write_config``), no GPU:

====================================================  ==========  =========  ==================
case                                                  static GiB  plan GiB   measured peak GiB
====================================================  ==========  =========  ==================
3B full, torch, beta 0.04                             54.7        63.0       58.8 (plan +7%)
3B full, torch, beta 0.04, shared_prompt              54.7        58.3       56.2 (plan +4%)
7B LoRA r=64, torch, beta 0.04                        17.9        29.8       30.5 (plan -2%)
3B full, ZeRO-2, 1 rank, beta 0, + HF generator       53.5 + 7.0  71.6 + 8.7 out of memory (plan
                                                                  = 80.2     over 79 GiB: refused)
====================================================  ==========  =========  ==================

Measured 2026-11-27 on the same kind of GPU (torch 2.11, transformers 5.24; ``benchmarks/gpu_session.sh
learner3b`` / ``learner7b``), the same shapes:

====================================================  ==========  =========  ==================
case                                                  static GiB  plan GiB   measured peak GiB
====================================================  ==========  =========  ==================
3B full, torch, beta 0.04                             54.7        63.0       58.5 (plan +8%)
3B full, learner.master_weights                       60.5        68.8       63.3 (plan +9%)
3B full, master_weights + compile                     60.5        68.8       62.8 (plan +10%)
3B full, master_weights + shared_prompt               60.5        64.1       61.5 (plan +4%)
7B LoRA r=64, dropout 0                               17.9        28.3       27.9 (plan +2%)
7B LoRA r=64, dropout 0, compile                      17.9        28.3       29.4 (plan -4%)
====================================================  ==========  =========  ==================

Since 2026-11-28 (issue 63) the plan also counts the vision encoder's pass and the decoder's attention mask:
0.1-0.3 GiB more at these shapes (the parametrized plans below), every row still within 10% of its peak.
"""

from __future__ import annotations

import copy

import pytest

from streamgrpo.commands.placement import PlacementError, plan_placement
from streamgrpo.config import build_config
from streamgrpo.learner.memory.plan import (
    Capacity,
    GiB,
    MemoryPlan,
    MemoryPlanError,
    ParamCounts,
    Placement,
    check_fits,
    plan_for,
    plan_memory,
    report,
)
from streamgrpo.learner.memory.step import (
    PROMPT_TEXT_TOKENS,
    Workload,
    activation_bytes,
    generator_memory,
    generator_step_bytes,
    optimizer_temporaries,
    prompt_tokens,
    step_memory,
    workload,
)
from streamgrpo.models.params import ModelShape, model_shape

SHAPE = ModelShape(layers=4, hidden=100, intermediate=300, vocab=1000, kv_heads=2, head_dim=25)
FULL = ParamCounts(total=1000, trainable=600, largest=200)


# --------------------------------------------------------------------------- by hand
def test_optimizer_temporaries_by_backend():
    assert optimizer_temporaries(FULL, Placement()) == (4 * 200, 0)  # fused: one fp32 copy of the largest tensor
    assert optimizer_temporaries(FULL, Placement(optimizer_impl="foreach")) == (4 * 600, 0)  # whole-list sqrt
    z2 = Placement(backend="deepspeed", bf16=True, zero_stage=2, world_size=4, reduce_bucket=10, allgather_bucket=20)
    assert optimizer_temporaries(FULL, z2) == (4 * 600 / 4 + 10 * 2 + 20 * 2, 0)  # fp32 partition + buckets
    one = Placement(backend="deepspeed", bf16=True, zero_stage=2, world_size=1, reduce_bucket=10, overlap_comm=True)
    assert optimizer_temporaries(FULL, one) == (4 * 600 + 2 * 10 * 2, 0)  # no all-gather on one rank
    z3 = Placement(backend="deepspeed", bf16=True, zero_stage=3, world_size=2, reduce_bucket=10, allgather_bucket=0,
                   live_params=100, prefetch_bucket=5)
    assert optimizer_temporaries(FULL, z3) == (4 * 600 / 2 + 10 * 2 + (100 + 5) * 2, 0)  # + gathered layers
    off = Placement(backend="deepspeed", bf16=True, zero_stage=2, world_size=1, reduce_bucket=10,
                    offload_optimizer="cpu")
    assert optimizer_temporaries(FULL, off) == (10 * 2, 4 * 10)  # the step on the host, through a pinned bucket


def test_activations_follow_the_recompute_setting():
    t, h, i = 50, 100, 300
    work = Workload(tokens=t, completion_tokens=20, gradient_checkpointing=True)
    working = t * (8 * h + 4 * i) * 2
    assert activation_bytes(SHAPE, work) == (4 * t * h * 2 + working, 0)  # layer inputs + one layer's work
    half = Workload(tokens=t, completion_tokens=20, gradient_checkpointing=True, checkpoint_every=2)
    assert activation_bytes(SHAPE, half)[0] == 2 * t * h * 2 + 2 * t * (10 * h + 4 * i) * 2 + working
    none = Workload(tokens=t, completion_tokens=20)
    assert activation_bytes(SHAPE, none)[0] == 4 * t * (10 * h + 4 * i) * 2 + working
    off = Workload(tokens=t, completion_tokens=20, gradient_checkpointing=True, checkpoint_offload=True)
    assert activation_bytes(SHAPE, off) == (working, 4 * t * h * 2)  # the saved inputs on the host
    lora = Workload(tokens=t, completion_tokens=20, gradient_checkpointing=True, lora_dropout=True)
    assert activation_bytes(SHAPE, lora)[0] == activation_bytes(SHAPE, work)[0] + t * (6 * h + i) * 2
    # learner.checkpoint_matmuls: every recomputed layer keeps its matmul and attention outputs too, on the device
    # (k and v are kv_heads x head_dim = 50 wide, not h)
    sel = Workload(tokens=t, completion_tokens=20, gradient_checkpointing=True, checkpoint_matmuls=True)
    assert activation_bytes(SHAPE, sel)[0] == activation_bytes(SHAPE, work)[0] + 4 * t * (4 * h + 2 * 50 + 2 * i) * 2
    sel_half = Workload(tokens=t, completion_tokens=20, gradient_checkpointing=True, checkpoint_every=2,
                        checkpoint_matmuls=True)
    assert activation_bytes(SHAPE, sel_half)[0] == activation_bytes(SHAPE, half)[0] + 2 * t * (4 * h + 2 * 50 + 2 * i) * 2
    sel_off = Workload(tokens=t, completion_tokens=20, gradient_checkpointing=True, checkpoint_offload=True,
                       checkpoint_matmuls=True)
    assert activation_bytes(SHAPE, sel_off) == (working + 4 * t * (4 * h + 2 * 50 + 2 * i) * 2, 4 * t * h * 2)


def test_logits_are_one_chunk_and_the_reference_one_layer():
    work = Workload(tokens=5000, completion_tokens=3000, gradient_checkpointing=True, reference_forward=True)
    device, host = step_memory(FULL, SHAPE, Placement(), work)
    assert device["logits"] == 1024 * 1000 * 4 * 2  # chunk_tokens rows, not 3000
    assert device["reference forward"] == 5000 * (4 * 100 + 2 * 300) * 2
    small = step_memory(FULL, SHAPE, Placement(), Workload(tokens=100, completion_tokens=40))[0]
    assert small["logits"] == 40 * 1000 * 8 and small["reference forward"] == 0
    plan = plan_memory(FULL, Placement(), SHAPE, work)
    assert plan.device_bytes == plan.static_bytes + sum(device.values())
    assert plan_memory(FULL, Placement()).step == {}  # without a workload: the static plan alone


def test_workload_from_the_config():
    shape = ModelShape(layers=1, hidden=1, intermediate=1, vocab=1, kv_heads=1, head_dim=1)
    cfg = build_config({"data": {"max_frames": 16, "max_pixels": 448 * 448},
                        "rollout": {"num_generations": 8, "max_completion_length": 256},
                        "learner": {"groups_per_step": 4}})
    p = prompt_tokens(cfg, shape)
    assert p == 2048 + PROMPT_TEXT_TOKENS  # 16 x 448^2 / 28^2 / 2 video tokens
    assert workload(cfg, shape).tokens == 4 * 8 * (p + 256)
    assert workload(cfg, shape, world_size=2).tokens == 2 * 8 * (p + 256)  # the step's groups over the ranks
    shared = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"shared_prompt": True})})
    assert workload(shared, shape).tokens == 4 * (p + 8 * 256) and workload(shared, shape).completion_tokens == 4 * 2048
    capped = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"micro_batch_tokens": 5000})})
    assert workload(capped, shape).tokens == 5000  # at least one sequence
    tiny = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"micro_batch_tokens": 16})})
    assert workload(tiny, shape).tokens == p + 256
    sel = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"gradient_checkpointing": True,
                                                                           "checkpoint_matmuls": True})})
    assert workload(sel, shape).checkpoint_matmuls and not workload(cfg, shape).checkpoint_matmuls
    big = build_config({})  # the defaults: data.total_pixels caps a long video
    assert prompt_tokens(big, shape) == 24576 // 2 + PROMPT_TEXT_TOKENS


def test_generator_memory_by_hand():
    parts = generator_memory(SHAPE, sequences=8, prompt_tokens=100, completion_tokens=50, dtype_bytes=2)
    # the KV cache of all 8 sequences; the prefill over the one prompt (its cache then repeated to the 8)
    assert parts == {"kv cache": 4 * 2 * 2 * 25 * 2 * 8 * 150, "prefill": 1 * 100 * (400 + 600) * 2,
                     "logits": 8 * 1000 * 8, "video features": 0.0, "vision encoder": 0.0, "attention mask": 0.0}


def test_check_fits_and_report_use_the_full_plan():
    h100 = Capacity("cuda:0 (H100)", 79.2 * GiB, 128 * GiB)
    plan = MemoryPlan({"weights": 60 * GiB}, {}, {"optimizer temporaries": 12 * GiB, "activations": 10 * GiB})
    check_fits(MemoryPlan({"weights": 60 * GiB}, {}), h100, FULL)  # the static part alone fits
    with pytest.raises(MemoryPlanError) as e:
        check_fits(plan, h100, FULL)
    msg = str(e.value)
    assert "at least 82.0 GiB" in msg and "weights 60.0 GiB; + step: optimizer temporaries 12.0 + activations 10.0 GiB" \
        in msg and "micro_batch_tokens" in msg and "\n" not in msg
    lines, fits = report(FULL, Placement(), plan, 80 * GiB)
    assert not fits and lines[2] == "  on the GPU:  weights 60.0 GiB = 60.0 GiB"
    assert lines[4] == "  + step:      optimizer temporaries 12.0 + activations 10.0 GiB = 22.0 GiB"
    assert lines[5] == "  plan:        82.0 GiB on the GPU" and "micro_batch_tokens" in lines[-1]


# --------------------------------------------------------------------------- measured peaks (H100, 2026-11-26)
@pytest.fixture(scope="module")
def real_dirs(tmp_path_factory):
    from streamgrpo.models.tiny import write_config

    root = tmp_path_factory.mktemp("real")
    return {size: str(write_config(root / size, size=size)) for size in ("3b", "7b")}


def _measured_cfg(model_dir: str, **sections):
    tree = {"model": {"name_or_path": model_dir, "tune_mm_vision": False, "dtype": "bfloat16"},
            "learner": {"bf16": True, "gradient_checkpointing": True, "groups_per_step": 1},
            "rollout": {"num_generations": 8, "max_completion_length": 256},
            "data": {"max_frames": 16, "max_pixels": 448 * 448}, "loss": {"beta": 0.04}}
    tree = copy.deepcopy(tree)
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return build_config(tree)


@pytest.mark.parametrize("size,sections,static_gib,plan_gib,measured_gib", [
    ("3b", {}, 54.7, 63.1, 58.8),
    ("3b", {"learner": {"shared_prompt": True}}, 54.7, 58.4, 56.2),
    ("7b", {"model": {"lora": {"r": 64}}}, 17.9, 29.9, 30.5),
    # 2026-11-27: bf16 parameters + float32 masters (2 + 12 bytes a trained parameter, not 4 + 8)
    ("3b", {"learner": {"master_weights": True}}, 60.5, 68.9, 63.3),
    ("3b", {"learner": {"master_weights": True, "compile": True}}, 60.5, 68.9, 62.8),
    ("3b", {"learner": {"master_weights": True, "shared_prompt": True}}, 60.5, 64.2, 61.5),
    ("7b", {"model": {"lora": {"r": 64, "dropout": 0.0}}}, 17.9, 28.5, 27.9),
    ("7b", {"model": {"lora": {"r": 64, "dropout": 0.0}}, "learner": {"compile": True}}, 17.9, 28.5, 29.4),
], ids=["3b-full-plan63.1-measured58.8", "3b-shared-prompt-plan58.4-measured56.2", "7b-lora64-plan29.9-measured30.5",
        "3b-master-plan68.9-measured63.3", "3b-master-compiled-plan68.9-measured62.8",
        "3b-master-shared-plan64.2-measured61.5", "7b-lora64-nodropout-plan28.5-measured27.9",
        "7b-lora64-nodropout-compiled-plan28.5-measured29.4"])
def test_the_plan_is_within_10pct_of_the_measured_peaks(real_dirs, size, sections, static_gib, plan_gib,
                                                        measured_gib):
    counts, place, plan = plan_for(_measured_cfg(real_dirs[size], **sections))
    assert plan.static_bytes / GiB == pytest.approx(static_gib, abs=0.05)  # the static plan, as before
    assert plan.device_bytes / GiB == pytest.approx(plan_gib, abs=0.05)
    assert abs(plan.device_bytes / GiB - measured_gib) <= 0.10 * measured_gib
    assert set(plan.step) == {"optimizer temporaries", "activations", "logits", "reference forward", "vision encoder",
                              "attention mask"}


def test_zero2_colocated_with_an_hf_generator_is_refused_before_anything_starts(real_dirs):
    """Measured: out of memory at step 2 in ZeRO-2's optimizer step (``flat_grad_partition.to(fp32)``
    allocated +11.63 GiB); the static plan (53.5 + 7.0 = 60.5 of 79 GiB) let it start."""
    cfg = _measured_cfg(real_dirs["3b"], learner={"backend": "deepspeed"}, loss={"beta": 0.0},
                        launch={"gpus": "0", "colocate": True}, rollout={"engine": "hf", "num_generators": 1})
    counts, place, plan = plan_for(cfg)
    assert (place.zero_stage, place.world_size) == (2, 1)
    assert plan.static_bytes / GiB == pytest.approx(53.5, abs=0.05)
    assert plan.step["optimizer temporaries"] / GiB == pytest.approx(11.63 + 0.37, abs=0.05)  # + reduce bucket
    generator = 2 * counts.total / GiB + generator_step_bytes(cfg, model_shape(cfg)) / GiB
    assert generator == pytest.approx(8.0, abs=0.05)  # bf16 weights 7.0 + kv cache, prefill (one prompt), logits, features
    assert 2 * counts.total / GiB + plan.static_bytes / GiB < 79  # the static plans alone fit
    assert plan.device_bytes / GiB + generator > 79
    with pytest.raises(PlacementError, match="would hold 79.7 GiB"):
        plan_placement(devices=(0,), learner_ranks=1, generators=1, colocate=True,
                       learner_gib=plan.device_bytes / GiB, generator_gib=generator, device_gib=79.0)
    from streamgrpo.commands.up import placement_for

    with pytest.raises(PlacementError, match="would hold 79.7 GiB"):
        placement_for(cfg, gpu_gib=79.0)  # `up --plan` and `up` refuse it the same way


# --------------------------------------------------------------------------- what grows with frames (issue 63)
VSHAPE = ModelShape(layers=4, hidden=100, intermediate=300, vocab=1000, kv_heads=2, head_dim=25, heads=4,
                    vision_hidden=10, vision_intermediate=30, patch_values=12, patches_per_token=4)


def test_the_step_counts_the_vision_pass_and_the_attention_mask():
    """A long video's vision pass and the decoder's L^2 mask were not in the plan: a thousand frames of
    shared prompt put tens of GiB of mask on the device that no part counted."""
    from streamgrpo.learner.memory.step import mask_bytes, vision_bytes

    work = Workload(tokens=50, completion_tokens=10, vision_patches=400, mask_elements=50 * 50)
    device, _ = step_memory(FULL, VSHAPE, Placement(), work)
    # pixels (float32 + bf16) + the kept last block + the merged features; the block's working set
    # 400 x (60 + 90) x 2 = 120,000 exceeds the decoder's transient parts by 120,000 - (logits 80,000 +
    # working 50 x (800 + 1200) x 2 = 200,000) < 0: not added
    assert device["vision encoder"] == 400 * 12 * 6 + 400 * 10 * 2 + 100 * 100 * 2
    assert vision_bytes(VSHAPE, 400) == 400 * 12 * 6 + 400 * 10 * 2 + 100 * 100 * 2 + 400 * 150 * 2
    # sdpa: the kept boolean, the call's copies beyond the MLP share of the working set (50 x 1200 x 2)
    assert device["attention mask"] == 2500 + max(0, 2500 * 4 - 50 * 1200 * 2) == 2500
    assert mask_bytes(VSHAPE, 1e6, beside=120_000) == 1e6 + 4e6 - 120_000  # quadratic in the sequence
    assert mask_bytes(VSHAPE, 100, eager=True) == 100 * (2 + 4 * 6)


def test_workload_counts_the_videos_and_the_mask_per_layout():
    tree = {"rollout": {"num_generations": 4, "max_completion_length": 10},
            "data": {"max_frames": 4, "min_frames": 2, "min_pixels": 28 * 28, "max_pixels": 28 * 28,
                     "total_pixels": 4 * 28 * 28},
            "learner": {"groups_per_step": 1}}
    rows = build_config(tree)
    p = 2 + PROMPT_TEXT_TOKENS  # 4 frames x 784 pixels / 1568 a token
    w = workload(rows, VSHAPE, flash_attn=False)
    assert w.vision_patches == 2 * 4  # the group's video once, 4 patches a token
    assert w.mask_elements == pytest.approx(4 * (p + 10) ** 2)  # G padded rows of P + C
    assert workload(rows, VSHAPE, flash_attn=True).mask_elements == 0  # flash-attention: no mask
    shared = build_config({**tree, "learner": {"groups_per_step": 1, "shared_prompt": True}})
    w = workload(shared, VSHAPE, flash_attn=True)  # the block mask needs sdpa even with flash-attn installed
    assert w.mask_elements == pytest.approx((p + 4 * 10) ** 2)


def test_the_generator_counts_its_video_features_vision_pass_and_padded_mask():
    parts = generator_memory(VSHAPE, sequences=8, prompt_tokens=100, completion_tokens=50, dtype_bytes=2,
                             prompts=2, video_tokens=40)
    assert parts["video features"] == 2 * 40 * 100 * 2  # encoded once a prompt, prefilled once a prompt
    prefill = 2 * 100 * (400 + 600) * 2
    assert parts["prefill"] == prefill
    assert parts["vision encoder"] == 2 * 160 * 12 * 6 + max(0, 2 * 160 * 150 * 2 - prefill)
    assert parts["attention mask"] == 2 * 100 * 100 * 5  # two left-padded prompts, prefilled once each
    assert generator_memory(VSHAPE, sequences=8, prompt_tokens=100, completion_tokens=50, dtype_bytes=2,
                            video_tokens=40)["attention mask"] == 0  # one prompt's copies: causal, no mask


def test_max_frames_bisects_and_names_the_part_that_grew_most():
    from streamgrpo.learner.memory.frontier import max_frames

    def parts(frames):
        return {"activations": 10.0 * frames, "attention mask": 0.01 * frames ** 2, "logits": 5.0}

    f = max_frames(parts, capacity=1000 + 5 + 10 * 60 + 0.01 * 3600 + 1, static={"weights": 1000})
    assert f.frames == 60 and f.limit == "activations" and not f.capped
    assert sum(f.parts.values()) <= 1000 + 5 + 636 + 1
    f = max_frames(parts, capacity=5 + 10 * 400 + 1600, most=1000)
    assert f.frames == 400 and f.limit == "activations"
    f = max_frames(lambda n: {"attention mask": 0.1 * n ** 2, "activations": n}, capacity=1e9, most=100)
    assert f.capped and f.frames == 100 and f.limit == "attention mask"
    f = max_frames(parts, capacity=10, static={"weights": 1000})
    assert f.frames == 0 and f.limit == "static"


def test_sequence_parallel_divides_what_grows_with_the_sequence(tmp_path):
    """``learner.sequence_parallel: 2``: a group's ranks share its groups; activations, the working set and the
    reference's forward halve; the exchange is counted; the logits, the vision pass and the block mask do not
    change; rows under sdpa need no mask (causal)."""
    tree = {"rollout": {"num_generations": 4, "max_completion_length": 10},
            "data": {"max_frames": 4, "min_frames": 2, "min_pixels": 28 * 28, "max_pixels": 28 * 28,
                     "total_pixels": 4 * 28 * 28},
            "loss": {"beta": 0.04},
            "learner": {"groups_per_step": 4, "gradient_checkpointing": True}}
    one, two = build_config(tree), build_config({**tree, "learner": {**tree["learner"], "sequence_parallel": 2}})
    w1, w2 = workload(one, VSHAPE, world_size=4, flash_attn=True), workload(two, VSHAPE, world_size=4, flash_attn=True)
    assert w2.tokens == 2 * w1.tokens and w2.local_tokens == w1.tokens  # 2 groups a rank pair: 1 a rank's worth
    assert w1.mask_elements == 0 and w2.mask_elements == 0  # flash-attention / causal sdpa over the split rows
    assert workload(two, VSHAPE, world_size=4, flash_attn=False).mask_elements == 0
    half = Workload(tokens=w2.tokens, completion_tokens=w2.completion_tokens, gradient_checkpointing=True,
                    reference_forward=True, sequence_parallel=2)
    whole = Workload(tokens=w2.tokens, completion_tokens=w2.completion_tokens, gradient_checkpointing=True,
                     reference_forward=True)
    assert activation_bytes(VSHAPE, half)[0] == pytest.approx(activation_bytes(VSHAPE, whole)[0] / 2)
    place = Placement(backend="torch", world_size=2, sequence_parallel=2)
    d_half, _ = step_memory(FULL, VSHAPE, place, half)
    d_whole, _ = step_memory(FULL, VSHAPE, place, whole)
    assert d_half["reference forward"] == pytest.approx(d_whole["reference forward"] / 2)
    assert d_half["logits"] == d_whole["logits"] and "sequence exchange" not in d_whole
    h, k = VSHAPE.hidden, VSHAPE.kv_heads * VSHAPE.head_dim
    assert d_half["sequence exchange"] == pytest.approx(half.local_tokens * 2 * (2 * h + 2 * k) * 2)
    shared = build_config({**tree, "learner": {**tree["learner"], "sequence_parallel": 2, "shared_prompt": True}})
    p = 2 + PROMPT_TEXT_TOKENS
    assert workload(shared, VSHAPE, world_size=2, flash_attn=True).mask_elements == pytest.approx(4 * (p + 40) ** 2)
    from streamgrpo.models.tiny import write_config

    two.model.name_or_path = str(write_config(tmp_path, size="3b"))
    from streamgrpo.learner.memory.step import vision_bytes

    working = 1000 * (6 * VSHAPE.vision_hidden + 3 * VSHAPE.vision_intermediate) * 2  # one block, no gradients
    assert vision_bytes(VSHAPE, 1000) - vision_bytes(VSHAPE, 1000, split=2) == pytest.approx(working / 2)
    counts, place2, plan = plan_for(two, world_size=2)
    lines, _ = report(counts, place2, plan, 80 * GiB)
    assert place2.sequence_parallel == 2 and "sequence parallel over 2" in lines[0]
