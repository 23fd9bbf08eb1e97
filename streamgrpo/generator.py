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
    from streamgrpo.engines.base import SamplingParams
    from streamgrpo.models.loading import load_processor, resolve_device
    from streamgrpo.models.lora import make_weight_applier
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

    # --- the policy, its processor, the engine; data, rewards, queue, weights ------------------
    device = resolve_device(cfg.rollout.device)
    processor = load_processor(cfg.model.name_or_path, cfg.model.revision)
    engine = _make_engine(cfg, processor, device)
    records = _records(cfg)
    rewards = RewardSet(cfg)
    tc = cfg.rollout.temporal_contrast  # T-GRPO: shuffled-frame groups, scored and never sent
    if tc is not None and tc.reward not in rewards.names:
        raise ConfigError(f"rollout.temporal_contrast.reward: {tc.reward!r} is not one of rewards.functions "
                          f"({', '.join(rewards.names)})")
    queue = RedisQueue.from_config(cfg.queue, queue_url(cfg, run_dir), consumer=name, stop=stop)
    weights = subscriber_from_config(cfg, client_key=f"client-{generator_id}" if cfg.weights.curve_keys_dir else None,
                                     pin_memory=device.type == "cuda" and cfg.rollout.engine == "hf")
    sampler = _Sampler(engine, processor, cfg, SamplingParams.from_config(cfg.rollout), rewards, name,
                       np.random.default_rng([cfg.seed, generator_id, 7]))
    apply_newest = _Applier(weights, make_weight_applier(cfg, engine), audit, cfg.rollout.weight_apply_delay, name)
    watch = WeightsWatch.from_config(weights, cfg.weights, name)
    if cfg.rollout.inflight_updates:  # new versions also between the decoding steps of a batch (vLLM)
        sampler.between_steps = lambda: apply_newest(not_below=engine.version)
        if cfg.rollout.engine != "vllm":
            log.warning("%s: rollout.inflight_updates needs rollout.engine=vllm; the HF engine applies weights "
                        "between batches", name)
    apply_newest.snapshot(min(10.0, cfg.weights.max_wait_s or 10.0))  # a (re)started generator catches up first
    log.info("%s: %d records in shard %d/%d, starting at policy v%d%s", name,
             (len(records) + cfg.rollout.num_generators - 1 - generator_id) // cfg.rollout.num_generators,
             generator_id, cfg.rollout.num_generators, engine.version,
             "" if apply_newest.snapped else " (the initial weights: none from the learner yet)")
    vp = processor.video_processor
    samples = iter_samples(records, cfg.data, shard=generator_id, num_shards=cfg.rollout.num_generators,
                           seed=cfg.seed, epochs=cfg.rollout.num_epochs, factor=vp.patch_size * vp.merge_size,
                           temporal_patch=vp.temporal_patch_size)

    # --- one batch of prompts per turn: weights in (a safe point), groups out ------------------
    produced = code = 0
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
            sent, gave_up = _send(queue, sampler.groups(chunk), stop, name, audit, tick=watch.check)
            produced += sent
            if gave_up:
                break
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


def _make_engine(cfg: Config, processor, device):
    if cfg.rollout.engine == "vllm":
        from streamgrpo.engines.vllm import VLLMEngine

        return VLLMEngine.from_config(cfg, processor)
    from streamgrpo.engines.hf import HFEngine
    from streamgrpo.models.loading import load_model

    return HFEngine(load_model(cfg.model, device), processor, device=device)


def _records(cfg: Config) -> list:
    from streamgrpo.data.records import load_records

    records = load_records(cfg.data.train_path, cfg.data)
    if cfg.data.kinds:
        records = [r for r in records if r.kind in cfg.data.kinds]
    if not records:
        raise ValueError(f"{cfg.data.train_path}: no records (kinds filter: {cfg.data.kinds})")
    return records


class _Applier:
    """Safe point between batches: apply the newest verified weight version (or, for the staleness
    benchmark, the one ``weight_apply_delay`` receipts behind it)."""

    def __init__(self, weights, load_weights, audit, delay: int, name: str):
        self.weights, self.load_weights, self.audit, self.delay, self.name = weights, load_weights, audit, delay, name
        self.pending: deque = deque()  # received versions not applied yet (delay > 0)
        self.snapped = False

    def snapshot(self, timeout_s: float) -> None:
        snap = self.weights.request_snapshot(timeout_s=timeout_s)
        if snap is not None:
            self.load_weights(snap[0], snap[1])
            self.weights.mark_applied()
            self.snapped = True

    def __call__(self, block_s: float = 0.0, not_below: int | None = None) -> None:
        """``not_below`` (in flight): a version numbered lower than that (a restarted learner rolled
        back) waits for the end of the batch, so a completion's token versions never go back."""
        got = self.weights.poll(timeout_s=block_s)
        while got is not None:
            self.pending.append(got)
            got = self.weights.poll(timeout_s=0.0)
        if len(self.pending) <= self.delay:
            return
        target = self.pending[-1 - self.delay]
        if not_below is not None and target[0] < not_below:
            return
        while self.pending and self.pending[0] is not target:
            self.pending.popleft()
        self.pending.popleft()
        t0 = time.perf_counter()
        self.load_weights(target[0], target[1])
        sync_s = None
        if self.delay == 0:
            sync_s = self.weights.mark_applied()  # publish-to-applied latency + policy_version{role="generator"}
        else:
            M.POLICY_VERSION.labels(role="generator").set(target[0])
        self.audit.write({"event": "applied", "version": target[0], "weight_sync_s": sync_s, "t": time.time()})
        log.info("%s: applied weights v%d (%.2fs)", self.name, target[0], time.perf_counter() - t0)


class _Sampler:
    """Prompts in, scored groups out: the chat prompt, G samples (and T-GRPO's shuffled contrast), rewards."""

    def __init__(self, engine, processor, cfg: Config, sampling, rewards, name: str, shuffle_rng):
        self.engine, self.processor, self.cfg, self.sampling = engine, processor, cfg, sampling
        self.rewards, self.name, self.shuffle_rng = rewards, name, shuffle_rng
        self.between_steps = None  # rollout.inflight_updates: the weight applier, called between decoding steps

    def groups(self, chunk: list) -> list:
        from streamgrpo.data.prompts import build_prompt_text, processor_inputs
        from streamgrpo.engines.base import PromptRequest

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
        return [score_group(record, visuals, req, out, self.rewards, version=version, generator_id=self.name,
                            model_id=cfg.model.name_or_path, temperature=self.sampling.temperature,
                            shuffled=contrast.get(i), contrast=tc)
                for i, ((record, visuals), req, out) in enumerate(zip(chunk, requests, outs))]


def _send(queue, groups: list, stop: StopFlag, name: str, audit, tick=None) -> tuple[int, bool]:
    """Put a batch's groups in one round trip (see :func:`_put`), count and audit them; returns
    ``(groups sent, gave up)``. If the wire contract refuses a group, the batch goes group by group
    so that only that one is skipped; one a stop gave up on ends the batch."""
    t_put = time.perf_counter()
    sent = _put(queue, groups, stop, name, tick=tick) if groups else True
    if sent is False:
        return 0, True
    if sent is True:
        return _produced(groups, audit, (time.perf_counter() - t_put) / max(1, len(groups))), False
    done = 0
    for group in groups:
        t_put = time.perf_counter()
        sent = _put(queue, [group], stop, name, tick=tick)
        if sent is False:
            return done, True
        if sent is None:
            M.GROUPS_DROPPED.labels(reason="invalid").inc()
            continue  # refused by the wire contract (logged)
        done += _produced([group], audit, time.perf_counter() - t_put)
    return done, False


def _produced(groups: list, audit, put_s: float) -> int:
    for group in groups:
        M.GROUPS.labels(event="produced").inc()
        M.TOKENS.labels(role="generator").inc(sum(len(c.token_ids) for c in group.completions))
        audit.write({"event": "produced", "group_id": group.group_id, "version": group.policy_version,
                     "reward": float(np.mean([c.reward for c in group.completions])), "t": time.time(),
                     "put_s": round(put_s, 4)})
    return len(groups)


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
    stamped = [c.versions for c in outs if c.versions is not None and len(c.versions)]
    oldest = min([version] + [int(v.min()) for v in stamped])  # staleness counts from the oldest token
    return ScoredGroup(
        prompt_id=record.id, generator_id=generator_id, policy_version=oldest, model_id=model_id,
        prompt_ids=np.asarray(req.inputs["input_ids"]).reshape(-1).astype(np.int32), visuals=visuals,
        answer=record.answer, prompt_text=req.prompt_text, meta=meta,
        completions=[Completion(c.token_ids, c.logprobs, c.text, c.finish_reason, scored.for_completion(i),
                                float(scored.totals[i]), c.versions) for i, c in enumerate(outs)],
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


def _put(queue, groups: list, stop: StopFlag, name: str, grace_s: float = 10.0, tick=None) -> bool | None:
    """Put ``groups`` (one round trip: ``put_many``) under backpressure, waking every second to
    notice SIGTERM (and to call ``tick``, e.g. a :meth:`WeightsWatch.check`); after a stop request
    they get ``grace_s`` more seconds to find room, then they are given up (logged, False). If the
    wire contract refuses a group, nothing is sent and None is returned (a single group's refusal
    is logged here; the caller counts it)."""
    from streamgrpo.transport.queue import QueueFull
    from streamgrpo.wire import WireError

    stopped_at = None
    while True:
        try:
            queue.put_many(groups, timeout_s=1.0)
            return True
        except WireError as exc:  # e.g. a non-finite log-prob: the caller retries group by group
            if len(groups) == 1:
                log.error("%s: group %s (%s) not sent: %s", name, groups[0].group_id, groups[0].prompt_id, exc)
            return None
        except QueueFull:
            if tick is not None:
                tick()
            if stop:
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at >= grace_s:
                    log.warning("%s: queue still full at shutdown: %d group(s) not delivered (%s)", name,
                                len(groups), ", ".join(g.group_id for g in groups))
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
