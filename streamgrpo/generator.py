"""The generator process: prompts in, scored groups out (``streamgrpo generator --config F --id K``).

One top-down loop. Per batch of prompts: apply the newest verified weights (a safe point), sample
G completions per prompt, score them, and push one ScoredGroup per prompt into the Redis stream
(blocking under backpressure). Generator K reads shard K of ``rollout.num_generators``. SIGTERM
finishes the current batch and exits 0.

A generator that gets no weights from the learner says so (:class:`WeightsWatch`): it keeps
generating with its initial weights (v0), warns every ``weights.warn_every_s`` with the reason (key
refused, handshake failed, learner unreachable, nothing published yet), and exits with code 3
(:data:`WEIGHTS_UNAVAILABLE_EXIT`) once ``weights.max_wait_s`` has passed without any version.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from pathlib import Path

import numpy as np

from streamgrpo import metrics as M
from streamgrpo.config import Config, ConfigError
from streamgrpo.runtime import JsonlWriter, StopFlag, queue_url, setup_torch_threads, start_metrics

log = logging.getLogger("streamgrpo.generator")
WEIGHTS_UNAVAILABLE_EXIT = 3  # no version from the learner within weights.max_wait_s


class WeightsUnavailable(RuntimeError):
    """No version arrived from the learner within ``weights.max_wait_s`` (the message says why)."""


class WeightsWatch:
    """Makes a generator without weights loud; call :meth:`check` at every safe point (between batches).

    While ``client`` has never returned a version: a WARNING with :meth:`~.WeightSyncClient.status`'s
    reason every ``warn_every_s`` (the first at the first check), each counted in
    ``streamgrpo_errors_total{kind="weights_missing"}``, with ``streamgrpo_weights_missing`` at 1; and
    :class:`WeightsUnavailable` once ``max_wait_s`` (counted from construction; 0 or None: never) has
    passed. Once a version has arrived it never gives up, but still warns every ``warn_every_s`` while
    the learner refuses the connection (key no longer authorised, keys changed), counted as
    ``kind="weights_refused"``.
    """

    def __init__(self, client, *, warn_every_s: float = 30.0, max_wait_s: float | None = 600.0,
                 name: str = "generator", clock=time.monotonic):
        self.client, self.warn_every_s, self.max_wait_s, self.name = client, warn_every_s, max_wait_s or None, name
        self._clock = clock
        self.started = clock()
        self.received = False
        self.warnings = 0
        self._last_warn: float | None = None
        M.WEIGHTS_MISSING.set(1)

    @classmethod
    def from_config(cls, client, wcfg, name: str = "generator") -> WeightsWatch:
        """From a :class:`streamgrpo.config.WeightsConfig`."""
        return cls(client, warn_every_s=wcfg.warn_every_s, max_wait_s=wcfg.max_wait_s, name=name)

    def _due(self, now: float) -> bool:
        return self._last_warn is None or now - self._last_warn >= self.warn_every_s

    def check(self):
        """Warn if due; raise :class:`WeightsUnavailable` past the bound. Returns the status it looked at, if any."""
        now = self._clock()
        if self.client.version is not None:
            if not self.received:
                self.received, self._last_warn = True, None
                M.WEIGHTS_MISSING.set(0)
                if self.warnings:
                    log.info("%s: weights arrived from the learner after %.0f s (v%d)", self.name, now - self.started,
                             self.client.version)
            if not self._due(now):
                return None
            status = self.client.status()
            if status.refused:
                self._warn(now, "weights_refused", "%s: the learner refuses the weight channel; staying at v%d: %s",
                           self.name, self.client.version, status)
            return status
        waited = now - self.started
        if self.max_wait_s is not None and waited >= self.max_wait_s:
            raise WeightsUnavailable(f"{self.name}: no weights from the learner in {waited:.0f} s, giving up "
                                     f"(weights.max_wait_s={self.max_wait_s:g}): {self.client.status()}")
        if not self._due(now):
            return None
        status = self.client.status()
        self._warn(now, "weights_missing", "%s: no weights from the learner after %.0f s (still generating with the "
                   "initial weights, v0): %s", self.name, waited, status)
        return status

    def _warn(self, now: float, kind: str, msg: str, *args) -> None:
        self._last_warn = now
        self.warnings += 1
        M.ERRORS.labels(kind=kind).inc()
        log.warning(msg, *args)


def run_generator(cfg: Config, generator_id: int = 0, *, stop: StopFlag | None = None) -> int:
    import torch

    from streamgrpo.data.dataset import iter_samples
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.base import PromptRequest, SamplingParams
    from streamgrpo.models.loading import load_model, load_processor, resolve_device
    from streamgrpo.rewards import RewardSet
    from streamgrpo.transport.queue import QueueStopped, RedisQueue
    from streamgrpo.transport.weight_channels import subscriber_from_config
    if not 0 <= generator_id < cfg.rollout.num_generators:
        raise ValueError(f"--id {generator_id} is outside 0..{cfg.rollout.num_generators - 1} (rollout.num_generators)")
    stop = stop if stop is not None else StopFlag()
    name = f"generator-{generator_id}"
    run_dir = Path(cfg.run_dir)
    setup_torch_threads()
    torch.manual_seed(cfg.seed * 1000 + generator_id)
    server = start_metrics(cfg, run_dir, name)
    audit = JsonlWriter(run_dir / "audit" / f"{name}.jsonl")

    # --- the policy, its processor, the engine ---------------------------------------------
    device = resolve_device(cfg.rollout.device)
    processor = load_processor(cfg.model.name_or_path, cfg.model.revision)
    if cfg.rollout.engine == "vllm":
        from streamgrpo.engines.vllm import VLLMEngine

        engine = VLLMEngine.from_config(cfg, processor)
    else:
        from streamgrpo.engines.hf import HFEngine

        engine = HFEngine(load_model(cfg.model, device), processor, device=device)
    vp = processor.video_processor
    factor, temporal = vp.patch_size * vp.merge_size, vp.temporal_patch_size

    # --- data, rewards, queue, weights ---------------------------------------------------------
    records = load_records(cfg.data.train_path, cfg.data)
    if cfg.data.kinds:
        records = [r for r in records if r.kind in cfg.data.kinds]
    if not records:
        raise ValueError(f"{cfg.data.train_path}: no records (kinds filter: {cfg.data.kinds})")
    rewards = RewardSet(cfg)
    queue = RedisQueue.from_config(cfg.queue, queue_url(cfg, run_dir), consumer=name, stop=stop)
    weights = subscriber_from_config(cfg, client_key=f"client-{generator_id}" if cfg.weights.curve_keys_dir else None,
                                     pin_memory=device.type == "cuda" and cfg.rollout.engine == "hf")
    sampling = SamplingParams.from_config(cfg.rollout)
    tc = cfg.rollout.temporal_contrast  # T-GRPO: shuffled-frame groups, scored and never sent
    if tc is not None and tc.reward not in rewards.names:
        raise ConfigError(f"rollout.temporal_contrast.reward: {tc.reward!r} is not one of rewards.functions "
                          f"({', '.join(rewards.names)})")
    shuffle_rng = np.random.default_rng([cfg.seed, generator_id, 7])
    pending: deque = deque()  # received versions not applied yet (weight_apply_delay > 0)
    from streamgrpo.models.lora import make_weight_applier

    load_weights = make_weight_applier(cfg, engine)  # LoRA mode: merge adapters into the pristine base

    def apply_newest(block_s: float = 0.0) -> None:
        """Safe point between batches: apply the newest verified version (or, for the staleness
        benchmark, the one ``weight_apply_delay`` receipts behind it)."""
        got = weights.poll(timeout_s=block_s)
        while got is not None:
            pending.append(got)
            got = weights.poll(timeout_s=0.0)
        delay = cfg.rollout.weight_apply_delay
        if len(pending) <= delay:
            return
        target = pending[-1 - delay]
        while pending and pending[0] is not target:
            pending.popleft()
        pending.popleft()
        t0 = time.perf_counter()
        load_weights(target[0], target[1])
        sync_s = None
        if delay == 0:
            sync_s = weights.mark_applied()  # publish-to-applied latency + policy_version{role="generator"}
        else:
            M.POLICY_VERSION.labels(role="generator").set(target[0])
        audit.write({"event": "applied", "version": target[0], "weight_sync_s": sync_s, "t": time.time()})
        log.info("%s: applied weights v%d (%.2fs)", name, target[0], time.perf_counter() - t0)

    watch = WeightsWatch.from_config(weights, cfg.weights, name)
    # a (re)started generator catches up first
    snap = weights.request_snapshot(timeout_s=min(10.0, cfg.weights.max_wait_s or 10.0))
    if snap is not None:
        load_weights(snap[0], snap[1])
        weights.mark_applied()
    log.info("%s: %d records in shard %d/%d, starting at policy v%d%s", name,
             (len(records) + cfg.rollout.num_generators - 1 - generator_id) // cfg.rollout.num_generators,
             generator_id, cfg.rollout.num_generators, engine.version,
             "" if snap is not None else " (the initial weights: none from the learner yet)")

    samples = iter_samples(records, cfg.data, shard=generator_id, num_shards=cfg.rollout.num_generators,
                           seed=cfg.seed, epochs=cfg.rollout.num_epochs, factor=factor, temporal_patch=temporal)
    produced = 0
    code = 0
    try:
        while not stop:
            apply_newest()
            watch.check()  # warns while no weights arrive; raises WeightsUnavailable past weights.max_wait_s
            batch_size = cfg.rollout.prompts_per_batch
            if cfg.rollout.sync:
                batch_size = _claim_sync_slots(queue, cfg, engine.version, batch_size)
                if batch_size == 0:  # this version's share is produced: wait for the next one
                    apply_newest(block_s=1.0)
                    continue
            chunk = list(itertools.islice(samples, batch_size))
            if not chunk:
                log.info("%s: data exhausted after %d groups", name, produced)
                break
            requests = []
            for record, visuals in chunk:
                text = build_prompt_text(processor, record, cfg.data)
                requests.append(PromptRequest(text, visuals, processor_inputs(processor, text, visuals), record.id))
            version = engine.version
            t0 = time.perf_counter()
            outs = engine.generate(requests, sampling)
            contrast = sample_shuffled(engine, processor, requests, sampling, tc, shuffle_rng) if tc else {}
            gen_s = time.perf_counter() - t0
            for i, ((record, visuals), req, group_out) in enumerate(zip(chunk, requests, outs)):
                group = score_group(record, visuals, req, group_out, rewards, version=version, generator_id=name,
                                    model_id=cfg.model.name_or_path, temperature=sampling.temperature,
                                    shuffled=contrast.get(i), contrast=tc)
                t_put = time.perf_counter()
                sent = _put(queue, group, stop, name, tick=watch.check)
                if sent is None:
                    continue  # refused by the wire contract (logged and counted)
                if not sent:
                    break
                produced += 1
                M.GROUPS.labels(event="produced").inc()
                M.TOKENS.labels(role="generator").inc(sum(len(c.token_ids) for c in group_out))
                audit.write({"event": "produced", "group_id": group.group_id, "version": version,
                             "reward": float(np.mean([c.reward for c in group.completions])), "t": time.time(),
                             "put_s": round(time.perf_counter() - t_put, 4)})
            log.debug("%s: %d groups at v%d in %.2fs", name, len(chunk), version, gen_s)
    except QueueStopped as exc:  # SIGTERM during a Redis outage: the group being put is given up
        log.warning("%s: %s; stopping", name, exc)
    except WeightsUnavailable as exc:
        log.error("%s", exc)
        code = WEIGHTS_UNAVAILABLE_EXIT
    finally:
        log.info("%s: stopping after %d groups", name, produced)
        weights.close()
        queue.close()
        audit.close()
        server.close()
    return code


def score_group(record, visuals, req, outs, rewards, *, version: int, generator_id: str, model_id: str,
                temperature: float, shuffled=None, contrast=None):
    """One prompt's sampled completions, scored by ``rewards`` (a RewardSet), as a ScoredGroup.

    ``shuffled`` (T-GRPO, with ``contrast`` = ``rollout.temporal_contrast``): the completions sampled
    on the prompt's frames in a shuffled order; they only decide the ``temporal`` bonus of the
    ordered completions (:mod:`streamgrpo.rewards.temporal`) and are not part of the group.
    """
    from streamgrpo.rewards.temporal import temporal_bonus, with_bonus
    from streamgrpo.wire import Completion, ScoredGroup

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
    return ScoredGroup(
        prompt_id=record.id, generator_id=generator_id, policy_version=version, model_id=model_id,
        prompt_ids=np.asarray(req.inputs["input_ids"]).reshape(-1).astype(np.int32), visuals=visuals,
        answer=record.answer, prompt_text=req.prompt_text, meta=meta,
        completions=[Completion(c.token_ids, c.logprobs, c.text, c.finish_reason, scored.for_completion(i),
                                float(scored.totals[i])) for i, c in enumerate(outs)],
    )


def sample_shuffled(engine, processor, requests, sampling, contrast, rng) -> dict[int, list]:
    """T-GRPO: ``contrast.num_generations`` completions of each video prompt on its frames in a shuffled
    order (:mod:`streamgrpo.data.shuffle`), by request index; image-only prompts are skipped."""
    from dataclasses import replace

    from streamgrpo.data.prompts import processor_inputs
    from streamgrpo.data.shuffle import has_video, shuffle_visuals
    from streamgrpo.engines.base import PromptRequest

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


def _put(queue, group, stop: StopFlag, name: str, grace_s: float = 10.0, tick=None) -> bool | None:
    """Put under backpressure, waking every second to notice SIGTERM (and to call ``tick``, e.g. a
    :meth:`WeightsWatch.check`); after a stop request the group gets ``grace_s`` more seconds to find
    room, then it is given up (logged). A group the wire contract refuses is logged, counted
    (``groups_dropped{reason=invalid}``) and skipped (None)."""
    from streamgrpo.transport.queue import QueueFull
    from streamgrpo.wire import WireError

    stopped_at = None
    while True:
        try:
            queue.put(group, timeout_s=1.0)
            return True
        except WireError as exc:  # a group the wire contract refuses (e.g. a non-finite log-prob): skip it
            M.GROUPS_DROPPED.labels(reason="invalid").inc()
            log.error("%s: group %s (%s) not sent: %s", name, group.group_id, group.prompt_id, exc)
            return None
        except QueueFull:
            if tick is not None:
                tick()
            if stop:
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at >= grace_s:
                    log.warning("%s: queue still full at shutdown: group %s (%s) not delivered",
                                name, group.group_id, group.prompt_id)
                    return False


def _claim_sync_slots(queue, cfg: Config, version: int, want: int) -> int:
    """On-policy mode: claim up to ``want`` of the ``groups_per_step`` slots of ``version``.

    All generators share one Redis counter per version, so exactly one step's worth of groups is
    produced with each version and the learner never sees a stale group.
    """
    key = f"{cfg.queue.namespace}:sync:{version}"
    total = queue.client.incrby(key, want)
    queue.client.expire(key, 24 * 3600)
    already = total - want
    return max(0, min(want, cfg.learner.groups_per_step - already))
