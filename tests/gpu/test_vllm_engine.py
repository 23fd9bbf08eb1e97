"""The vLLM engine on a GPU (CUDA build of vLLM: ``pip install 'streamgrpo[gpu]'``); skipped without CUDA.

The same checks as tests/integration/engines/test_vllm_cpu.py, on the engine directly: groups for prompts
with one video, four videos and an image whose prompt ids are the processor's; behaviour log-probs
equal to the learner's recomputation (same model, same GPU); a new weight version changes the
outputs; a partial (LoRA-merged) update is completed to whole layers.

``STREAMGRPO_GPU_TEST_ON_CPU=1`` runs the file on CPU with vllm-cpu (inside .venv-vllm), to check
the test itself on a machine without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

ON_CPU = os.environ.get("STREAMGRPO_GPU_TEST_ON_CPU") == "1"
if not torch.cuda.is_available() and not ON_CPU:
    pytest.skip("needs CUDA (and vLLM's CUDA build)", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'streamgrpo[gpu]'")

DEVICE = "cpu" if ON_CPU else "cuda"
TOL = 1e-2


@pytest.fixture(scope="module")
def setup(tiny_model_dir, demo_data_dir):
    from streamgrpo.config import build_config
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs, vision_factors
    from streamgrpo.data.records import load_records
    from streamgrpo.data.video import load_visuals
    from streamgrpo.engines.base import PromptRequest
    from streamgrpo.engines.vllm import VLLMEngine
    from streamgrpo.models.loading import load_model, load_processor

    cfg = build_config({}, [
        f"model.name_or_path={tiny_model_dir}", "model.dtype=float32", f"data.train_path={demo_data_dir}/train.jsonl",
        "data.min_frames=8", "data.max_frames=8", "data.prompt_format=no_think",
        "rollout.engine=vllm", "rollout.vllm.max_model_len=2048", "rollout.vllm.gpu_memory_utilization=0.3",
        "rollout.vllm.enforce_eager=true", "rollout.vllm.cpu_kv_cache_gib=1",
        "rollout.vllm.limit_mm_per_prompt={video: 4, image: 1}",
    ])
    processor = load_processor(str(tiny_model_dir))
    factor, tp = vision_factors(processor)
    videos = load_records(demo_data_dir / "train.jsonl", cfg.data)
    images = load_records(demo_data_dir / "train_image.jsonl", cfg.data)
    picked = [next(r for r in videos if len(r.videos) == 1), next(r for r in videos if len(r.videos) == 4), images[0]]
    requests = []
    for rec in picked:
        visuals = load_visuals(rec, cfg.data, factor=factor, temporal_patch=tp)
        text = build_prompt_text(processor, rec, cfg.data)
        requests.append(PromptRequest(text, visuals, processor_inputs(processor, text, visuals), rec.id))
    engine = VLLMEngine.from_config(cfg, processor)
    model = load_model(cfg.model, DEVICE)
    yield {"engine": engine, "model": model, "processor": processor, "requests": requests}
    engine.close()


def _gap(model, processor, req, group, temperature=1.0) -> float:
    from streamgrpo.models.batching import GroupInputs, build_batch, vision_token_ids
    from streamgrpo.models.logprobs import completion_logprobs

    g = GroupInputs.from_processor(req.inputs, [torch.from_numpy(c.token_ids.astype(np.int64)) for c in group])
    tb = build_batch([g], processor.tokenizer.pad_token_id, model).to(DEVICE)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, tb, temperature=temperature, suppress_token_ids=vision_token_ids(processor))
    return max(float((lp[i, : len(c.logprobs)].cpu() - torch.from_numpy(c.logprobs)).abs().max())
               for i, c in enumerate(group))


def _sample(setup, seed=0):
    from streamgrpo.engines.base import SamplingParams

    return setup["engine"].generate(setup["requests"], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=seed))


def test_groups_match_the_learner(setup):
    from streamgrpo.models.batching import vision_token_ids

    outs = _sample(setup)
    banned = set(vision_token_ids(setup["processor"]))
    for req, group in zip(setup["requests"], outs):
        assert len(group) == 4
        for c in group:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 12 and np.all(np.isfinite(c.logprobs))
            assert not banned & set(c.token_ids.tolist())
        assert _gap(setup["model"], setup["processor"], req, group) < TOL


def _perturb(model, seed: float, select) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if select(n):
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))


def test_new_weights_change_the_outputs(setup):
    from streamgrpo.engines.vllm_io import EngineError

    model, engine, proc, reqs = setup["model"], setup["engine"], setup["processor"], setup["requests"]
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        # v1: a LoRA-merged update (q/v of layer 0 only): completed to whole layers from the checkpoint
        lora_like = [n for n in base if ".layers.0.self_attn.q_proj.weight" in n or ".layers.0.self_attn.v_proj.weight" in n]
        assert len(lora_like) == 2
        _perturb(model, 1, lambda n: n in lora_like)
        engine.load_weights(1, {n: p.detach().cpu() for n, p in model.named_parameters() if n in lora_like})
        outs = _sample(setup, seed=1)
        assert max(_gap(model, proc, r, grp) for r, grp in zip(reqs, outs)) < TOL
        # v2: every weight, the language model moved
        _perturb(model, 2, lambda n: "language_model" in n)
        engine.load_weights(2, {n: p.detach().cpu() for n, p in model.named_parameters()})
        assert engine.version == 2
        outs = _sample(setup, seed=2)
        assert max(_gap(model, proc, r, grp) for r, grp in zip(reqs, outs)) < TOL
        moved = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
        assert max(_gap(model, proc, r, grp) for r, grp in zip(reqs, outs)) > 10 * TOL  # not the base's samples
        # a partial update now would revert k_proj & co. to the checkpoint: refused, nothing applied
        with pytest.raises(EngineError, match="send whole layers"):
            engine.load_weights(3, {n: base[n].cpu() for n in lora_like})
        assert engine.version == 2
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(moved[n])
        outs = _sample(setup, seed=3)
        assert max(_gap(model, proc, r, grp) for r, grp in zip(reqs, outs)) < TOL
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
