"""The vLLM engine's pure parts, without vLLM: requests, sampling parameters, output parsing,
weight names (both archs), the m-RoPE position rule, the tensor wire format and the install error.

The engine itself runs in tests/integration/engines/test_vllm_cpu.py (vllm-cpu, `make test-vllm`) and
tests/gpu/test_vllm_engine.py (CUDA).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from streamgrpo.config import DataConfig, build_config
from streamgrpo.data.prompts import build_prompt_text, processor_inputs, vision_factors
from streamgrpo.data.records import Record, load_records
from streamgrpo.data.video import load_visuals
from streamgrpo.engines.base import PromptRequest, SamplingParams
from streamgrpo.engines.vllm import (
    INSTALL_HINT,
    VLLMNotInstalled,
    llm_kwargs,
    mm_limits,
    resolve_arch,
)
from streamgrpo.engines.vllm_io import (
    MM_PROCESSOR_KWARGS,
    EngineError,
    build_request,
    completion_logprobs,
    image_item,
    parse_outputs,
    sampling_kwargs,
    video_item,
)
from streamgrpo.engines.vllm_worker import (
    WeightNameError,
    check_names,
    missing_for_reload,
    normalize_name,
    pack_tensor,
    transformers_mrope_positions,
    unpack_tensor,
    vllm_module,
    vllm_param_name,
)
from streamgrpo.metrics import ERRORS
from streamgrpo.wire import Visual

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _processor(model_dir):
    from streamgrpo.models.loading import load_processor

    return load_processor(str(model_dir))


def _errors(kind: str) -> float:
    return ERRORS.labels(kind=kind)._value.get()


# ------------------------------------------------------------------------------------ requests
def _requests(model_dir, demo_dir):
    """Real demo records with 0 (text only), 1 and 4 videos, and 1 image, as the generator builds them."""
    proc = _processor(model_dir)
    factor, tp = vision_factors(proc)
    cfg = DataConfig(prompt_format="no_think", min_frames=4, max_frames=8)
    videos = load_records(demo_dir / "train.jsonl", cfg)
    images = load_records(demo_dir / "train_image.jsonl", cfg)
    picked = [next(r for r in videos if len(r.videos) == 1), next(r for r in videos if len(r.videos) == 4), images[0],
              Record("text", "What colour is a tomato? (A) red (B) green", "(A) red", "(A) red")]
    reqs = []
    for rec in picked:
        visuals = load_visuals(rec, cfg, factor=factor, temporal_patch=tp)
        text = build_prompt_text(proc, rec, cfg)
        reqs.append(PromptRequest(text, visuals, processor_inputs(proc, text, visuals), rec.id))
    return proc, reqs


def _as_vllm_processor_call(proc, prompt: dict):
    """What vLLM's Qwen-VL multimodal processor hands the HF processor for one prompt dict: the
    videos split from their metadata (``do_sample_frames`` is a processor kwarg, not metadata)."""
    mm = prompt.get("multi_modal_data", {})
    kwargs = {k: dict(v) for k, v in prompt.get("mm_processor_kwargs", {}).items()}
    call = {"text": [prompt["prompt"]], "return_tensors": "pt"}
    if "video" in mm:
        call["videos"] = [frames for frames, _ in mm["video"]]
        meta = [{k: v for k, v in m.items() if k != "do_sample_frames"}
                for _, m in mm["video"]]
        call["videos_kwargs"] = {**kwargs["videos_kwargs"], "video_metadata": meta}
    if "image" in mm:
        call["images"] = list(mm["image"])
        call["images_kwargs"] = kwargs["images_kwargs"]
    return proc(**call)


def test_requests_carry_the_exact_frames_and_processor_settings(tiny_any_dir, demo_data_dir):
    proc, reqs = _requests(tiny_any_dir, demo_data_dir)
    seen = set()
    for req in reqs:
        prompt = build_request(req)
        assert prompt["prompt"] == req.prompt_text
        mm = prompt.get("multi_modal_data", {})
        vids = [v for v in req.visuals if v.kind == "video"]
        imgs = [v for v in req.visuals if v.kind == "image"]
        seen.add((len(vids), len(imgs)))
        assert len(mm.get("video", [])) == len(vids) and len(mm.get("image", [])) == len(imgs)
        if not req.visuals:
            assert "multi_modal_data" not in prompt and "mm_processor_kwargs" not in prompt
            continue
        assert prompt["mm_processor_kwargs"] == MM_PROCESSOR_KWARGS  # no resize, no frame sampling
        for (frames, meta), v in zip(mm.get("video", []), vids):
            assert frames.dtype == np.uint8 and np.array_equal(frames, v.frames)
            assert meta["frames_indices"] == v.frame_indices.tolist() and meta["fps"] == v.fps
            assert meta["total_num_frames"] == int(v.frame_indices.max()) + 1 and meta["do_sample_frames"] is False
            assert (meta["height"], meta["width"]) == v.frames.shape[1:3]
        for img, v in zip(mm.get("image", []), imgs):
            assert np.array_equal(img, v.frames[0])
        # the HF processor given what vLLM is given reproduces the generator's inputs exactly
        again = _as_vllm_processor_call(proc, prompt)
        for key, want in req.inputs.items():
            assert torch.equal(torch.as_tensor(again[key]), torch.as_tensor(want)), key
    assert seen == {(1, 0), (4, 0), (0, 1), (0, 0)}


def test_request_items_reject_bad_visuals():
    with pytest.raises(ValueError, match="uint8 T x H x W x 3"):
        video_item(Visual("video", np.zeros((2, 28, 28), np.uint8), 2.0, np.arange(2, dtype=np.int32)))
    with pytest.raises(ValueError, match="3 frames but 2 frame indices"):
        video_item(Visual("video", np.zeros((3, 28, 28, 3), np.uint8), 2.0, np.arange(2, dtype=np.int32)))
    with pytest.raises(ValueError, match="image must be uint8 1 x H x W x 3"):
        image_item(Visual("image", np.zeros((2, 28, 28, 3), np.uint8)))
    with pytest.raises(ValueError, match="unknown visual kind"):
        build_request(PromptRequest("x", [Visual("audio", np.zeros((1, 28, 28, 3), np.uint8))], {}, "r1"))
    frames, meta = video_item(Visual("video", np.zeros((2, 28, 28, 3), np.uint8), 0.0, np.array([0, 5], np.int32)))
    assert meta["fps"] == 24.0 and meta["total_num_frames"] == 6  # unknown source fps: the processor default


# ------------------------------------------------------------------------------------ sampling
def test_sampling_params_mapping():
    kw = sampling_kwargs(SamplingParams(n=8, temperature=0.7, top_p=0.9, top_k=0, max_tokens=64, stop=("</answer>",),
                                        seed=3), suppress_ids=[405, 402], stop_ids=[401, 2])
    assert kw == {"n": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_tokens": 64, "logprobs": 0,
                  "flat_logprobs": True, "skip_special_tokens": True, "include_stop_str_in_output": True,
                  "stop": ["</answer>"], "stop_token_ids": [2, 401], "seed": 3,
                  "logit_bias": {402: float("-inf"), 405: float("-inf")}}
    greedy = sampling_kwargs(SamplingParams(n=4, temperature=0.0, top_p=0.5, top_k=5, max_tokens=8))
    assert (greedy["n"], greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (1, 0.0, 1.0, 0)
    assert "logit_bias" not in greedy and "stop" not in greedy and "seed" not in greedy
    assert sampling_kwargs(SamplingParams(top_k=20))["top_k"] == 20


# ------------------------------------------------------------------------------------- outputs
class _Flat:
    """Shaped like vllm.logprobs.FlatLogprobs."""

    def __init__(self, per_position: list[list[tuple[int, float]]]):
        self.start_indices, self.end_indices, self.token_ids, self.logprobs = [], [], [], []
        for entries in per_position:
            self.start_indices.append(len(self.logprobs))
            for t, lp in entries:
                self.token_ids.append(t)
                self.logprobs.append(lp)
            self.end_indices.append(len(self.logprobs))


def _completion(index, ids, lps, finish="length", stop_reason=None, flat=True, text="t"):
    if flat:
        logprobs = _Flat([[(t, lp)] for t, lp in zip(ids, lps)])
    else:
        logprobs = [{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(ids, lps)]
    return SimpleNamespace(index=index, token_ids=list(ids), logprobs=logprobs, text=text, finish_reason=finish,
                           stop_reason=stop_reason)


def _output(prompt_ids, comps):
    return SimpleNamespace(prompt_token_ids=list(prompt_ids), outputs=comps)


def test_parse_outputs_groups_in_order():
    outs = [_output([1, 2, 3], [_completion(1, [7, 8, 9], [-0.5, -1.0, -2.0], "stop", 9),
                                _completion(0, [4, 5], [-0.1, -0.2], flat=False)]),
            _output([4], [_completion(1, [6], [-3.0]), _completion(0, [6, 2], [-1.5, -0.25], "stop", "</a>")])]
    groups = parse_outputs(outs, 2, prompt_ids=[np.array([1, 2, 3]), [4]], request_ids=["a", "b"])
    assert [len(g) for g in groups] == [2, 2]
    first = groups[0][0]  # sorted by CompletionOutput.index
    assert first.token_ids.dtype == np.int32 and first.logprobs.dtype == np.float32
    assert first.token_ids.tolist() == [4, 5] and first.logprobs.tolist() == pytest.approx([-0.1, -0.2])
    assert groups[0][1].finish_reason == "stop" and groups[0][1].extra == {"stop_reason": 9}
    assert groups[1][0].extra == {"stop_reason": "</a>"} and groups[1][1].extra == {}
    greedy = parse_outputs([_output([1], [_completion(0, [3, 4], [-0.1, -0.3])])], 3, greedy=True)
    assert len(greedy[0]) == 3 and all(c.token_ids.tolist() == [3, 4] for c in greedy[0])


def test_flat_logprobs_with_extra_ranks_take_the_sampled_token():
    comp = _completion(0, [5, 6], [-1.0, -2.0])
    comp.logprobs = _Flat([[(5, -1.0), (9, -0.5)], [(6, -2.0), (9, -0.1)]])  # sampled first, then top-1
    assert completion_logprobs(comp).tolist() == [-1.0, -2.0]


def test_parse_outputs_refuses_what_the_trainer_cannot_use():
    before = _errors("engine")
    with pytest.raises(EngineError, match="request 'r0'.*differs from the processor"):
        parse_outputs([_output([1, 2], [_completion(0, [3], [-1.0])])], 1, prompt_ids=[[1, 2, 3]], request_ids=["r0"])
    with pytest.raises(EngineError, match="finish_reason 'abort'"):
        parse_outputs([_output([1], [_completion(0, [3], [-1.0], "abort")])], 1)
    with pytest.raises(EngineError, match="returned 1 completions, expected 2"):
        parse_outputs([_output([1], [_completion(0, [3], [-1.0])])], 2)
    comp = _completion(0, [3, 4], [-1.0])
    comp.logprobs = None
    with pytest.raises(EngineError, match="no logprobs"):
        parse_outputs([_output([1], [comp])], 1)
    assert _errors("engine") == before + 4


# ------------------------------------------------------------------------------- weight names
def _hf_names(model_dir) -> list[str]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    return [n for n, _ in model.named_parameters()]


def _checkpoint_names(model_dir) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
        return list(fh.keys())


# Parameter counts of the tiny models inside vLLM 0.32 (measured with the engine: 43 and 58).
VLLM_PARAMS = {"qwen2_5_vl": 43, "qwen3_vl": 58}


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_weight_names_map_onto_vllm_parameters(arch, tiny_model_dir, tiny_qwen3_dir):
    model_dir = tiny_model_dir if arch == "qwen2_5_vl" else tiny_qwen3_dir
    names = _hf_names(model_dir)
    targets = [vllm_param_name(n, arch) for n in names]
    assert len(set(targets)) == len(names)  # no two learner tensors land in the same place
    assert len({t for t, _ in targets}) == VLLM_PARAMS[arch]
    # the checkpoint's own names (Qwen2.5-VL files still say model.layers.* / visual.*) land in the same places
    assert sorted(vllm_param_name(n, arch) for n in _checkpoint_names(model_dir)) == sorted(targets)
    mapped = dict(zip(names, targets))
    assert mapped["model.language_model.layers.0.self_attn.k_proj.weight"] == \
        ("language_model.model.layers.0.self_attn.qkv_proj.weight", "k")
    assert mapped["model.language_model.layers.1.mlp.up_proj.weight"] == \
        ("language_model.model.layers.1.mlp.gate_up_proj.weight", 1)
    assert mapped["lm_head.weight"] == ("language_model.lm_head.weight", None)
    assert mapped["model.visual.blocks.0.attn.qkv.weight"] == ("visual.blocks.0.attn.qkv.weight", None)
    if arch == "qwen2_5_vl":  # its vision MLP is gated: fused in vLLM
        assert mapped["model.visual.blocks.0.mlp.gate_proj.weight"] == ("visual.blocks.0.mlp.gate_up_proj.weight", 0)
    else:
        assert mapped["model.visual.blocks.0.mlp.linear_fc1.weight"] == ("visual.blocks.0.mlp.linear_fc1.weight", None)
        assert mapped["model.language_model.layers.0.self_attn.q_norm.weight"][1] is None
    vllm_names = sorted({t for t, _ in targets})
    assert check_names(names, arch, vllm_names) == names
    with pytest.raises(WeightNameError, match="1 weight.*'model.language_model.layers.9.mlp.up_proj.weight'"):
        check_names([*names, "model.language_model.layers.9.mlp.up_proj.weight"], arch, vllm_names)
    tied = check_names(names, arch, [v for v in vllm_names if "lm_head" not in v], tied_lm_head=True)
    assert "lm_head.weight" not in tied and len(tied) == len(names) - 1


def test_weight_name_wrappers_and_unknown_names():
    assert normalize_name("module._orig_mod.model.visual.blocks.0._checkpoint_wrapped_module.attn.qkv.weight") == \
        "model.visual.blocks.0.attn.qkv.weight"
    assert normalize_name("base_model.model.model.language_model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.language_model.layers.0.self_attn.q_proj.weight"
    assert vllm_param_name("model.layers.3.self_attn.v_proj.bias", "qwen2_5_vl") == \
        ("language_model.model.layers.3.self_attn.qkv_proj.bias", "v")
    with pytest.raises(WeightNameError, match="'decoder.x.weight': not a qwen3_vl"):
        vllm_param_name("decoder.x.weight", "qwen3_vl")
    with pytest.raises(ValueError, match="unknown arch 'llama'"):
        vllm_param_name("lm_head.weight", "llama")
    assert vllm_module("model.language_model.layers.0.mlp.gate_proj.weight", "qwen3_vl") == \
        "language_model.model.layers.0.mlp.gate_up_proj"


def test_partial_update_is_completed_to_whole_layers(tiny_model_dir):
    ckpt = _checkpoint_names(tiny_model_dir)  # legacy names: model.layers.*
    lora_merged = ["model.language_model.layers.0.self_attn.q_proj.weight",
                   "model.language_model.layers.0.self_attn.v_proj.weight",
                   "model.language_model.layers.1.mlp.up_proj.weight"]
    assert missing_for_reload(lora_merged, ckpt, "qwen2_5_vl") == [
        "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias",
        "model.layers.1.mlp.gate_proj.weight"]
    assert missing_for_reload(_hf_names(tiny_model_dir), ckpt, "qwen2_5_vl") == []  # a full version
    assert missing_for_reload(["model.language_model.norm.weight"], ckpt, "qwen2_5_vl") == []


# ---------------------------------------------------------------------------------- positions
def _video(t: int, h: int, w: int, seed: int) -> Visual:
    rng = np.random.default_rng(seed)
    return Visual("video", rng.integers(0, 255, (t, h, w, 3), dtype=np.uint8), 2.0, np.arange(t, dtype=np.int32))


def test_position_rule_equals_the_learners(tiny_model_dir):
    """transformers_mrope_positions (what vLLM is switched to) == the learner's prompt positions,
    for videos whose temporal extent is below, equal to and above their spatial extent."""
    from transformers import AutoModelForImageTextToText

    from streamgrpo.models.batching import GroupInputs, prompt_positions

    proc = _processor(tiny_model_dir)
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir)).eval()
    vc = model.config.vision_config
    merge = vc.spatial_merge_size
    cases = [[_video(16, 56, 56, 0)], [_video(2, 112, 168, 1)], [_video(8, 56, 112, 2), _video(4, 56, 56, 3)],
             [Visual("image", np.full((1, 84, 56, 3), 90, np.uint8)), _video(6, 56, 56, 4)], []]
    differs = 0
    for visuals in cases:
        content = [{"type": v.kind} for v in visuals] + [{"type": "text", "text": "Which colour? Answer."}]
        text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=False)
        inputs = processor_inputs(proc, text, visuals)
        group = GroupInputs.from_processor(inputs, [])
        want = prompt_positions(model, group).numpy()
        ids = group.prompt_ids.tolist()
        grids = iter(group.video_grid_thw.tolist() if group.video_grid_thw is not None else [])
        secs = iter(torch.as_tensor(inputs.get("second_per_grid_ts", [])).tolist())
        images = iter(group.image_grid_thw.tolist() if group.image_grid_thw is not None else [])
        blocks, i = [], 0
        while i < len(ids):  # (offset, t, h, w, t_factor) per vision block, as vLLM's iter_mm_grid_thw yields
            if ids[i] in (model.config.video_token_id, model.config.image_token_id):
                video = ids[i] == model.config.video_token_id
                t, h, w = next(grids) if video else next(images)
                tf = next(secs) * vc.tokens_per_second if video else 1.0
                blocks.append((i, t, h // merge, w // merge, tf))
                i += t * (h // merge) * (w // merge)
                differs += video and (t - 1) * tf + 1 > max(h, w) // merge
            else:
                i += 1
        pos, delta = transformers_mrope_positions(len(ids), blocks)
        assert pos.shape == want.shape and np.array_equal(pos, want)
        assert delta == int(want[0, -1]) + 1 - len(ids)  # completion i at last prompt position + 1 + i
    assert differs >= 2  # cases where vLLM's own rule would give other positions


def test_position_rule_rejects_overlapping_blocks():
    with pytest.raises(ValueError, match="overlaps"):
        transformers_mrope_positions(20, [(2, 1, 2, 2, 1.0), (4, 1, 2, 2, 1.0)])
    with pytest.raises(ValueError, match="past the prompt"):
        transformers_mrope_positions(5, [(2, 2, 2, 2, 1.0)])
    pos, delta = transformers_mrope_positions(4, [])
    assert pos.tolist() == [[0, 1, 2, 3]] * 3 and delta == 0


# ------------------------------------------------------------------------------ tensor packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_pack_unpack_round_trip(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    name, shape, buf = pack_tensor(t.t())  # non-contiguous in
    back = unpack_tensor(name, shape, bytes(buf))
    assert back.dtype == dtype and back.shape == (5, 3) and torch.equal(back, t.t())
    empty = unpack_tensor(*pack_tensor(torch.zeros(0, 4, dtype=dtype)))
    assert empty.shape == (0, 4)


def test_unpack_checks_size_and_dtype():
    with pytest.raises(ValueError, match="8 bytes for float32 \\[3\\]"):
        unpack_tensor("float32", [3], bytes(8))
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        unpack_tensor("float99", [1], bytes(4))


# --------------------------------------------------------------------------------- engine args
def test_llm_kwargs_and_limits(tiny_model_dir, demo_data_dir):
    counts = [(len(r.videos), len(r.images)) for r in load_records(demo_data_dir / "train.jsonl", DataConfig())]
    limits = mm_limits(counts, max_frames=8, max_pixels=3136, factor=28)
    assert limits == {"video": {"count": 4, "num_frames": 8, "width": 56, "height": 56},
                      "image": {"count": 0, "width": 56, "height": 56}}
    cfg = build_config({}, [f"model.name_or_path={tiny_model_dir}", "model.dtype=float32", "seed=5",
                            "rollout.vllm.max_model_len=2048", "rollout.vllm.enforce_eager=true"])
    kw = llm_kwargs(cfg, limits=limits, seed=7)
    assert kw["model"] == str(tiny_model_dir) and kw["dtype"] == "float32" and kw["seed"] == 7
    assert kw["max_model_len"] == 2048 and kw["enforce_eager"] is True and kw["enable_prefix_caching"] is True
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    assert kw["worker_extension_cls"] == "streamgrpo.engines.vllm_worker.StreamGRPOWorkerExtension"
    assert kw["limit_mm_per_prompt"] == limits and kw["limit_mm_per_prompt"] is not limits
    assert "max_model_len" not in llm_kwargs(build_config({}, []), limits={}, seed=0)
    assert resolve_arch(cfg.model) == "qwen2_5_vl"
    assert resolve_arch(build_config({}, ["model.arch=qwen3_vl"]).model) == "qwen3_vl"


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_selecting_vllm_without_it_says_how_to_install(tiny_model_dir):
    from streamgrpo.engines.vllm import VLLMEngine

    cfg = build_config({}, [f"model.name_or_path={tiny_model_dir}", "rollout.engine=vllm"])
    before = _errors("engine")
    with pytest.raises(VLLMNotInstalled) as info:
        VLLMEngine.from_config(cfg, _processor(tiny_model_dir))
    msg = str(info.value)
    assert "pip install 'streamgrpo[gpu]'" in msg and "make setup-vllm" in msg and msg.startswith(INSTALL_HINT)
    assert isinstance(info.value, ImportError) and _errors("engine") == before + 1


def test_cpu_compat_hook_is_idempotent_and_inert():
    import sys

    from streamgrpo.engines import vllm_cpu_compat as compat

    n = len(sys.meta_path)
    compat.install()
    compat.install()
    hooks = [f for f in sys.meta_path if isinstance(f, compat._TorchvisionHook)]
    try:
        assert len(hooks) == 1 and len(sys.meta_path) == n + 1
        assert hooks[0].find_spec("numpy") is None  # never imports anything itself
    finally:
        for h in hooks:
            sys.meta_path.remove(h)


def test_token_versions_split_each_sequence_where_the_weights_changed():
    from streamgrpo.engines.base import TokenVersions

    tv = TokenVersions(3)
    keys = [("a", 0), ("a", 1), ("b", 0)]
    tv.seen(("a", 0), 2)
    tv.seen(("a", 1), 2)
    assert not tv.started(keys)  # b has not sampled a token yet (still in prefill)
    tv.seen(("b", 0), 1)
    assert tv.started(keys)
    tv.update(5)  # after a's 2 tokens and b's 1
    tv.seen(("a", 0), 3)  # a/0 finishes with 3 tokens; the others go on
    tv.seen(("a", 1), 4)
    tv.seen(("b", 0), 3)
    tv.update(6)
    assert tv.of(("a", 0), 3).tolist() == [3, 3, 5]  # it stopped before v6
    assert tv.of(("a", 1), 6).tolist() == [3, 3, 5, 5, 6, 6]
    assert tv.of(("b", 0), 4).tolist() == [3, 5, 5, 6]
    assert tv.of(("c", 0), 2).tolist() == [6, 6]  # never seen before an update: every token is new
    assert tv.of(("a", 1), 6).dtype == np.int32
    assert TokenVersions(7).of(("a", 0), 3).tolist() == [7, 7, 7]  # no update: the batch's version
