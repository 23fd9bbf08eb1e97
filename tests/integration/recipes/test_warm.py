"""The format warm start covers exactly the option letters of the prompts it is given.

Found while building the motion demo: a model warmed on the colour questions ("(A) red (B) green
(C) blue") almost never writes "D", so GRPO on the four-way direction question never samples the
right answer for "down" and direction accuracy is capped near 0.75. ``demo-motion`` therefore warms
its own model on direction prompts.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from streamgrpo.config import load_config


def _letter_probs(model_dir, data_cfg) -> dict[str, float]:
    """P(letter | prompt + "<answer>") of each of A-D, averaged over the direction prompts of data_cfg."""
    from transformers import AutoModelForImageTextToText

    from streamgrpo.data.prompts import build_prompt_text, processor_inputs
    from streamgrpo.data.records import load_records
    from streamgrpo.data.video import load_visuals
    from streamgrpo.models.loading import load_processor

    processor = load_processor(str(model_dir))
    tok = processor.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    vp = processor.video_processor
    letters = [tok.convert_tokens_to_ids(c) for c in "ABCD"]
    tag = tok.encode(f"<{data_cfg.answer_tag}>", add_special_tokens=False)
    records = [r for r in load_records(data_cfg.train_path, data_cfg) if r.kind == "direction"][:6]
    assert records
    probs = torch.zeros(4)
    for rec in records:
        visuals = load_visuals(rec, data_cfg, factor=vp.patch_size * vp.merge_size, temporal_patch=vp.temporal_patch_size)
        inputs = dict(processor_inputs(processor, build_prompt_text(processor, rec, data_cfg), visuals))
        ids = torch.cat([inputs["input_ids"].reshape(1, -1), torch.tensor([tag])], dim=1)
        inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
        if "mm_token_type_ids" in inputs:
            extra = torch.zeros(1, len(tag), dtype=inputs["mm_token_type_ids"].dtype)
            inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"].reshape(1, -1), extra], dim=1)
        with torch.no_grad():
            logits = model(**inputs).logits[0, -1]
        probs += torch.softmax(logits.float(), -1)[letters]
    return dict(zip("ABCD", (probs / len(records)).tolist()))


def test_warm_start_on_direction_prompts_makes_every_letter_likely(tiny_model_dir, demo_data_dir, tmp_path):
    from streamgrpo.recipes.demo.warm import warm_format

    train = f"data.train_path={demo_data_dir / 'train.jsonl'}"
    colour = load_config("demo", [train]).data
    direction = load_config("demo-motion", [train, "demo.motion=mirror"]).data
    assert direction.kinds == ["direction"]
    runs = {}
    for name, data_cfg in (("colour", colour), ("direction", direction)):
        work = tmp_path / name
        shutil.copytree(tiny_model_dir, work)
        warm_format(work, data_cfg=data_cfg, seed=0, steps=25, batch_size=8, pool=8)
        runs[name] = _letter_probs(work, direction)
    # warmed on direction prompts: the four letters share the mass, "D" as much as the others
    assert sum(runs["direction"].values()) > 0.8
    assert min(runs["direction"].values()) > 0.1
    # warmed on colour prompts: "D" is almost never written (the trap the motion demo avoids)
    assert runs["colour"]["D"] < 0.05 < min(runs["colour"][c] for c in "ABC")


def test_marginal_warm_start_also_makes_every_letter_likely(tiny_model_dir, demo_data_dir, tmp_path):
    """``letters="marginal"`` (demo-motion's) only balances the letters on average; averaged over
    prompts every letter is still written, and the format is learnt as well as with ``uniform``."""
    from streamgrpo.recipes.demo.warm import warm_format

    train = f"data.train_path={demo_data_dir / 'train.jsonl'}"
    direction = load_config("demo-motion", [train, "demo.motion=mirror"]).data
    runs = {}
    for letters in ("uniform", "marginal"):
        work = tmp_path / letters
        shutil.copytree(tiny_model_dir, work)
        runs[letters] = warm_format(work, data_cfg=direction, seed=0, steps=25, batch_size=8, pool=8, letters=letters)
        probs = _letter_probs(work, direction)
        assert sum(probs.values()) > 0.8, (letters, probs)
        assert min(probs.values()) > 0.1, (letters, probs)
    assert runs["marginal"]["loss_last"] < runs["marginal"]["loss_first"]
    with pytest.raises(ValueError, match="letters must be one of"):
        warm_format(tmp_path / "uniform", data_cfg=direction, letters="flat")
