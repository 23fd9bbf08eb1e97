"""Model FLOPs per learner step (streamgrpo/learner/flops.py): hand-computed counts, torch's own FLOP counter on
the real tiny models, the 6·N·tokens rule, the real 3B/7B configs, peak FLOP/s and MFU."""

from __future__ import annotations

import types

import pytest
import torch

from streamgrpo.learner.flops import (
    FlopCounter,
    ModelShape,
    StepTokens,
    TextShape,
    Training,
    VisionShape,
    device_peak_flops,
    forward_flops,
    mfu,
    multipliers,
    peak_tflops,
    step_flops,
    vision_attention_pairs,
)
from streamgrpo.models.tiny import _REAL_VISION, REAL_SIZES

TINY_TEXT = TextShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32, vocab=576)
NO_VISION = VisionShape(depth=1, hidden=8, intermediate=8, patch_inputs=8, merge=2, out_hidden=128, gated_mlp=True)


def test_exact_count_of_a_tiny_text_step_by_hand():
    # one row of 10 tokens (6 prompt + 4 completion), everything trains, no vision, no reference
    # per layer: q 128*128 + k 128*64 + v 128*64 + o 128*128 + MLP 3*128*256 = 147456 weights; 2 layers
    # linear: 2 FLOPs * 10 tokens * 2 layers * 147456                  = 5_898_240
    # attention: QK^T and AV, 2*2 FLOPs * (4 heads*32) * 2 layers * 55 causal pairs (10*11/2) = 56_320
    # LM head at the 4 completion positions: 2 * 4 * 128 * 576           = 589_824
    shape = ModelShape(TINY_TEXT, NO_VISION)
    work = StepTokens(row_lengths=(10,), head_tokens=4)
    fwd = forward_flops(shape, work)
    assert (fwd.text, fwd.head, fwd.vision, fwd.merger, fwd.adapters) == (5_898_240 + 56_320, 589_824, 0, 0, 0)
    assert step_flops(shape, work, Training(llm=True)) == 3 * 6_544_384
    # the reference forward (beta > 0) adds one forward
    assert step_flops(shape, work, Training(llm=True, reference=True)) == 4 * 6_544_384
    # non-causal counts the whole square: 100 pairs instead of 55
    assert forward_flops(shape, work, causal=False).text == 5_898_240 + 4 * 128 * 2 * 100


def test_six_n_tokens_rule():
    """Text only, the LM head at every position, everything trains: 6·N·tokens plus the attention term
    (causal pairs), which stays under 2% of the total for rows of 16 tokens on the tiny shape."""
    shape = ModelShape(TINY_TEXT, NO_VISION)
    rows = (16,) * 8
    work = StepTokens(rows, head_tokens=sum(rows))
    n = TINY_TEXT.layers * TINY_TEXT.layer_params() + TINY_TEXT.hidden * TINY_TEXT.vocab
    got = step_flops(shape, work, Training(llm=True))
    attention = 3 * 4 * 128 * 2 * 8 * (16 * 17 // 2)
    assert got == 6 * n * sum(rows) + attention
    assert 1.0 < got / (6 * n * sum(rows)) < 1.02


def _real_config(size: str) -> dict:
    text, vision = REAL_SIZES[size]["text"], {**_REAL_VISION, **REAL_SIZES[size]["vision"]}
    return {"model_type": "qwen2_5_vl", "text_config": text,
            "vision_config": {**vision, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                              "in_channels": 3}}


@pytest.mark.parametrize("size", ["3b", "7b"])
def test_real_configs_match_the_transformers_model_built_on_meta(size):
    """The shape read from Qwen2.5-VL-3B/7B's layer sizes has exactly the matmul weights of the real
    transformers model of that config (built on the meta device: no memory)."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    cfg_dict = _real_config(size)
    config = Qwen2_5_VLConfig(text_config=dict(cfg_dict["text_config"]), vision_config=dict(cfg_dict["vision_config"]))
    shape = ModelShape.from_config(config)
    assert shape == ModelShape.from_config(cfg_dict)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d)))
    assert sum(shape.matmul_params().values()) == weights
    # 6·N·tokens for a 7B-class model at 1024 tokens a row: attention adds 12·layers·(heads·head_dim)·pairs
    t = shape.text
    work = StepTokens((1024,) * 4, head_tokens=4096)
    n = shape.matmul_params()["text"] + shape.matmul_params()["head"]
    extra = step_flops(shape, work, Training(llm=True, merger=False)) - 6 * n * 4096
    assert extra == 12 * t.layers * t.heads * t.head_dim * 4 * (1024 * 1025 // 2)


@pytest.fixture(scope="module")
def eager_models(tiny_model_dir, tiny_qwen3_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return {d: (AutoModelForImageTextToText.from_pretrained(d, attn_implementation="eager"),
                AutoProcessor.from_pretrained(d)) for d in (tiny_model_dir, tiny_qwen3_dir)}


@pytest.mark.parametrize("which", ["qwen2_5_vl", "qwen3_vl"])
def test_forward_count_equals_torch_flop_counter_on_the_tiny_model(which, eager_models, tiny_model_dir, tiny_qwen3_dir):
    """The learner's forward (completion_logprobs: one vision pass, LM head at completion positions) under
    torch's FlopCounterMode, eager attention (every matmul visible to it, full attention squares):
    exactly our forward count with ``causal=False``. 140x140 frames give Qwen2.5-VL partial windows."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.bench_learner import _group
    from streamgrpo.models.batching import build_batch
    from streamgrpo.models.logprobs import completion_logprobs

    model, proc = eager_models[tiny_model_dir if which == "qwen2_5_vl" else tiny_qwen3_dir]
    g = _group(proc, which, types.SimpleNamespace(frames=6, size=140, G=3, completion_len=7))
    batch = build_batch([g], proc.tokenizer.pad_token_id, model=model)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        completion_logprobs(model, batch)
    grids = tuple(tuple(int(x) for x in row) for row in g.video_grid_thw.tolist())
    work = StepTokens(tuple(int(batch.prompt_lens[0]) + 7 for _ in range(3)), 21, grids)
    shape = ModelShape.from_config(model.config)
    if which == "qwen2_5_vl":
        assert shape.vision.window == 2 and grids[0][1] // 2 % 2 == 1, "want a partial window"
    ours = forward_flops(shape, work, causal=False)
    assert ours.vision > 0 and ours.merger > 0
    assert counter.get_total_flops() == ours.total


def test_vision_window_pairs():
    v = VisionShape(depth=4, hidden=8, intermediate=8, patch_inputs=8, merge=2, out_hidden=8, gated_mlp=True,
                    window=2, full_blocks=1)
    # a 10x10 patch frame = 5x5 merged units, windows of 2 merged units: sides 2,2,1 -> (4+4+1)^2 merged-unit
    # squares, times merge^4 = 16 patches^2 per merged-unit pair; 3 frames
    full, windowed = vision_attention_pairs([(3, 10, 10)], v)
    assert full == 3 * 100 ** 2 and windowed == 3 * 16 * 9 * 9


def test_multipliers_per_training_mode():
    assert multipliers(Training()) == {"vision": 1, "merger": 3, "text": 3, "head": 3}  # the defaults: vision frozen
    assert multipliers(Training(vision=True)) == {"vision": 3, "merger": 3, "text": 3, "head": 3}
    # LoRA: the base is frozen, activation gradients pass through the decoder and the head (2x), vision forward only
    assert multipliers(Training(merger=False, llm=False, lora_r=8, lora_targets=("q_proj",))) == {
        "vision": 1, "merger": 1, "text": 2, "head": 2}
    # only the merger trains: gradients pass back through the frozen decoder and head
    assert multipliers(Training(merger=True, llm=False)) == {"vision": 1, "merger": 3, "text": 2, "head": 2}


def test_lora_adapters_and_reference():
    shape = ModelShape(TINY_TEXT, NO_VISION)
    work = StepTokens(row_lengths=(10,), head_tokens=4)
    lora = Training(merger=False, llm=False, lora_r=8, lora_targets=("q_proj", "v_proj", "nope"))
    fwd = forward_flops(shape, work, lora)
    assert fwd.adapters == 2 * 10 * 2 * (8 * (128 + 128) + 8 * (128 + 64))  # 'nope' is no decoder linear
    base = fwd.text + fwd.head
    assert step_flops(shape, work, lora) == 2 * base + 3 * fwd.adapters
    ref = Training(merger=False, llm=False, lora_r=8, lora_targets=("q_proj", "v_proj"), reference=True)
    assert step_flops(shape, work, ref) == 3 * base + 3 * fwd.adapters  # the reference runs without adapters


def test_step_tokens_of_accepted_groups():
    import numpy as np

    from streamgrpo.learner.state import Accepted
    from streamgrpo.wire import Completion, ScoredGroup

    def acc(prompt, lens, grids):
        comps = [Completion(np.zeros(n, np.int32), np.zeros(n, np.float32), "t", "stop", {}, 0.0) for n in lens]
        g = ScoredGroup("p", "g", 0, "m", np.zeros(prompt, np.int32), [], "a", comps)
        return Accepted("s", g, None if grids is None else {"video_grid_thw": torch.tensor(grids)}, 0)

    work = StepTokens.of_groups([acc(5, [3, 4], [[2, 4, 4]]), acc(7, [1], None)])
    assert work.row_lengths == (8, 9, 8) and work.head_tokens == 8 and work.grids == ((2, 4, 4),)
    assert work.tokens == 25 and work.patches == 32
    counter = FlopCounter(ModelShape(TINY_TEXT, NO_VISION), Training())
    tokens, flops = counter.of_groups([acc(5, [3, 4], None)])
    assert tokens == 17 and flops == step_flops(counter.shape, StepTokens((8, 9), 7), Training())


def test_shared_prompt_counts_each_prompt_once_by_hand():
    import numpy as np

    from streamgrpo.learner.state import Accepted
    from streamgrpo.wire import Completion, ScoredGroup

    def acc(prompt, lens):
        comps = [Completion(np.zeros(n, np.int32), np.zeros(n, np.float32), "t", "stop", {}, 0.0) for n in lens]
        return Accepted("s", ScoredGroup("p", "g", 0, "m", np.zeros(prompt, np.int32), [], "a", comps), None, 0)

    batch = [acc(6, [3, 4]), acc(2, [1])]
    work = StepTokens.of_groups(batch, shared_prompt=True)
    # one row per group: 6 + 3 + 4 and 2 + 1; pairs: the prompt's causal pairs, then each completion
    # token sees the prompt and its own completion's tokens up to itself
    assert work.row_lengths == (13, 3) and work.head_tokens == 8
    assert work.causal_pairs == (21 + (3 * 6 + 6) + (4 * 6 + 10)) + (3 + (1 * 2 + 1))
    shape = ModelShape(TINY_TEXT, NO_VISION)
    fwd = forward_flops(shape, work)
    assert fwd.text == 2.0 * 16 * 2 * TINY_TEXT.layer_params() + 4.0 * 4 * 32 * 2 * work.causal_pairs
    rows = StepTokens.of_groups(batch)
    assert rows.tokens == 9 + 10 + 3 and rows.causal_pairs is None
    counter = FlopCounter(shape, Training(shared_prompt=True))
    tokens, flops = counter.of_groups(batch)
    assert tokens == rows.tokens  # tokens/s counts rows whatever the layout
    assert flops == step_flops(shape, work, counter.training) < step_flops(shape, rows, counter.training)


def test_peak_table_knows_amd_instinct_by_rocm_device_names():
    assert peak_tflops("AMD Instinct MI300X") == 1307.4
    assert peak_tflops("AMD Instinct MI300X VF") == 1307.4  # a virtual function (cloud VMs)
    assert peak_tflops("AMD Instinct MI325X") == 1307.4
    assert peak_tflops("AMD Instinct MI250X") == 383.0
    assert peak_tflops("AMD Instinct MI300X", "tf32") == 653.7
    assert peak_tflops("AMD Instinct MI250X", "fp32") == 95.7
    assert peak_tflops("AMD Instinct MI300A") is None  # the APU: not listed, MFU not reported
    assert device_peak_flops(None, "AMD Instinct MI300X", "bf16") == pytest.approx(1307.4e12)


def test_peak_table_config_override_and_mfu():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.5
    assert peak_tflops("NVIDIA H100 NVL") == 835.5
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_tflops("NVIDIA GeForce RTX 4090") is None and peak_tflops(None) is None
    with pytest.raises(ValueError, match="precision"):
        peak_tflops("NVIDIA H100", "fp8")
    assert device_peak_flops(None, None, "bf16") is None  # CPU without learner.peak_tflops: MFU unknown
    assert device_peak_flops(2.0, None, "bf16") == 2e12  # configured wins, CPU too
    assert device_peak_flops(100.0, "NVIDIA H100 80GB HBM3", "bf16") == 1e14
    assert device_peak_flops(None, "NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert mfu(4e14, 2.0, 1e15) == pytest.approx(0.2)
    assert mfu(4e14, 2.0, None) is None and mfu(4e14, 0.0, 1e15) is None


def test_unknown_model_type_is_refused():
    with pytest.raises(ValueError, match="qwen2_vl"):
        ModelShape.from_config({"model_type": "qwen2_vl"})
