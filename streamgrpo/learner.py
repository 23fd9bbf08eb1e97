"""The learner process (``streamgrpo learner --config F``): groups in, new weights out.

One top-down loop per optimizer step:

1. take ``learner.groups_per_step`` groups from the queue (waiting with a timeout, idle time
   counted); drop stale ones (``loss.max_staleness``), and ones whose re-processed prompt ids differ
   from the message (``mismatch``); duplicates are skipped by the queue;
2. advantages from the rewards in the messages;
3. per-token log-probs of the completions (one vision pass per group), reference log-probs when
   ``beta > 0``; the clipped importance-ratio loss; backward (micro-batched by tokens);
4. clip, optimizer step, bump the policy version; record the groups as trained, ack them;
5. publish weights every ``weights.sync_every`` steps; one ``metrics.jsonl`` line and Prometheus
   gauges per step; a checkpoint every ``learner.save_steps`` and on SIGTERM.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamgrpo import metrics as M
from streamgrpo.config import Config
from streamgrpo.runtime import JsonlWriter, StopFlag, queue_url, setup_torch_threads, start_metrics, write_json

log = logging.getLogger("streamgrpo.learner")


@dataclass
class LearnerState:
    """Everything besides weights and optimizer that a checkpoint must restore."""

    step: int = 0
    version: int = 0
    groups_trained: int = 0
    dropped: Counter = field(default_factory=Counter)
    tokens_trained: int = 0
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "groups_trained": self.groups_trained,
                "dropped": dict(self.dropped), "tokens_trained": self.tokens_trained}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LearnerState:
        return cls(step=d["step"], version=d["version"], groups_trained=d.get("groups_trained", 0),
                   dropped=Counter(d.get("dropped", {})), tokens_trained=d.get("tokens_trained", 0))


@dataclass
class Accepted:
    """A group that passed the checks, with its re-processed prompt inputs."""

    stream_id: str
    group: Any  # ScoredGroup
    inputs: Any  # processor outputs for the prompt
    staleness: int


def make_optimizer(model: torch.nn.Module, cfg: Config):
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: check model.tune_mm_llm / tune_mm_mlp / tune_mm_vision")
    lc = cfg.learner
    opt = torch.optim.AdamW(params, lr=lc.learning_rate, betas=(lc.adam_beta1, lc.adam_beta2),
                            weight_decay=lc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(lc))
    return opt, sched


def lr_lambda(lc):
    """Linear warm-up, then constant / cosine / linear decay to 0 at max_steps."""

    def f(step: int) -> float:
        if lc.warmup_steps and step < lc.warmup_steps:
            return (step + 1) / lc.warmup_steps
        if lc.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - lc.warmup_steps) / max(1, lc.max_steps - lc.warmup_steps))
        if lc.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    return f


def policy_state_for_broadcast(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors generators need: every parameter (detached, contiguous, CPU)."""
    return {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}


def run_learner(cfg: Config, *, stop: StopFlag | None = None) -> int:
    from streamgrpo.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
    from streamgrpo.models.card import model_card
    from streamgrpo.models.loading import load_model, load_processor, resolve_device
    from streamgrpo.transport.queue import RedisQueue
    from streamgrpo.transport.weights import WeightPublisher

    stop = stop if stop is not None else StopFlag()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_torch_threads()
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.learner.device)
    ckpt_root = run_dir / "checkpoints"

    # --- model, reference, optimizer; resume --------------------------------------------------
    processor = load_processor(cfg.model.name_or_path, cfg.model.revision)
    policy = load_model(cfg.model, device, dtype="float32" if not cfg.learner.bf16 else "bfloat16", trainable=True)
    ref = load_model(cfg.model, device) if cfg.loss.beta > 0 else None
    if cfg.learner.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    optimizer, scheduler = make_optimizer(policy, cfg)
    state = LearnerState()
    if cfg.learner.resume:
        ckpt = latest_checkpoint(ckpt_root)
        if ckpt is None:
            log.info("resume: no checkpoint under %s, starting fresh", ckpt_root)
        else:
            meta = load_trainer_state(ckpt, model=policy, optimizer=optimizer, scheduler=scheduler)
            state = LearnerState.from_json(meta["learner"])
            log.info("resumed from %s at step %d (policy v%d)", ckpt, state.step, state.version)

    # --- queue, weights, metrics -------------------------------------------------------------
    queue = RedisQueue.from_config(cfg.queue, queue_url(cfg, run_dir), consumer="learner-0")
    publisher = WeightPublisher.from_config(cfg.weights)
    write_json(run_dir / "ports" / "weights.json", {"pub": publisher.pub_port, "snapshot": publisher.snapshot_port})
    publisher.publish(state.version, policy_state_for_broadcast(policy))
    M.POLICY_VERSION.labels(role="learner").set(state.version)
    server = start_metrics(cfg, run_dir, "learner")
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl")
    audit = JsonlWriter(run_dir / "audit" / "learner.jsonl")

    def checkpoint() -> None:
        save_checkpoint(ckpt_root, state.step, model=policy, processor=processor, optimizer=optimizer,
                        scheduler=scheduler, state={"learner": state.to_json()},
                        model_card=model_card(cfg, state.to_json(), last_metrics),
                        total_limit=cfg.learner.save_total_limit)

    last_metrics: dict[str, Any] = {}
    log.info("learner ready: policy v%d, %d groups per step, max %d steps", state.version,
             cfg.learner.groups_per_step, cfg.learner.max_steps)
    try:
        while state.step < cfg.learner.max_steps and not stop:
            # 1. collect a step's worth of usable groups
            t_wait = time.perf_counter()
            batch = collect_groups(queue, processor, cfg, state, stop, audit)
            wait_s = time.perf_counter() - t_wait
            if len(batch) < cfg.learner.groups_per_step:
                break  # stopping
            # 2-3. advantages, log-probs, loss, backward, step
            t0 = time.perf_counter()
            out = train_step(policy, ref, optimizer, scheduler, batch, processor, cfg, device)
            step_s = time.perf_counter() - t0
            ids = [a.group.group_id for a in batch]
            if out is None:  # non-finite loss: skip the step, drop its groups
                M.ERRORS.labels(kind="loss").inc()
                _drop(queue, audit, state, batch, "nan_loss")
                continue
            # 4. bump the version, remember the groups as trained, ack them
            state.step += 1
            state.version += 1
            state.groups_trained += len(batch)
            state.tokens_trained += out["tokens"]
            queue.mark_trained(ids)
            queue.ack([a.stream_id for a in batch])
            audit.write({"event": "trained", "step": state.step, "version": state.version, "group_ids": ids})
            # 5. weights out, metrics, checkpoint
            if state.step % cfg.weights.sync_every == 0:
                publisher.publish(state.version, policy_state_for_broadcast(policy))
            last_metrics = step_record(state, batch, out, step_s, wait_s, scheduler)
            metrics_log.write(last_metrics)
            export_prometheus(last_metrics, batch, state)
            if state.step % cfg.metrics.log_every == 0:
                log.info(
                    "step %d v%d reward %.3f acc %s loss %.4f kl %.4f clip %.3f stale %.1f | %.2fs train %.2fs wait",
                    state.step, state.version, last_metrics["reward"], _fmt(last_metrics.get("accuracy")),
                    last_metrics["loss"], last_metrics["kl"], last_metrics["clip_frac"],
                    last_metrics["staleness_mean"], step_s, wait_s,
                )
            if state.step % cfg.learner.save_steps == 0:
                checkpoint()
    finally:
        if state.step > 0 and (stop or state.step >= cfg.learner.max_steps):
            latest = latest_checkpoint(ckpt_root)
            if latest is None or int(latest.name.split("-")[1]) != state.step:
                checkpoint()
        write_json(run_dir / "learner_state.json", state.to_json())
        publisher.close()
        queue.close()
        metrics_log.close()
        audit.close()
        server.close()
    return 0


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _drop(queue, audit, state: LearnerState, accepted: list[Accepted], reason: str) -> None:
    for a in accepted:
        M.GROUPS_DROPPED.labels(reason=reason).inc()
        state.dropped[reason] += 1
        audit.write({"event": "dropped", "reason": reason, "group_id": a.group.group_id})
    queue.ack([a.stream_id for a in accepted])


def collect_groups(queue, processor, cfg: Config, state: LearnerState, stop, audit) -> list[Accepted]:
    """Block until ``groups_per_step`` usable groups are in hand (or ``stop`` is set)."""
    from streamgrpo.data.prompts import processor_inputs

    want = cfg.learner.groups_per_step
    accepted: list[Accepted] = []
    while len(accepted) < want and not stop:
        t0 = time.perf_counter()
        deliveries = queue.get(want - len(accepted), timeout_s=cfg.learner.get_timeout_s)
        if not deliveries:
            M.IDLE_SECONDS.labels(role="learner").inc(time.perf_counter() - t0)
            continue
        for d in deliveries:
            g = d.group
            M.GROUPS.labels(event="consumed").inc()
            staleness = state.version - int(g.policy_version)
            if staleness > cfg.loss.max_staleness or staleness < 0:
                # negative: made by weights from a run that was rolled back (learner resumed) -- unusable
                _drop(queue, audit, state, [Accepted(d.stream_id, g, None, staleness)], "stale")
                continue
            try:
                inputs = processor_inputs(processor, g.prompt_text, g.visuals)
                same = np.array_equal(np.asarray(inputs["input_ids"]).reshape(-1), g.prompt_ids)
            except Exception as exc:  # noqa: BLE001 - any failure to re-create the inputs is a mismatch
                log.warning("group %s: cannot re-process its prompt: %s", g.group_id, exc)
                same = False
            if not same:
                _drop(queue, audit, state, [Accepted(d.stream_id, g, None, staleness)], "mismatch")
                continue
            accepted.append(Accepted(d.stream_id, g, inputs, staleness))
    return accepted


def train_step(policy, ref, optimizer, scheduler, batch: list[Accepted], processor, cfg: Config, device) -> dict | None:
    """One optimizer step on the accepted groups; None when the loss is not finite (nothing applied)."""
    from streamgrpo.advantages import batch_advantages
    from streamgrpo.loss import compute_loss, loss_kwargs
    from streamgrpo.models.batching import GroupInputs, build_batch, pad_right, vision_token_ids
    from streamgrpo.models.logprobs import completion_logprobs

    rewards = [torch.tensor([c.reward for c in a.group.completions], dtype=torch.float32) for a in batch]
    advs, zero_var = batch_advantages(rewards, cfg.loss.scale_rewards, cfg.loss.adv_eps)
    temperature = float(batch[0].group.meta.get("temperature", cfg.rollout.temperature))
    pad_id = processor.tokenizer.pad_token_id
    # the engine never samples vision placeholders: the learner's softmax excludes them too
    suppress = vision_token_ids(processor) if cfg.rollout.engine == "hf" else None
    micro = split_micro_batches(batch, cfg.learner.micro_batch_tokens)
    total_tokens = sum(len(c.token_ids) for a in batch for c in a.group.completions)
    kw = loss_kwargs(cfg.loss, cfg.rollout.max_completion_length)
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    loss_total = 0.0
    index = {id(a): i for i, a in enumerate(batch)}
    for part in micro:
        groups = [GroupInputs.from_processor(a.inputs, [torch.as_tensor(c.token_ids, dtype=torch.long)
                                                        for c in a.group.completions]) for a in part]
        tb = build_batch(groups, pad_id).to(device)
        logprobs, entropy = completion_logprobs(policy, tb, temperature=temperature, with_entropy=True,
                                                suppress_token_ids=suppress)
        behaviour = pad_right([torch.as_tensor(c.logprobs) for a in part for c in a.group.completions], 0.0,
                              length=logprobs.shape[1]).to(device)
        adv = torch.cat([advs[index[id(a)]] for a in part]).to(device)
        ref_lp = None
        if ref is not None:
            with torch.no_grad():
                ref_lp, _ = completion_logprobs(ref, tb, temperature=temperature, suppress_token_ids=suppress)
        loss, m = compute_loss(logprobs, behaviour, adv, tb.completion_mask, ref_lp, entropies=entropy,
                               token_normaliser=total_tokens if cfg.loss.loss_type == "dapo" else None, **kw)
        if cfg.loss.loss_type != "dapo":
            loss = loss * (len(part) / len(batch))
        if not torch.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            log.warning("non-finite loss (%s): step skipped", loss.item())
            return None
        loss.backward()
        loss_total += float(loss.detach())
        w = m["num_tokens"].item() / max(total_tokens, 1)
        for k, v in m.items():
            if k == "num_tokens":
                continue
            sums[k] = sums.get(k, 0.0) + float(v) * w if k not in ("ratio_max", "ratio_min") else (
                max(sums.get(k, -math.inf), float(v)) if k == "ratio_max" else min(sums.get(k, math.inf), float(v)))
    params = [p for p in policy.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.learner.max_grad_norm))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        log.warning("non-finite gradient norm: step skipped")
        return None
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_total, "grad_norm": grad_norm, "tokens": total_tokens,
            "zero_variance": int(zero_var.sum()), "adv": torch.cat(advs), **sums}


def split_micro_batches(batch: list[Accepted], max_tokens: int | None) -> list[list[Accepted]]:
    """Whole groups per micro-batch (one vision pass per group), at most ``max_tokens`` tokens each
    (a single larger group gets a micro-batch of its own)."""
    if not max_tokens:
        return [batch]
    parts: list[list[Accepted]] = [[]]
    size = 0
    for a in batch:
        n = sum(len(a.group.prompt_ids) + len(c.token_ids) for c in a.group.completions)
        if parts[-1] and size + n > max_tokens:
            parts.append([])
            size = 0
        parts[-1].append(a)
        size += n
    return parts


def step_record(state: LearnerState, batch: list[Accepted], out: dict, step_s: float, wait_s: float, scheduler) -> dict:
    """The ``metrics.jsonl`` line of one step."""
    per_fn: dict[str, list[float]] = {}
    for a in batch:
        for c in a.group.completions:
            for k, v in c.rewards.items():
                per_fn.setdefault(k, []).append(v)
    totals = [c.reward for a in batch for c in a.group.completions]
    stale = [a.staleness for a in batch]
    lengths = [len(c.token_ids) for a in batch for c in a.group.completions]
    rec = {
        "step": state.step, "version": state.version, "time": time.time(),
        "reward": float(np.mean(totals)), "rewards": {k: float(np.mean(v)) for k, v in per_fn.items()},
        "accuracy": float(np.mean(per_fn["accuracy"])) if "accuracy" in per_fn else None,
        "group_accuracy": [float(np.mean([c.rewards.get("accuracy", 0.0) for c in a.group.completions]))
                           for a in batch] if "accuracy" in per_fn else None,
        "loss": out["loss"], "kl": out.get("kl", 0.0), "entropy": out.get("entropy"),
        "clip_frac": out.get("clip_frac", 0.0), "clip_frac_low": out.get("clip_frac_low", 0.0),
        "clip_frac_high": out.get("clip_frac_high", 0.0), "ratio_mean": out.get("ratio_mean"),
        "ratio_max": out.get("ratio_max"), "ratio_min": out.get("ratio_min"), "grad_norm": out["grad_norm"],
        "adv_mean": float(out["adv"].mean()), "adv_std": float(out["adv"].std()) if out["adv"].numel() > 1 else 0.0,
        "zero_variance_groups": out["zero_variance"],
        "staleness_mean": float(np.mean(stale)), "staleness_max": int(max(stale)),
        "groups_trained": state.groups_trained, "groups_dropped": dict(state.dropped), "tokens": out["tokens"],
        "completion_len_mean": float(np.mean(lengths)), "lr": scheduler.get_last_lr()[0],
        "seconds": step_s, "wait_seconds": wait_s,
    }
    return rec


def export_prometheus(rec: dict, batch: list[Accepted], state: LearnerState) -> None:
    M.LOSS.set(rec["loss"])
    M.KL.set(rec["kl"])
    M.GRAD_NORM.set(rec["grad_norm"])
    if rec["entropy"] is not None:
        M.ENTROPY.set(rec["entropy"])
    for side, key in (("low", "clip_frac_low"), ("high", "clip_frac_high"), ("total", "clip_frac")):
        M.CLIP_FRACTION.labels(side=side).set(rec[key])
    for stat in ("mean", "max", "min"):
        if rec[f"ratio_{stat}"] is not None:
            M.IMPORTANCE_RATIO.labels(stat=stat).set(rec[f"ratio_{stat}"])
    M.POLICY_VERSION.labels(role="learner").set(state.version)
    M.STEP_SECONDS.set(rec["seconds"])
    M.GROUPS.labels(event="trained").inc(len(batch))
    M.TOKENS.labels(role="learner").inc(rec["tokens"])
    for a in batch:
        M.STALENESS.observe(a.staleness)
