"""``streamgrpo check agreement``: do the generator and the learner compute the same policy?

It loads the model as a generator does (the configured engine, ``rollout.device``, ``model.dtype``,
``model.attn_implementation``) and as the learner does (:class:`~streamgrpo.learner.trainer.Learner`:
its device, master dtype, autocast, backend, vision-once path), samples ``groups`` prompts of the
training data with the generator's own :class:`~streamgrpo.generator.sampling.Sampler` at version
0, recomputes every sampled token's log-prob along the learner's own path and compares
(:mod:`streamgrpo.agreement`). When they disagree it tries one switch at a time and names the first
under which they agree: vision per row (the learner only), fp32 and eager attention (both roles),
one prompt per batch (the generator), no KV cache (the generator's model scores its own tokens in
one full forward; HF engine). Exit 0 when they agree, 1 when not.

``up`` runs a quick version of it before it trains (``launch.agreement_check``, one group), in a
process of its own so that every byte of its two models is freed before the run's processes start.
"""

from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamgrpo.agreement import Agreement, Verdict, verdict
from streamgrpo.commands.args import load
from streamgrpo.commands.checks import check_before_loading
from streamgrpo.config import Config, build_config
from streamgrpo.data.dataset import iter_samples
from streamgrpo.data.prompts import processor_inputs, vision_factors
from streamgrpo.engines.base import SamplingParams
from streamgrpo.generator.loop import make_engine, train_records
from streamgrpo.generator.sampling import Sampler
from streamgrpo.learner.distributed import init_distributed
from streamgrpo.learner.state import Accepted
from streamgrpo.learner.trainer import Learner
from streamgrpo.models.batching import GroupInputs, build_batch, vision_token_ids
from streamgrpo.models.loading import load_processor, resolve_device
from streamgrpo.models.logprobs import per_row_logprobs
from streamgrpo.rewards import RewardSet

log = logging.getLogger("streamgrpo.check")

DISAGREE_EXIT = 1


@dataclass
class Sampled:
    """Groups sampled by the generator's engine, and that engine (for the no-KV-cache switch)."""

    groups: list
    engine: object
    processor: object


def sample(cfg: Config, n_groups: int, max_tokens: int | None, seed: int) -> Sampled:
    """``n_groups`` groups as a generator samples them (its engine, prompts, Sampler), at version 0."""
    import torch


    processor = load_processor(cfg.model.name_or_path, cfg.model.revision)
    engine = make_engine(cfg, processor, resolve_device(cfg.rollout.device))
    params = SamplingParams.from_config(cfg.rollout, seed=seed)
    if max_tokens:
        params = SamplingParams(**{**params.__dict__, "max_tokens": min(params.max_tokens, max_tokens)})
    sampler = Sampler(engine, processor, cfg, params, RewardSet(cfg), "agreement-check",
                      np.random.default_rng(seed))
    factor, temporal = vision_factors(processor)
    samples = iter_samples(train_records(cfg), cfg.data, shard=0, num_shards=1, seed=seed, epochs=None, factor=factor,
                           temporal_patch=temporal)
    torch.manual_seed(seed)
    groups: list = []
    while len(groups) < n_groups:  # batch.size: rollout.prompts_per_batch, halved after running out of memory
        chunk = [next(samples) for _ in range(min(sampler.batch.size, n_groups - len(groups)))]
        groups += sampler.groups(chunk)
    return Sampled(groups, engine, processor)


def behaviour(groups: list) -> list[np.ndarray]:
    return [np.asarray(c.logprobs, np.float32) for g in groups for c in g.completions]


def full_forward_behaviour(s: Sampled) -> list[np.ndarray] | None:
    """The generator's model scoring its own tokens in one plain forward per row (no KV cache, one
    prompt at a time, full logits): the HF engine's incremental numbers without the increments."""
    import torch


    model = getattr(s.engine, "model", None)
    if model is None:  # vLLM: its model lives in its own worker
        return None
    device = next(model.parameters()).device
    out = []
    for g in s.groups:
        ids = [torch.as_tensor(np.asarray(c.token_ids, np.int64)) for c in g.completions]
        inputs = processor_inputs(s.processor, g.prompt_text, g.visuals)
        tb = build_batch([GroupInputs.from_processor(inputs, ids)], s.processor.tokenizer.pad_token_id).to(device)
        temperature = float((g.meta or {}).get("temperature") or 1.0)
        with torch.no_grad():
            lp, _ = per_row_logprobs(model, tb, temperature=temperature, suppress_token_ids=vision_token_ids(s.processor))
        lp = lp.float().cpu().numpy()
        out += [lp[i, : len(c.token_ids)] for i, c in enumerate(g.completions)]
    return out


def learner_logprobs(cfg: Config, groups: list, *, shared_vision: bool = True) -> list[np.ndarray]:
    """Every sampled token's log-prob along the learner's own path (a :class:`Learner` of this config)."""

    # DeepSpeed runs as one rank here (its own process group of one); the torch backend needs none
    learner = Learner(cfg, dist=init_distributed(cfg.learner.backend, dist_backend=cfg.learner.dist_backend,
                                                 sequence_parallel=cfg.learner.sequence_parallel))
    try:
        return learner.own_logprobs(Accepted.directly(groups, learner.processor), shared_vision=shared_vision)
    finally:
        del learner
        _free()


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(cfg: Config, n_groups: int, max_tokens: int | None, seed: int, *, learner_cfg: Config | None = None,
            shared_vision: bool = True, no_cache: bool = False) -> Agreement | None:
    """Sample with ``cfg``'s generator, recompute with ``learner_cfg``'s learner (default: the same)."""
    s = sample(cfg, n_groups, max_tokens, seed)
    beh = full_forward_behaviour(s) if no_cache else behaviour(s.groups)
    groups = s.groups
    close = getattr(s.engine, "close", None)
    if close is not None:  # vLLM keeps its share of the GPU until its engine core stops: the learner loads next
        close()
    del s
    _free()
    if beh is None:
        return None
    return Agreement.of(learner_logprobs(learner_cfg or cfg, groups, shared_vision=shared_vision), beh)


def _with(cfg: Config, *overrides: str) -> Config:

    return build_config(cfg.to_dict(), list(overrides))


def check_agreement(cfg: Config, *, groups: int = 2, max_tokens: int | None = 32, seed: int = 0,
                    max_kl: float | None = None, diagnose: bool = True, learner_cfg: Config | None = None,
                    say=print) -> Verdict:
    """Measure; when they disagree and ``diagnose``, flip one switch at a time. ``learner_cfg``: the
    learner's config when it differs from the generator's (a test's deliberate mismatch)."""
    limit = cfg.learner.agreement_max_kl if max_kl is None else max_kl
    lcfg = learner_cfg or cfg
    base = measure(cfg, groups, max_tokens, seed, learner_cfg=lcfg)
    assert base is not None
    say(f"staleness 0, {cfg.rollout.engine} engine vs the {lcfg.learner.backend} learner: {base.describe()}")
    tried: dict[str, Agreement] = {}
    if not base.agrees(limit) and diagnose:
        for name, run in _switches(cfg, lcfg, groups, max_tokens, seed):
            got = run()
            if got is None:
                say(f"  {name}: not tried with the {cfg.rollout.engine} engine")
                continue
            tried[name] = got
            say(f"  {name}: {got.describe()}")
            if got.agrees(limit):
                break
    return verdict(base, tried, limit)


def _switches(cfg: Config, lcfg: Config, groups: int, max_tokens: int | None, seed: int):
    fp32 = ("model.dtype=float32", "learner.bf16=false")
    eager = ("model.attn_implementation=eager",)
    yield "vision per row", lambda: measure(cfg, groups, max_tokens, seed, learner_cfg=lcfg, shared_vision=False)
    yield "fp32", lambda: measure(_with(cfg, *fp32), groups, max_tokens, seed, learner_cfg=_with(lcfg, *fp32))
    yield "eager attention", lambda: measure(_with(cfg, *eager), groups, max_tokens, seed,
                                             learner_cfg=_with(lcfg, *eager))
    if cfg.rollout.prompts_per_batch > 1:
        yield "one prompt per batch", lambda: measure(_with(cfg, "rollout.prompts_per_batch=1"), groups, max_tokens,
                                                      seed, learner_cfg=lcfg)
    yield "no KV cache", lambda: measure(cfg, groups, max_tokens, seed, learner_cfg=lcfg, no_cache=True)


def run_check(cfg: Config, *, groups: int, max_tokens: int | None, max_kl: float | None, diagnose: bool,
              out: str | None = None) -> int:
    """The command: one verdict line; exit 0 (agree) or 1; ``out``: the verdict as JSON too."""
    v = check_agreement(cfg, groups=groups, max_tokens=max_tokens, max_kl=max_kl, diagnose=diagnose,
                        say=lambda line: print(line, flush=True))
    print(("OK: " if v.agree else "FAIL: ") + v.line, flush=True)
    if out:
        Path(out).write_text(json.dumps({"agree": v.agree, "cause": v.cause, "line": v.line}) + "\n")
    return 0 if v.agree else DISAGREE_EXIT


def main(args) -> int:
    cfg = load(args)
    check_before_loading(cfg, "agreement-check", data=True, queue=False)
    return run_check(cfg, groups=args.groups, max_tokens=args.max_tokens or None, max_kl=args.max_kl,
                     diagnose=not args.no_diagnose, out=args.out)
