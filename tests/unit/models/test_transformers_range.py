"""The admitted transformers range (pyproject.toml): what each release offers is checked, never assumed.

Runs in the main venv (the pinned release, constraints.txt) and, by ``make test-tf-low``, against the
lowest admitted release in ``.venv-tf-low`` (``STREAMGRPO_EXPECT_TRANSFORMERS`` names it, so that run
cannot silently test the pinned one). The core is the agreement test: on the tiny random Qwen2.5-VL and
Qwen3-VL in float32, with real videos and an image, the learner's log-probs in every layout and on every
vision path equal one plain forward per row. On 5.17, whose forward swallows ``mm_encoder_outputs`` in
``**kwargs``, passing it anyway is shown to be wrong (the learner would train blind to the video).
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import replace

import pytest
import torch
from test_logprobs import _grads, _load, _three_groups

from streamgrpo.models import capabilities as C
from streamgrpo.models.batching import build_batch
from streamgrpo.models.logprobs import completion_logprobs, per_row_logprobs

LOWEST, PINNED = "5.17", "5.24"


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# ------------------------------------------------------------------------------ stand-ins (pure)
class _Text:
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, use_cache=None,
                visual_pos_masks=None, deepstack_visual_embeds=None, **kwargs):
        pass


class _Inner517:
    """The signatures of transformers 5.17's Qwen3VLModel."""

    def __init__(self):
        self.language_model = _Text()
        self.visual = type("V", (), {"deepstack_merger_list": [object()]})()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, pixel_values=None, pixel_values_videos=None, image_grid_thw=None,
                video_grid_thw=None, mm_token_type_ids=None, **kwargs):
        pass

    def get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
        pass

    def get_video_features(self, pixel_values_videos, video_grid_thw=None, **kwargs):
        pass

    def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None, **kwargs):
        pass

    def get_input_embeddings(self):
        pass


class _Inner524(_Inner517):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                pixel_values=None, pixel_values_videos=None, image_grid_thw=None, video_grid_thw=None,
                mm_token_type_ids=None, mm_encoder_outputs=None, **kwargs):
        pass


class _Config:
    image_token_id, video_token_id = 5, 6


def _model(inner_cls, checkpointing: str):
    """A stand-in ``*ForConditionalGeneration`` with ``inner_cls`` and one checkpointing switch."""
    def ckpt(self, **kw):
        pass

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
        for n in (checkpointing.replace("_enable", "_kwargs"), "every_n_layers", "offload")]
    ckpt.__signature__ = inspect.Signature(params)
    cls = type(f"Fake{inner_cls.__name__}", (), {checkpointing: ckpt, "config": _Config()})
    m = cls()
    m.model = inner_cls()
    m.model.config = _Config()
    return m


def test_takes_names_only_what_a_signature_names():
    def f(a, *, b=1, **kwargs):
        pass

    assert C.takes(f, "a") and C.takes(f, "b") and not C.takes(f, "c")
    assert C.takes(f, "c", via_kwargs=True)  # return_dict through can_return_tuple, never a model input
    assert not C.takes(None, "a") and not C.takes(lambda: 0, "x", via_kwargs=True)
    assert C.takes_all(f, "a", "b") and not C.takes_all(f, "a", "c") and not C.takes_all(None)


def test_capabilities_of_the_two_releases_signatures():
    old = C.inspect_model(_model(_Inner517, "gradient_checkpointing_enable"))
    assert not old.encoder_outputs_kwarg and old.encoder_features and old.embeds_scatter
    assert old.deepstack and old.deepstack_kwargs and old.rope_index
    assert old.vision_once == C.SCATTER
    assert (old.checkpointing, old.checkpointing_kwargs) == ("gradient_checkpointing_enable",
                                                             "gradient_checkpointing_kwargs")
    assert len(old.notices()) == 1 and "mm_encoder_outputs" in old.notices()[0] and "scattered" in old.notices()[0]
    new = C.inspect_model(_model(_Inner524, "activation_checkpointing_enable"))
    assert new.vision_once == C.ENCODER_OUTPUTS and new.notices() == []
    assert new.checkpointing == "activation_checkpointing_enable"
    # deepstack features with a language model that cannot take them: pixels per row, said so
    no_deep = replace(old, deepstack_kwargs=False)
    assert no_deep.vision_once == C.PER_ROW and "per row" in no_deep.notices()[0]
    assert replace(old, deepstack=False, deepstack_kwargs=False).vision_once == C.SCATTER
    assert replace(new, encoder_features=False).vision_once == C.PER_ROW
    bare = replace(new, checkpointing=None, rope_index=False).notices()
    assert any("get_rope_index" in n for n in bare) and any("checkpoint_every" in n for n in bare)


def test_capabilities_are_cached_per_class_and_logged_once(caplog):
    m = _model(_Inner517, "gradient_checkpointing_enable")
    try:
        with caplog.at_level(logging.WARNING, logger="streamgrpo.models.capabilities"):
            first = C.capabilities(m, role="learner")
            assert C.capabilities(type(m)()) is first  # another instance of the class: no new look
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1, lines
        assert lines[0].startswith("learner on transformers ") and "scattered into inputs_embeds" in lines[0]
    finally:
        C._CACHE.pop(type(m), None)


# ------------------------------------------------------------------------ the installed release
def test_the_release_under_test_and_what_it_offers(tiny_any_dir):
    import transformers

    expect = os.environ.get("STREAMGRPO_EXPECT_TRANSFORMERS")
    if expect:
        assert transformers.__version__ == expect, f"{transformers.__file__} is {transformers.__version__}"
    _, model = _load(tiny_any_dir)
    caps = C.capabilities(model)
    assert caps.encoder_features and caps.embeds_scatter and caps.rope_index
    assert caps.deepstack == caps.deepstack_kwargs == (model.config.model_type == "qwen3_vl")
    known = {LOWEST: (False, C.SCATTER, "gradient_checkpointing_enable"),
             PINNED: (True, C.ENCODER_OUTPUTS, "activation_checkpointing_enable")}
    minor = _minor(transformers.__version__)
    if minor not in known:
        pytest.skip(f"transformers {transformers.__version__}: neither end of the tested range")
    assert (caps.encoder_outputs_kwarg, caps.vision_once, caps.checkpointing) == known[minor]


@pytest.fixture
def force_path(monkeypatch):
    """Make the capabilities of a model's class say ``path`` (as on a release that offers only that)."""
    def force(model, path: str) -> None:
        caps = C.capabilities(model)
        if path == C.ENCODER_OUTPUTS:
            forced = replace(caps, encoder_outputs_kwarg=True)
        elif path == C.SCATTER:
            forced = replace(caps, encoder_outputs_kwarg=False)
        else:
            forced = replace(caps, encoder_features=False)
        assert forced.vision_once == path
        monkeypatch.setitem(C._CACHE, type(model), forced)
    return force


@pytest.mark.parametrize("path", [None, C.SCATTER, C.PER_ROW])
def test_learner_logprobs_equal_one_forward_per_row(tiny_any_dir, force_path, path):
    """Videos (two lengths and sizes) and an image, groups of 3 and 2: shared vision and the packed
    layout, on the release's own path (None) and on each fallback, equal the per-row reference."""
    proc, model = _load(tiny_any_dir)
    batch = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id, model=model)
    assert any(g.pixel_values_videos is not None for g in batch.groups)
    assert any(g.pixel_values is not None for g in batch.groups)
    if path is not None:
        force_path(model, path)
    m = batch.completion_mask
    with torch.no_grad():
        ref, ent_ref = per_row_logprobs(model, batch, temperature=0.7)
        shared, ent = completion_logprobs(model, batch, temperature=0.7, with_entropy=True)
        packed, ent_packed = completion_logprobs(model, batch, temperature=0.7, with_entropy=True, shared_prompt=True)
    assert (ref[m] < 0).all()
    torch.testing.assert_close(shared, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed, ent_ref, atol=1e-5, rtol=0)


def test_scattered_features_give_the_per_row_gradients(tiny_any_dir, force_path):
    """The scatter path (the only vision-once path on 5.17) trains the vision tower as the per-row one."""
    proc, model = _load(tiny_any_dir)
    groups = _three_groups(proc, model.config.model_type)
    batch = build_batch(groups, proc.tokenizer.pad_token_id, model=model)
    force_path(model, C.SCATTER)
    m = batch.completion_mask
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(0))
    g_packed = _grads(model, lambda: completion_logprobs(model, batch, temperature=0.7, shared_prompt=True)[0],
                      weights, m)
    g_row = _grads(model, lambda: per_row_logprobs(model, batch, temperature=0.7)[0], weights, m)
    assert g_packed.keys() == g_row.keys()
    assert any(k.startswith("model.visual.") and g_row[k].abs().sum() > 0 for k in g_row), "vision got no gradient"
    for k in g_row:
        torch.testing.assert_close(g_packed[k], g_row[k], atol=1e-5, rtol=1e-4, msg=lambda s, k=k: f"{k}: {s}")


def test_an_unnamed_mm_encoder_outputs_is_swallowed_so_it_is_never_passed(tiny_model_dir, force_path):
    """Where the forward does not name ``mm_encoder_outputs`` (5.17), passing it anyway runs the decoder
    on the bare placeholder embeddings: log-probs off by far more than the tolerance. This is what the
    learner did before its capabilities were checked."""
    proc, model = _load(tiny_model_dir)
    if C.capabilities(model).encoder_outputs_kwarg:
        pytest.skip(f"this release's {C.capabilities(model).inner}.forward takes mm_encoder_outputs")
    batch = build_batch(_three_groups(proc, "qwen2_5_vl"), proc.tokenizer.pad_token_id, model=model)
    force_path(model, C.ENCODER_OUTPUTS)
    m = batch.completion_mask
    with torch.no_grad():
        ref, _ = per_row_logprobs(model, batch)
        blind, _ = completion_logprobs(model, batch)
    assert (blind - ref)[m].abs().mean() > 1e-2


@pytest.mark.parametrize("every", [1, 2])
def test_layerwise_activation_checkpointing_on_this_release(tiny_model_dir, every):
    """``learner.checkpoint_every`` reaches transformers' ``every_n_layers`` on either method name."""
    from transformers import AutoModelForImageTextToText
    from transformers.modeling_layers import GradientCheckpointingLayer

    from streamgrpo.learner.building import enable_activation_checkpointing

    proc, ref_model = _load(tiny_model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    enable_activation_checkpointing(model, every=every)
    layers = [mod for mod in model.modules() if isinstance(mod, GradientCheckpointingLayer)]
    assert len(layers) > 2 and [mod.gradient_checkpointing for mod in layers] == [i % every == 0
                                                                               for i in range(len(layers))]
    batch = build_batch(_three_groups(proc, "qwen2_5_vl")[:1], proc.tokenizer.pad_token_id, model=ref_model)
    m = batch.completion_mask
    lp, _ = completion_logprobs(model, batch)
    (lp * m).sum().backward()
    assert any(p.grad is not None for p in model.parameters())
