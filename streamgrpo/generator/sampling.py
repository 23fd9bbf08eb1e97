"""Prompts in, scored groups out: the chat prompt, G samples per prompt (and T-GRPO's shuffled
contrast), rewards, one :class:`~streamgrpo.wire.ScoredGroup` per prompt.

A chunk of prompts that runs the engine out of memory is sampled again in halves
(:class:`~streamgrpo.generator.oom.BatchSize`; the smaller size is kept for the next chunks)."""

from __future__ import annotations

import logging
import time

import numpy as np

from streamgrpo.config import Config
from streamgrpo.data.prompts import build_prompt_text, processor_inputs
from streamgrpo.data.records import default_media_root
from streamgrpo.data.shuffle import has_video, shuffle_visuals
from streamgrpo.engines.base import Engine, PromptRequest, SamplingParams
from streamgrpo.generator.oom import BatchSize, does_not_fit_message
from streamgrpo.metrics import ERRORS
from streamgrpo.rewards.temporal import temporal_bonus, with_bonus
from streamgrpo.wire import Completion, ScoredGroup, inline

log = logging.getLogger("streamgrpo.generator")


class Sampler:
    """Prompts in, scored groups out: the chat prompt, G samples (and T-GRPO's shuffled contrast), rewards.

    ``batch.size``: how many prompts one engine call samples now (``rollout.prompts_per_batch``, halved
    each time a call runs out of memory); a generator takes its next chunk of that size."""

    def __init__(self, engine: Engine, processor, cfg: Config, sampling: SamplingParams, rewards, name: str,
                 shuffle_rng):
        self.engine, self.processor, self.cfg, self.sampling = engine, processor, cfg, sampling
        self.rewards, self.name, self.shuffle_rng = rewards, name, shuffle_rng
        self.between_steps = None  # rollout.inflight_updates: the weight applier, called between decoding steps
        self.batch = BatchSize(cfg.rollout.prompts_per_batch, does_not_fit=does_not_fit_message(name, cfg),
                               on_halve=self._halved)
        self._inline_noted = False  # said once that some visuals travel inline though by reference was asked

    def groups(self, chunk: list) -> list:
        """One scored group per ``(record, visuals)`` of ``chunk``, in order (sampled in pieces of at most
        ``batch.size`` prompts; a piece that runs out of memory is sampled again in halves)."""
        return self.batch.run(chunk, self._groups)

    def _halved(self, tried: int, size: int) -> None:

        ERRORS.labels(kind="generator_oom").inc()
        log.warning("%s: out of memory sampling %d prompts at once: %d prompt(s) per engine call from now on "
                    "(rollout.prompts_per_batch=%d)", self.name, tried, size, self.cfg.rollout.prompts_per_batch)

    def _groups(self, chunk: list) -> list:

        cfg, tc = self.cfg, self.cfg.rollout.temporal_contrast
        requests = []
        for record, visuals in chunk:
            text = build_prompt_text(self.processor, record, cfg.data)
            requests.append(PromptRequest(text, visuals, processor_inputs(self.processor, text, visuals), record.id))
        version = self.engine.version
        t0 = time.perf_counter()
        outs = self.engine.generate(requests, self.sampling, between_steps=self.between_steps)
        contrast = sample_shuffled(self.engine, self.processor, requests, self.sampling, tc, self.shuffle_rng) \
            if tc else {}
        log.debug("%s: %d groups at v%d in %.2fs", self.name, len(chunk), version, time.perf_counter() - t0)
        groups = [score_group(record, visuals, req, out, self.rewards, version=version, generator_id=self.name,
                              model_id=cfg.model.name_or_path, temperature=self.sampling.temperature,
                              shuffled=contrast.get(i), contrast=tc)
                  for i, ((record, visuals), req, out) in enumerate(zip(chunk, requests, outs))]
        if cfg.rollout.media != "reference":
            return [inline(g) for g in groups]
        if not self._inline_noted and any(v.ref is None for g in groups for v in g.visuals):
            self._inline_noted = True
            log.warning("%s: some visuals travel inline although rollout.media is reference: their files lie "
                        "outside data.media_root (%s) once symlinks are resolved, where the learner refuses "
                        "references (or were extracted from a datasets row); set data.media_root to a folder "
                        "that holds them to send them by reference", self.name, default_media_root(cfg.data))
        return groups


def score_group(record, visuals, req, outs, rewards, *, version: int, generator_id: str, model_id: str,
                temperature: float, shuffled=None, contrast=None):
    """One prompt's sampled completions, scored by ``rewards`` (a RewardSet), as a ScoredGroup.

    ``shuffled`` (T-GRPO, with ``contrast`` = ``rollout.temporal_contrast``): the completions sampled
    on the prompt's frames in a shuffled order; they only decide the ``temporal`` bonus of the
    ordered completions (:mod:`streamgrpo.rewards.temporal`) and are not part of the group.
    """

    fields = {"question": record.question, "kind": record.kind}
    scored = rewards.score([c.text for c in outs], record.answer, prompt_id=record.id, fields=fields,
                           observe=shuffled is None)
    meta = {"kind": record.kind, "temperature": temperature}
    if shuffled is not None:
        plain = rewards.score([c.text for c in shuffled], record.answer, prompt_id=f"{record.id}#shuffled",
                              fields=fields, observe=False)
        bonus = temporal_bonus(scored.per_fn[contrast.reward], plain.per_fn[contrast.reward], alpha=contrast.alpha,
                               mu=contrast.mu, correct_at=contrast.correct_at)
        scored = with_bonus(scored, bonus)
        rewards.observe(scored)
        meta["temporal"] = {"p": bonus.p, "p_shuffled": bonus.p_shuffled, "applied": bonus.applied}
    stamped = [c.versions for c in outs if c.versions is not None and len(c.versions)]
    oldest = min([version] + [int(v.min()) for v in stamped])  # staleness counts from the oldest token
    return ScoredGroup(
        prompt_id=record.id, generator_id=generator_id, policy_version=oldest, model_id=model_id,
        prompt_ids=np.asarray(req.inputs["input_ids"]).reshape(-1).astype(np.int32), visuals=visuals,
        answer=record.answer, prompt_text=req.prompt_text, meta=meta,
        completions=[Completion(c.token_ids, c.logprobs, c.text, c.finish_reason, scored.for_completion(i),
                                float(scored.totals[i]), c.versions) for i, c in enumerate(outs)],
    )


def sample_shuffled(engine: Engine, processor, requests, sampling: SamplingParams, contrast, rng) -> dict[int, list]:
    """T-GRPO: ``contrast.num_generations`` completions of each video prompt on its frames in a shuffled
    order (:mod:`streamgrpo.data.shuffle`), by request index; image-only prompts are skipped."""
    from dataclasses import replace


    idx = [i for i, r in enumerate(requests) if has_video(r.visuals)]
    if not idx:
        return {}
    shuffled = []
    for i in idx:
        r = requests[i]
        visuals = shuffle_visuals(r.visuals, rng)
        shuffled.append(PromptRequest(r.prompt_text, visuals, processor_inputs(processor, r.prompt_text, visuals),
                                      f"{r.request_id}#shuffled"))
    return dict(zip(idx, engine.generate(shuffled, replace(sampling, n=contrast.num_generations))))
