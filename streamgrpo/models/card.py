"""Model cards: a README.md in every checkpoint and merged model (base model, data, rewards, loss
settings, steps, final metrics), so a checkpoint explains itself on the hub or on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _count_records(path: str) -> int | None:
    p = Path(path)
    if not p.is_file():
        return None
    if p.suffix == ".jsonl":
        with open(p) as fh:
            return sum(1 for line in fh if line.strip())
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return len(data) if isinstance(data, list) else None


def model_card(cfg, state: dict[str, Any], last_metrics: dict[str, Any] | None = None) -> str:
    """Markdown model card with YAML front matter (the hub's metadata block)."""
    last = last_metrics or {}
    rewards = "\n".join(f"| `{r.name}` | {r.weight} | `{json.dumps(r.params)}` |" for r in cfg.rewards.functions)
    n = _count_records(cfg.data.train_path)
    metrics_rows = "\n".join(
        f"| {k} | {v:.4f} |" for k, v in sorted(
            [(k, v) for k, v in last.items() if isinstance(v, (int, float)) and k not in ("time", "step", "version")]
            + [(f"reward/{k}", v) for k, v in (last.get("rewards") or {}).items()]
        ) if v is not None
    )
    return f"""---
base_model: {cfg.model.name_or_path}
library_name: transformers
pipeline_tag: image-text-to-text
tags: [streamgrpo, grpo, video, qwen-vl]
---

# {Path(cfg.run_dir).name}: GRPO-trained with streamgrpo

- **Base model:** `{cfg.model.name_or_path}`
- **Data:** `{cfg.data.train_path}` ({n if n is not None else "unknown number of"} records; kinds: {cfg.data.kinds or "all"})
- **Steps:** {state.get("step", 0)} optimizer steps, policy version {state.get("version", 0)},
  {state.get("groups_trained", 0)} groups trained (G = {cfg.rollout.num_generations}); dropped: {state.get("dropped", {})}
- **Loss:** `{cfg.loss.loss_type}`, epsilon {cfg.loss.epsilon} / epsilon_high {cfg.loss.epsilon_high}, beta {cfg.loss.beta},
  scale_rewards `{cfg.loss.scale_rewards}`, max_staleness {cfg.learner.max_staleness}
- **Optimiser:** AdamW lr {cfg.learner.learning_rate} ({cfg.learner.lr_schedule}, warm-up {cfg.learner.warmup_steps}),
  max_grad_norm {cfg.learner.max_grad_norm}
- **Sampling:** temperature {cfg.rollout.temperature}, top_p {cfg.rollout.top_p}, top_k {cfg.rollout.top_k},
  max {cfg.rollout.max_completion_length} new tokens, prompt format `{cfg.data.prompt_format}`

## Rewards

| function | weight | params |
|---|---|---|
{rewards}

## Final metrics (last step)

| metric | value |
|---|---|
{metrics_rows or "| (none yet) | |"}

## Use

```python
from transformers import AutoModelForImageTextToText, AutoProcessor
model = AutoModelForImageTextToText.from_pretrained("path/to/this/dir")
processor = AutoProcessor.from_pretrained("path/to/this/dir")
```
or `streamgrpo infer --model path/to/this/dir --video clip.mp4 --prompt "..."`.
"""
