"""T-GRPO on the tiny Qwen2.5-VL with real demo videos: the generator samples a second group on
shuffled frames, scores it, adds the `temporal` bonus to the ordered completions, and sends only the
ordered group (the shuffled completions never reach the learner)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="module")
def setup(tiny_model_dir, demo_data_dir):
    from streamgrpo.config import load_config
    from streamgrpo.data.dataset import iter_samples
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs, vision_factors
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.base import PromptRequest, SamplingParams
    from streamgrpo.engines.hf import HFEngine
    from streamgrpo.models.loading import load_model, load_processor

    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}",
                               "data.min_frames=4", "data.max_frames=4", "rollout.max_completion_length=4",
                               "rollout.num_generations=3", "rollout.temperature=1.0", "data.kinds=null"])
    processor = load_processor(str(tiny_model_dir))
    engine = HFEngine(load_model(cfg.model, "cpu"), processor)
    factor, temporal = vision_factors(processor)
    records = load_records(cfg.data.train_path, cfg.data)
    chunk = list(zip(range(2), iter_samples(records, cfg.data, shard=0, num_shards=1, seed=0, epochs=None,
                                            factor=factor, temporal_patch=temporal)))
    chunk = [s for _, s in chunk]
    requests = []
    for record, visuals in chunk:
        text = build_prompt_text(processor, record, cfg.data)
        requests.append(PromptRequest(text, visuals, processor_inputs(processor, text, visuals), record.id))
    sampling = SamplingParams.from_config(cfg.rollout)
    outs = engine.generate(requests, sampling)
    return cfg, processor, engine, chunk, requests, sampling, outs


def _groups(setup, **contrast):
    from streamgrpo.config import TemporalContrastConfig
    from streamgrpo.generator.sampling import sample_shuffled, score_group
    from streamgrpo.rewards import RewardSet

    cfg, processor, engine, chunk, requests, sampling, outs = setup
    tc = TemporalContrastConfig(num_generations=2, **contrast)
    shuffled = sample_shuffled(engine, processor, requests, sampling, tc, np.random.default_rng(0))
    rewards = RewardSet(cfg)
    groups = [score_group(record, visuals, req, out, rewards, version=3, generator_id="g", model_id="m",
                          temperature=1.0, shuffled=shuffled.get(i), contrast=tc)
              for i, ((record, visuals), req, out) in enumerate(zip(chunk, requests, outs))]
    return groups, shuffled


def test_shuffled_group_decides_the_bonus_and_never_travels(setup):
    from streamgrpo.wire import decode, encode

    cfg, _, _, chunk, requests, _, outs = setup
    # every answer counts as correct (correct_at=0): p = p_shuffled = 1 > 0.5 * 1, so the bonus applies
    groups, shuffled = _groups(setup, alpha=0.3, mu=0.5, correct_at=0.0)
    assert sorted(shuffled) == [0, 1] and all(len(s) == 2 for s in shuffled.values())  # G' = 2 per video prompt
    for i, g in enumerate(groups):
        assert len(g.completions) == cfg.rollout.num_generations  # only the ordered G
        assert [c.token_ids.tolist() for c in g.completions] == [list(o.token_ids) for o in outs[i]]
        assert all(np.array_equal(a.frames, b.frames) for a, b in zip(g.visuals, requests[i].visuals))  # ordered frames
        assert g.meta["temporal"] == {"p": 1.0, "p_shuffled": 1.0, "applied": True}
        for c in g.completions:
            assert c.rewards["temporal"] == 0.3
            assert c.reward == pytest.approx(sum(c.rewards[k] * w for k, w in
                                                 [(s.name, s.weight) for s in cfg.rewards.functions]) + 0.3)
        back = decode(encode(g))
        assert len(back.completions) == cfg.rollout.num_generations and "temporal" in back.completions[0].rewards
    # mu = 1: p == p_shuffled does not beat it, no bonus
    groups, _ = _groups(setup, alpha=0.3, mu=1.0, correct_at=0.0)
    assert all(c.rewards["temporal"] == 0.0 and not g.meta["temporal"]["applied"] for g in groups for c in g.completions)


def test_the_contrast_group_sees_shuffled_frames_and_image_prompts_are_skipped(setup):
    from streamgrpo.config import TemporalContrastConfig
    from streamgrpo.data.shuffle import shuffle_visuals
    from streamgrpo.engines.base import PromptRequest
    from streamgrpo.generator.sampling import sample_shuffled
    from streamgrpo.wire import Visual

    _, processor, _, _, requests, sampling, _ = setup
    mixed = shuffle_visuals(requests[0].visuals, np.random.default_rng(0))
    assert not all(np.array_equal(a.frames, b.frames) for a, b in zip(mixed, requests[0].visuals))
    image = PromptRequest("x", [Visual("image", np.zeros((1, 56, 56, 3), np.uint8))], None, "img")
    # image-only prompts: nothing is sampled (the engine is not even called)
    assert sample_shuffled(None, processor, [image], sampling, TemporalContrastConfig(), np.random.default_rng(0)) == {}


def test_a_group_is_as_old_as_its_oldest_token(setup):
    """Per-token versions from the engine reach the wire; staleness (and max_staleness) counts from the oldest."""
    import copy

    from streamgrpo.generator.sampling import score_group
    from streamgrpo.rewards import RewardSet
    from streamgrpo.wire import decode, encode

    cfg, _, engine, chunk, requests, _, outs = setup
    assert all(c.versions.tolist() == [engine.version] * len(c.token_ids) for c in outs[0])  # HF: the batch's version
    out = copy.deepcopy(outs[0])
    n = len(out[1].token_ids)
    out[1].versions = np.array([4] * (n // 2) + [6] * (n - n // 2), dtype=np.int32)  # as if updated mid-completion
    for c in [c for i, c in enumerate(out) if i != 1]:
        c.versions = np.full(len(c.token_ids), 6, dtype=np.int32)
    (record, visuals), req = chunk[0], requests[0]
    g = score_group(record, visuals, req, out, RewardSet(cfg), version=6, generator_id="g", model_id="m",
                    temperature=1.0)
    assert g.policy_version == 4  # not the version the batch ended on
    back = decode(encode(g))
    assert back.completions[1].versions.tolist() == out[1].versions.tolist()
    assert back.completions[0].versions.tolist() == [6] * len(out[0].token_ids)
