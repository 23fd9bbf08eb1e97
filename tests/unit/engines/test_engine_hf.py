"""HF rollout engine on the tiny model: batched multi-prompt sampling, behaviour log-probs, weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamgrpo.engines.base import PromptRequest, SamplingParams, cut_at_stop
from streamgrpo.engines.hf import HFEngine, collate_prompts, suppressed_token_ids
from streamgrpo.wire import Visual


def _video(size, frames, colour):
    v = np.full((frames, size, size, 3), 128, dtype=np.uint8)
    for t in range(frames):
        x = t * (size - 14) // max(frames - 1, 1)
        v[t, 20:34, x : x + 14] = colour
    return v


def _request(proc, frames, colour, question):
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    video = _video(56, frames, colour)
    inputs = proc(text=[text], videos=[video], return_tensors="pt",
                  videos_kwargs={"do_sample_frames": False, "fps": 2.0})
    return PromptRequest(text, [Visual("video", video, 2.0, np.arange(frames, dtype=np.int32))], inputs)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    from streamgrpo.models.loading import load_processor

    proc = load_processor(str(tiny_model_dir))
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    return HFEngine(model, proc)


def test_cut_at_stop():
    assert cut_at_stop(np.array([5, 6, 9, 7]), {9}) == (3, "stop")
    assert cut_at_stop(np.array([5, 6, 7]), {9}) == (3, "length")


def test_collate_left_pads_and_concatenates_visuals(engine):
    proc = engine.processor
    a = _request(proc, 8, (220, 30, 30), "Colour?")
    b = _request(proc, 4, (30, 220, 30), "What colour is the moving square shape?")
    batch = collate_prompts([a.inputs, b.inputs], pad_token_id=0)
    la, lb = a.inputs["input_ids"].shape[1], b.inputs["input_ids"].shape[1]
    width = max(la, lb)
    assert batch["input_ids"].shape == (2, width)
    assert torch.equal(batch["input_ids"][0, width - la:], a.inputs["input_ids"][0])
    assert torch.equal(batch["input_ids"][1, width - lb:], b.inputs["input_ids"][0])
    assert batch["attention_mask"].sum().item() == la + lb
    assert batch["video_grid_thw"].shape[0] == 2
    assert batch["pixel_values_videos"].shape[0] == a.inputs["pixel_values_videos"].shape[0] + b.inputs["pixel_values_videos"].shape[0]


def test_generate_groups_with_logprobs_and_no_vision_tokens(engine):
    proc = engine.processor
    reqs = [_request(proc, 8, (220, 30, 30), "Colour? (A) red (B) green (C) blue"),
            _request(proc, 4, (30, 30, 220), "Which colour?")]
    out = engine.generate(reqs, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=0))
    assert len(out) == 2 and all(len(g) == 4 for g in out)
    banned = set(suppressed_token_ids(proc.tokenizer))
    assert banned, "the tiny tokenizer has vision tokens"
    for group in out:
        for c in group:
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
            assert not banned & set(c.token_ids.tolist())
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in engine.stop_ids
            else:
                assert len(c.token_ids) == 8


def test_seed_makes_sampling_reproducible(engine):
    req = [_request(engine.processor, 8, (220, 30, 30), "Colour?")]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=123)
    a = engine.generate(req, sp)
    b = engine.generate(req, sp)
    assert [c.token_ids.tolist() for c in a[0]] == [c.token_ids.tolist() for c in b[0]]


def test_every_token_is_stamped_with_the_version_it_was_sampled_under(engine):
    req = [_request(engine.processor, 4, (220, 30, 30), "Colour?")]
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=0)
    before = engine.version
    first = engine.generate(req, sampling)[0]
    name, p = next(iter(engine.model.named_parameters()))
    engine.load_weights(before + 3, {name: p.detach().clone()})  # same values, a newer version
    second = engine.generate(req, sampling)[0]
    for c in first:
        assert c.versions.dtype == np.int32 and c.versions.tolist() == [before] * len(c.token_ids)
    for c in second:
        assert c.versions.tolist() == [before + 3] * len(c.token_ids)


def test_load_weights_in_place_and_checks(engine):
    name, p = next(iter(engine.model.named_parameters()))
    ptr = p.data_ptr()
    new = torch.full_like(p, 0.01)
    engine.load_weights(7, {name: new})
    assert engine.version == 7 and p.data_ptr() == ptr and torch.equal(p.detach(), new)
    with pytest.raises(KeyError, match="not a parameter"):
        engine.load_weights(8, {"nope.weight": new})
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights(8, {name: torch.zeros(3)})
    assert engine.version == 7


# ------------------------------------------------------------- log-probs captured in the loop
def _output_scores_path(engine, requests, sampling, **extra):
    """The previous implementation, as a reference: ``output_scores=True`` with generate's own warpers,
    every step's processed logits stacked into a float32 (B, L, V) tensor, ``log_softmax``, gather."""
    batch = collate_prompts([r.inputs for r in requests], engine.pad_id)
    width = batch["input_ids"].shape[1]
    greedy = sampling.temperature == 0
    kwargs = dict(max_new_tokens=sampling.max_tokens, num_return_sequences=1 if greedy else sampling.n,
                  output_scores=True, return_dict_in_generate=True, eos_token_id=engine.stop_ids,
                  pad_token_id=engine.pad_id, suppress_tokens=engine.suppress_ids, **extra)
    if greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k if sampling.top_k > 0 else None)
    torch.manual_seed(sampling.seed)
    with torch.no_grad():
        out = engine.model.generate(**batch, **kwargs)
    new = out.sequences[:, width:]
    scores = torch.stack(out.scores, dim=1).float()
    return new, torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)


def _compare(engine, requests, sampling, got, **extra):
    new, lp = _output_scores_path(engine, requests, sampling, **extra)
    rows = 0
    for i, group in enumerate(got):
        for j, c in enumerate(group):
            row = i if sampling.temperature == 0 else i * sampling.n + j
            n = len(c.token_ids)
            assert c.token_ids.tolist() == new[row, :n].tolist()
            np.testing.assert_allclose(c.logprobs, lp[row, :n].numpy(), atol=1e-5, rtol=0)
            rows += 1
    return rows


@pytest.mark.parametrize("sampling", [
    SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=3),
    SamplingParams(n=3, temperature=0.7, top_k=7, top_p=0.9, max_tokens=10, seed=5),
    SamplingParams(n=2, temperature=0, max_tokens=8, seed=0),  # greedy
], ids=["t1", "t0.7-topk-topp", "greedy"])
def test_logprobs_captured_in_the_loop_equal_the_output_scores_path(engine, sampling):
    proc = engine.processor
    reqs = [_request(proc, 8, (220, 30, 30), "Colour? (A) red (B) green (C) blue"),
            _request(proc, 4, (30, 30, 220), "Which colour?")]
    got = engine.generate(reqs, sampling)
    assert _compare(engine, reqs, sampling, got) == 2 * sampling.n
    assert any(len(c.token_ids) > 1 for g in got for c in g)


def test_the_recorder_keeps_one_step_of_scores_and_b_floats_per_step():
    from streamgrpo.engines.hf import LogprobRecorder

    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, 50, generator=g) for _ in range(4)]
    tokens = torch.randint(0, 50, (3, 4), generator=g)
    rec = LogprobRecorder()
    prompt = torch.zeros(3, 5, dtype=torch.long)
    for t, s in enumerate(steps):
        assert rec(torch.cat([prompt, tokens[:, :t]], 1), s) is s  # passes the scores through
        assert all(x.shape == (3,) for x in rec.steps) and len(rec.steps) == t
    want = torch.stack([torch.log_softmax(s, -1).gather(-1, tokens[:, t, None]).squeeze(-1)
                        for t, s in enumerate(steps)], 1)
    torch.testing.assert_close(rec.finish(tokens), want, atol=1e-6, rtol=0)
    assert rec._scores is None  # the last (B, V) step is freed
    # a step run past the last returned token (a deferred stop check) is dropped
    rec = LogprobRecorder()
    for t, s in enumerate(steps):
        rec(torch.cat([prompt, tokens[:, :t]], 1), s)
    torch.testing.assert_close(rec.finish(tokens[:, :3]), want[:, :3], atol=1e-6, rtol=0)


def test_checkpoint_generation_config_cannot_reshape_the_distribution(engine):
    """A checkpoint's repetition penalty (Qwen2.5-VL-Instruct ships 1.05) would make behaviour log-probs come from a
    distribution the learner never recomputes; the engine switches it off."""
    proc = engine.processor
    reqs = [_request(proc, 8, (220, 30, 30), "Colour? (A) red (B) green (C) blue")]
    sampling = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7)
    cfg = engine.model.generation_config
    before = cfg.repetition_penalty
    assert before in (None, 1.0)
    try:
        cfg.repetition_penalty = 3.0
        got = engine.generate(reqs, sampling)
        assert _compare(engine, reqs, sampling, got, repetition_penalty=1.0) == 3  # as without the penalty
        with pytest.raises(AssertionError):  # the old path applied it
            _compare(engine, reqs, sampling, got)
    finally:
        cfg.repetition_penalty = before


# ------------------------------------------------------------- the prompt prefilled once per group
def _count_passes(model):
    """Forward hooks on the real model: vision patches per call of the tower, (rows, columns) of each decoder
    call over more than one column (a prefill)."""
    seen = {"vision": [], "prefill": []}

    def vision(_m, args, kwargs, _out):
        x = args[0] if args else kwargs["hidden_states"]
        seen["vision"].append(int(x.shape[0]))

    def decoder(_m, args, kwargs, _out):
        x = kwargs.get("inputs_embeds")
        if x is not None and x.shape[1] > 1:
            seen["prefill"].append((int(x.shape[0]), int(x.shape[1])))

    hooks = [model.model.visual.register_forward_hook(vision, with_kwargs=True),
             model.model.language_model.register_forward_hook(decoder, with_kwargs=True)]
    return seen, hooks


@pytest.mark.parametrize("sampling", [SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=11),
                                      SamplingParams(n=3, temperature=0, max_tokens=8, seed=0)],
                         ids=["sampled", "greedy"])
def test_the_prompt_is_prefilled_once_per_group_with_the_same_tokens(tiny_any_dir, sampling):
    """The vision tower and the decoder's prompt pass run once per prompt, not G times, and sample the same
    tokens with the same log-probs as the whole prompt given to generate G times (the previous path)."""
    from transformers import AutoModelForImageTextToText

    from streamgrpo.models.loading import load_processor

    proc = load_processor(str(tiny_any_dir))
    model = AutoModelForImageTextToText.from_pretrained(tiny_any_dir).eval()
    once, per_sample = HFEngine(model, proc), HFEngine(model, proc, prompt_once=False)
    assert once.cache_kw is not None
    reqs = [_request(proc, 8, (220, 30, 30), "Colour? (A) red (B) green (C) blue"),
            _request(proc, 4, (30, 30, 220), "Which colour?")]
    patches = sum(int(r.inputs["pixel_values_videos"].shape[0]) for r in reqs)
    width = collate_prompts([r.inputs for r in reqs], 0)["input_ids"].shape[1]
    rows = 1 if sampling.temperature == 0 else sampling.n
    runs = {}
    for name, eng in (("once", once), ("per_sample", per_sample)):
        seen, hooks = _count_passes(model)
        try:
            runs[name] = eng.generate(reqs, sampling)
        finally:
            for h in hooks:
                h.remove()
        runs[name + "_seen"] = seen
    assert runs["once_seen"]["vision"] == [patches]
    assert runs["once_seen"]["prefill"] == [(2, width - 1)]
    # the previous path: the decoder's prompt pass over G rows a prompt (transformers 5.24's generate encodes the
    # visuals once before expanding them; older releases ran the tower on the expanded pixels, G times)
    assert runs["per_sample_seen"]["prefill"] == [(2 * rows, width)]
    assert runs["per_sample_seen"]["vision"] in ([patches], [patches * rows])
    for a, b in zip(runs["once"], runs["per_sample"]):
        assert len(a) == len(b) == sampling.n
        for x, y in zip(a, b):
            assert x.token_ids.tolist() == y.token_ids.tolist()
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
            assert x.finish_reason == y.finish_reason
    assert any(len(c.token_ids) > 1 for g in runs["once"] for c in g)


# ------------------------------------------------------------- vision features kept by visual
def _hf(model_dir, **kw):
    from transformers import AutoModelForImageTextToText

    from streamgrpo.models.loading import load_processor

    proc = load_processor(str(model_dir))
    return HFEngine(AutoModelForImageTextToText.from_pretrained(model_dir).eval(), proc, **kw)


def _needs_encoder_outputs(engine):
    if engine.vision_cache is None:  # transformers 5.17 (make test-tf-low): the engine says so and runs without
        pytest.skip("this transformers release's forward takes no mm_encoder_outputs: no vision-feature cache")


def _tower_calls(model):
    calls = []
    hook = model.model.visual.register_forward_hook(lambda _m, args, _out: calls.append(int(args[0].shape[0])))
    return calls, hook


def test_a_video_that_returns_skips_the_vision_tower_with_the_same_logprobs(tiny_any_dir):
    """Two groups on the same video (two questions): the second runs no vision tower and samples what an engine
    without the cache samples; T-GRPO's shuffled frames are another visual."""
    from streamgrpo.data.shuffle import shuffle_visuals
    from streamgrpo.metrics import VISION_CACHE, VISION_CACHE_BYTES

    cached, plain = _hf(tiny_any_dir, vision_cache_mib=64), _hf(tiny_any_dir)
    _needs_encoder_outputs(cached)
    proc = cached.processor
    sampling = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=4)
    first = _request(proc, 8, (220, 30, 30), "Colour? (A) red (B) green (C) blue")
    again = _request(proc, 8, (220, 30, 30), "Which colour is the square?")  # the same frames, another question
    hits, misses = (VISION_CACHE.labels(result=r)._value.get() for r in ("hit", "miss"))
    calls, hook = _tower_calls(cached.model)
    try:
        cached.generate([first], sampling)
        assert len(calls) == 1 and cached.vision_cache.nbytes > 0
        assert VISION_CACHE_BYTES._value.get() == cached.vision_cache.nbytes
        got = cached.generate([again], sampling)
        assert len(calls) == 1  # the second group ran no vision tower
        shuffled = shuffle_visuals(again.visuals, np.random.default_rng(0))
        inputs = proc(text=[again.prompt_text], videos=[shuffled[0].frames], return_tensors="pt",
                      videos_kwargs={"do_sample_frames": False, "fps": 2.0})
        cached.generate([PromptRequest(again.prompt_text, shuffled, inputs)], sampling)
        assert len(calls) == 2  # other frames, other features
    finally:
        hook.remove()
    assert VISION_CACHE.labels(result="hit")._value.get() - hits == 1
    assert VISION_CACHE.labels(result="miss")._value.get() - misses == 2
    want = plain.generate([again], sampling)
    for x, y in zip(got[0], want[0]):
        assert x.token_ids.tolist() == y.token_ids.tolist()
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


def test_the_cache_evicts_past_its_bytes_and_empties_when_the_vision_tower_changes(tiny_model_dir):
    eng = _hf(tiny_model_dir, vision_cache_mib=1)
    _needs_encoder_outputs(eng)
    proc = eng.processor
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=2, seed=0)
    red, blue = _request(proc, 8, (220, 30, 30), "Colour?"), _request(proc, 8, (30, 30, 220), "Colour?")
    eng.generate([red], sampling)
    one = eng.vision_cache.nbytes
    eng.vision_cache.lru.max_bytes = one + one // 2  # room for one video's features, not two
    eng.generate([blue], sampling)
    assert eng.vision_cache.nbytes == one and len(eng.vision_cache.lru) == 1  # red was evicted
    calls, hook = _tower_calls(eng.model)
    try:
        eng.generate([blue], sampling)
        assert calls == []  # blue is kept
        eng.generate([red], sampling)
        assert len(calls) == 1  # red was not
        # a version that leaves the vision tower as it is keeps the features; one that changes it empties them
        name, p = next((n, p) for n, p in eng.model.named_parameters() if ".visual." in f".{n}")
        lm_name, lm_p = next((n, p) for n, p in eng.model.named_parameters() if ".visual." not in f".{n}")
        eng.load_weights(1, {name: p.detach().clone(), lm_name: lm_p.detach().clone()})
        assert len(eng.vision_cache.lru) == 1
        eng.load_weights(2, {name: p.detach() + 0.01})
        assert eng.vision_cache.nbytes == 0
        # two questions on one video in one call: the tower runs once, over that video alone
        eng.generate([red, _request(proc, 8, (220, 30, 30), "Which colour is it?")], sampling)
        assert calls[1:] == [int(red.inputs["pixel_values_videos"].shape[0])]
    finally:
        hook.remove()


def test_the_vision_cache_lru_by_bytes():
    from streamgrpo.engines.vision_features import Features, VisionFeatureCache

    cache = VisionFeatureCache(max_bytes=3 * 400)
    f = [Features(torch.zeros(10, 10), None, object) for _ in range(4)]  # 400 bytes each
    for i, x in enumerate(f):
        cache.lru.put(("video", str(i), (1, 2, 2)), x)
    assert cache.nbytes == 1200 and cache.lru.get(("video", "0", (1, 2, 2))) is None
    deep = Features(torch.zeros(10, 10), (torch.zeros(10, 10), torch.zeros(10, 10)), object)
    assert deep.nbytes == 1200
