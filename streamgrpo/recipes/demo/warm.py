"""Format warm start for the tiny demo model (``streamgrpo model tiny --warm-format``).

A short supervised pass on demo prompts with targets ``<answer>X</answer><|im_end|>``: the format
tokens get the usual cross-entropy, the option letter X a *soft* target (the letter fed in is drawn
at random). Afterwards the model writes the answer format almost always but has learnt nothing about
which option is right (sampled accuracy stays at chance), so any accuracy GRPO reaches later is
GRPO's doing. Random hard letters instead taught the model to ignore the video, and GRPO then
stalled (measured; see the README).

Two soft targets (``letters``):

* ``uniform``: the mean log-prob of every option, for every prompt: each prompt's answer is flat
  over its options (our reading of the motion probe: it also flattens whatever the answer owed to
  the video at random initialisation).
* ``marginal``: the log of the options' total probability for every prompt, plus a flat *average*
  over the prompts of the batch that share an option set: every option is written as often, but a
  prompt's answer may still depend on its video. After it, the motion demo's model learnt the
  directions with labels sooner and in more seeds (``benchmarks/motion_probe.py``), but not by
  GRPO (README), so ``demo-motion`` keeps ``uniform``.
"""

from __future__ import annotations

import logging
import math
import random
import re
from pathlib import Path
from typing import Literal

import torch

log = logging.getLogger(__name__)

_OPTION = re.compile(r"\(([A-Z])\)")


def _options(question: str) -> list[str]:
    letters = _OPTION.findall(question)
    return sorted(set(letters)) or ["A", "B", "C"]


def append_tokens(inputs: dict, token_ids: torch.Tensor) -> dict:
    """One prompt's processor inputs with ``token_ids`` (1-D) appended as text: a row for ``collate_prompts``."""
    ids = torch.cat([inputs["input_ids"].reshape(-1), token_ids])
    row = dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids))
    if "mm_token_type_ids" in inputs:
        types = inputs["mm_token_type_ids"]
        row["mm_token_type_ids"] = torch.cat([types.reshape(-1), torch.zeros(len(token_ids), dtype=types.dtype)])
    return row


def uniform_letter_loss(logp_BV: torch.Tensor, option_ids: list[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of every row's letter against a flat target over that row's options."""
    return -torch.stack([logp_BV[i, ids].mean() for i, ids in enumerate(option_ids)]).mean()


def marginal_letter_loss(logp_BV: torch.Tensor, option_ids: list[torch.Tensor]) -> torch.Tensor:
    """The options' mass on every row, and a flat distribution over them *on average* over the rows.

    ``-mean_i log sum_{o in options_i} p_i(o)`` (write one of the options) plus, per option set,
    ``KL(flat || mean_i q_i)`` where ``q_i`` is row i's distribution over its options renormalised
    (every option as often, whatever each row prefers). Zero when every row puts all its mass on
    its options and the rows' preferences balance out; a row may still prefer one option.
    """
    mass = -torch.stack([torch.logsumexp(logp_BV[i, ids], 0) for i, ids in enumerate(option_ids)]).mean()
    rows_by_set: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(option_ids):
        rows_by_set.setdefault(tuple(ids.tolist()), []).append(i)
    spread = []
    for key, rows in rows_by_set.items():
        ids = torch.tensor(key)
        q_O = torch.stack([torch.softmax(logp_BV[i, ids], 0) for i in rows]).mean(0)
        spread.append(-torch.log(q_O).mean() - math.log(len(key)))
    return mass + torch.stack(spread).mean()


LETTER_LOSSES = {"uniform": uniform_letter_loss, "marginal": marginal_letter_loss}


def warm_format(model_dir: str | Path, *, data_cfg=None, seed: int = 0, steps: int = 60, batch_size: int = 32,
                lr: float = 3e-3, pool: int = 192,
                letters: Literal["uniform", "marginal"] = "uniform", demo=None) -> dict[str, float]:
    """Teach the answer format in place; returns {"loss_first": .., "loss_last": ..}. Without ``data_cfg``,
    the colour demo's prompts; a missing data set is made from ``demo`` (the demo config's section)."""
    if letters not in LETTER_LOSSES:
        raise ValueError(f"warm_format: letters must be one of {sorted(LETTER_LOSSES)}, got {letters!r}")
    from transformers import AutoModelForImageTextToText

    from streamgrpo.config import load_config
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs
    from streamgrpo.data.records import load_records
    from streamgrpo.data.video import load_visuals
    from streamgrpo.engines.hf import collate_prompts
    from streamgrpo.models.loading import load_processor
    from streamgrpo.recipes.demo.tasks import prepare_data

    model_dir = Path(model_dir)
    if data_cfg is None or demo is None:
        shipped = load_config("demo")
        data_cfg, demo = data_cfg or shipped.data, demo or shipped.demo
    train = Path(data_cfg.train_path)
    prepare_data(demo.model_copy(update={"make_data": True}), train, seed=seed)
    records = [r for r in load_records(train, data_cfg) if data_cfg.kinds is None or r.kind in data_cfg.kinds]
    rng = random.Random(seed)
    rng.shuffle(records)
    processor = load_processor(str(model_dir))
    tok = processor.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    vp = processor.video_processor
    factor = vp.patch_size * vp.merge_size
    tag = data_cfg.answer_tag
    end = tok.convert_tokens_to_ids("<|im_end|>")

    prompts = []
    for rec in records[:pool]:
        visuals = load_visuals(rec, data_cfg, factor=factor, temporal_patch=vp.temporal_patch_size)
        text = build_prompt_text(processor, rec, data_cfg)
        prompts.append((processor_inputs(processor, text, visuals), _options(rec.question)))
    if not prompts:
        raise ValueError(f"{train}: no records to warm up on")

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
    first = last = float("nan")
    for step in range(steps):
        rows, targets, option_ids = [], [], []
        for inp, options in (prompts[rng.randrange(len(prompts))] for _ in range(batch_size)):
            answer = tok.encode(f"<{tag}>{rng.choice(options)}</{tag}>", add_special_tokens=False) + [end]
            option_ids.append(torch.tensor([tok.convert_tokens_to_ids(o) for o in options]))
            rows.append(append_tokens(inp, torch.tensor(answer)))
            targets.append(len(answer))
        letter_pos = -3  # <answer> X </answer> <|im_end|>: the letter is third from the end
        batch = collate_prompts(rows, tok.pad_token_id)
        labels = torch.full_like(batch["input_ids"], -100)
        for i, n in enumerate(targets):
            labels[i, -n:] = batch["input_ids"][i, -n:]
        labels[:, letter_pos] = -100  # the option letter gets a soft target below
        out = model(**batch, labels=labels)
        # Soft target for the letter: "one of the options", without feeding the model random
        # answers, whose noise would teach it to ignore the video (measured: a random-letter warm
        # start made colour SFT fail to converge).
        logp = torch.log_softmax(out.logits[:, letter_pos - 1].float(), dim=-1)
        soft = LETTER_LOSSES[letters](logp, option_ids)
        loss = out.loss * (len(answer) - 1) / len(answer) + soft / len(answer)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
        if step % 20 == 0 or step == steps - 1:
            log.info("warm-format step %d/%d loss %.3f", step + 1, steps, last)
    model.save_pretrained(model_dir)
    return {"loss_first": first, "loss_last": last}
