"""Real ScoredGroups without a generator process: for tests, benchmarks and learner experiments.

:func:`sample_groups` runs the same steps a generator runs (records -> visuals -> chat prompt ->
processor -> HF engine sampling G completions with behaviour log-probs) and builds one
:class:`~streamgrpo.wire.ScoredGroup` per prompt with the generator's own :func:`score_group`. Rewards are synthetic by default (alternating
1/0 within a group, so every group carries gradient); pass ``score`` to use real reward functions.
:meth:`streamgrpo.learner.state.Accepted.directly` turns them into what ``Learner.train_step`` takes (a fixed
sequence of groups, fed directly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from streamgrpo.rewards.combine import ScoredRewards


def sample_groups(
    model_dir: str | Path, records_path: str | Path, n_groups: int, *, num_generations: int = 4,
    max_tokens: int = 6, seed: int = 0, data_overrides: Sequence[str] = (), temperature: float = 1.0,
    score: Callable[[list[str], str], list[float]] | None = None, policy_version: int = 0, media: str = "inline",
) -> list[Any]:
    """``n_groups`` ScoredGroups of real prompts (demo records) and completions sampled by ``model_dir``.

    ``media``: ``inline`` (self-contained groups, the default here) or ``reference`` (visuals name their
    files under ``records_path``'s directory, as a generator with ``rollout.media: reference`` sends them)."""
    from streamgrpo.config import build_config
    from streamgrpo.data.dataset import iter_samples
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs, vision_factors
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.base import PromptRequest, SamplingParams
    from streamgrpo.engines.hf import HFEngine
    from streamgrpo.generator.sampling import score_group
    from streamgrpo.models.loading import load_model, load_processor
    from streamgrpo.wire import inline

    overrides = [f"data.train_path={records_path}", f"model.name_or_path={model_dir}", "model.dtype=float32",
                 "data.min_frames=4", "data.max_frames=4", "data.min_pixels=3136", "data.max_pixels=3136",
                 "data.prompt_format=no_think", *data_overrides]
    cfg = build_config({}, overrides)
    processor = load_processor(str(model_dir))
    engine = HFEngine(load_model(cfg.model, "cpu"), processor)
    factor, temporal = vision_factors(processor)
    records = load_records(records_path, cfg.data)
    samples = iter_samples(records, cfg.data, shard=0, num_shards=1, seed=seed, epochs=None, factor=factor,
                           temporal_patch=temporal)
    sampling = SamplingParams(n=num_generations, temperature=temperature, max_tokens=max_tokens, seed=seed)
    rewards = _GivenRewards(score)
    groups = []
    for i in range(n_groups):
        record, visuals = next(samples)
        text = build_prompt_text(processor, record, cfg.data)
        req = PromptRequest(text, visuals, processor_inputs(processor, text, visuals), record.id)
        torch.manual_seed(seed * 100_003 + i)
        outs = engine.generate([req], SamplingParams(**{**sampling.__dict__, "seed": None}))[0]
        outs = [replace(c, versions=None) for c in outs]  # no token versions: a test may move policy_version
        group = score_group(record, visuals, req, outs, rewards, version=policy_version, generator_id="rollouts",
                            model_id=str(model_dir), temperature=temperature)
        groups.append(replace(group if media == "reference" else inline(group), group_id=f"g{seed}-{i:05d}"))
    return groups


class _GivenRewards:
    """Rewards for :func:`sample_groups`: ``score(texts, answer)`` (default: 1/0 alternating) as ``accuracy``
    and the total, 1 minus it as ``format`` (the interface of :meth:`streamgrpo.rewards.RewardSet.score`)."""

    def __init__(self, score: Callable[[list[str], str], list[float]] | None):
        self.fn = score

    def score(self, texts: list[str], answer: str, **_) -> ScoredRewards:
        values = [float(r) for r in self.fn(texts, answer)] if self.fn else [float(j % 2) for j in range(len(texts))]
        return ScoredRewards(totals=values, per_fn={"accuracy": values, "format": [1.0 - r for r in values]})
