"""The learner process (``streamgrpo learner --config F``): groups in, new weights out.

One process, or several DeepSpeed ranks under ``torchrun`` (``learner.backend=deepspeed``). Every
rank is consumer ``learner-<rank>`` of the same Redis consumer group, so groups spread over the
ranks with no coordinator. With ``learner.sequence_parallel`` N the ranks of a sequence-parallel group train the
same groups: its first rank alone reads them (its replica's share) and hands them to the others, and it alone
commits, audits and counts them (:class:`~streamgrpo.learner.distributed.ReadLayout`). One top-down loop per
optimizer step:

1. every rank takes its share (``groups_per_step / world_size``) of groups from the queue, dropping
   stale ones (``learner.max_staleness`` versions behind, or ahead: made by weights a resumed learner
   rolled back), ones whose token ids the model cannot embed (dead-lettered), ones it trained before
   (``duplicate``) and ones whose re-processed prompt ids differ from the message (``mismatch``);
   the ranks poll in lockstep rounds and go on once every rank has its share (or all stop together);
   groups over ``learner.max_group_pixels`` / ``max_group_tokens`` (``too_large``) and groups the
   learner died on in ``learner.crash_loop_starts`` starts (``crash_loop``) are dead-lettered first,
   before any visual is decoded (:mod:`~streamgrpo.learner.intake.screen`);
2. :meth:`~streamgrpo.learner.trainer.Learner.train_step`: advantages, log-probs (+ reference), the
   clipped loss, micro-batched backward, one optimizer step (see :mod:`streamgrpo.learner.trainer`). If it
   raises or its loss is not finite, a one-rank learner probes each group alone (forward and
   backward, nothing applied): groups that fail alone are dead-lettered (``poison``), the others
   train in a later step. Otherwise the failure is counted per group in Redis and re-raised; a
   group that failed ``queue.max_failures`` times is dead-lettered when next read;
3. bump the policy version (identical on every rank by construction);
4. rank 0 publishes weights every ``weights.sync_every`` steps (ZeRO-3 partitions are gathered
   first), writes the ``metrics.jsonl`` line (numbers of all ranks merged), sets the Prometheus
   gauges and logs to wandb;
5. every ``learner.save_steps`` steps and at the end/SIGTERM: a checkpoint (every rank takes part),
   then each rank *commits* the groups it trained since the last one (marked trained, acked and
   deleted in Redis, atomically), with the checkpoint's data cursor: per generator shard, the furthest
   record trained or dropped (:mod:`streamgrpo.data.cursor`), where a restarted generator continues.

Exactly once. A group's effect becomes durable with the checkpoint that holds it, and only then is
it committed in Redis: until then its entry stays pending and held. After a crash the learner
resumes from the newest checkpoint, first commits what that checkpoint recorded as committing (it
may have crashed in between), trims ``metrics.jsonl`` and its audit log back to the checkpoint's
step, and re-reads its pending entries: the groups trained after the checkpoint are trained again,
those in it never are. Cost: Redis keeps the messages of up to ``save_steps x groups_per_step``
trained groups until the next checkpoint.

Each rank serves ``/metrics`` (local rank r on ``metrics.port + r``, or a free port when it is 0; ports
in ``<run_dir>/ports/learner.json`` and ``learner-rank<r>.json``): counters (groups, tokens, drops,
idle time) are per rank and Prometheus sums them over the scraped ranks; step gauges (loss, KL, ...)
come from rank 0 alone and cover the whole step.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from streamgrpo import metrics as M
from streamgrpo.config import Config, MetricsConfig
from streamgrpo.config.budget import redis_budget_warning
from streamgrpo.data.cursor import advance
from streamgrpo.learner.agreement_guard import BUCKETS, AgreementGuard, DriftGuard
from streamgrpo.learner.checkpoint.commit import Checkpointing
from streamgrpo.learner.checkpoint.resume import (
    _audits_of_absent_ranks,
    adopt_absent_ranks,
    final_checkpoint,
    resume_from,
    start_from_weights,
    start_point,
    weights_source,
)
from streamgrpo.learner.distributed import (
    DistInfo,
    ReadLayout,
    barrier,
    gather_json,
    hand_out,
    init_distributed,
)
from streamgrpo.learner.intake.crash_loop import CrashLoopBreaker
from streamgrpo.learner.intake.gate import CommitFirst, Gate, MemoryWatch, collect_groups
from streamgrpo.learner.intake.limits import GroupLimits
from streamgrpo.learner.intake.media import MediaResolver, MediaWatch, ReadAhead, check_media_root
from streamgrpo.learner.intake.poison import guarded_step
from streamgrpo.learner.intake.screen import Screen
from streamgrpo.learner.state import Accepted, LearnerState
from streamgrpo.learner.step_data import StepOutput, StepRecord, StepSummary
from streamgrpo.learner.tracking import Tracker, sample_rows
from streamgrpo.learner.trainer import Learner
from streamgrpo.metrics import start_metrics
from streamgrpo.models.card import model_card
from streamgrpo.runtime import collector
from streamgrpo.runtime.jsonl import JsonlWriter, rewind_jsonl, write_json
from streamgrpo.runtime.processes import StopFlag, setup_torch_threads
from streamgrpo.runtime.run_dir import RunLock
from streamgrpo.transport.queue.base import QueueStopped
from streamgrpo.transport.queue.factory import open_queue, queue_url
from streamgrpo.transport.queue.server import durability_warning
from streamgrpo.transport.weights.factory import publisher_from_config

log = logging.getLogger("streamgrpo.learner")


def _warn_if_not_durable(queue) -> None:
    """Say once at start-up when the queue's Redis can lose acknowledged groups in a crash."""

    settings = queue.persistence()
    line = durability_warning(settings) if settings is not None else None  # None: CONFIG refused
    if line:
        log.warning("%s", line)


def _warn_if_redis_small(queue, cfg: Config) -> None:
    """Say once at start-up when the groups the learner may hold (uncommitted window and backlog)
    would not fit in Redis' ``maxmemory``."""
    try:
        _used, limit = queue.memory()
    except Exception:  # noqa: BLE001 - INFO refused (ACL, managed Redis): nothing to compare with
        return
    line = redis_budget_warning(cfg, limit)
    if line:
        log.warning("%s", line)


def run_learner(cfg: Config, *, stop: StopFlag | None = None, dist: DistInfo | None = None) -> int:
    """Train until ``learner.max_steps`` or a stop signal; rank 0 owns the run directory meanwhile (a
    second learner there refuses in one line)."""
    dist = dist or init_distributed(cfg.learner.backend, dist_backend=cfg.learner.dist_backend,
                                    sequence_parallel=cfg.learner.sequence_parallel)
    owner = RunLock(cfg.run_dir, "learner", "learner") if dist.is_main else None
    try:
        return _train(cfg, stop=stop, dist=dist)
    finally:
        if owner is not None:
            owner.close()


def _crash_loop_breaker(cfg: Config, queue, layout: ReadLayout, dist: DistInfo, run_dir: Path) -> CrashLoopBreaker:
    """The crash-loop breaker, once it has judged the deaths of the last learner's ranks: a reader its own, those of
    the consumers this start lacks (their pending groups claimed now, before they go stale) and its helpers' (their
    steps are its groups); a sequence-parallel helper judges nothing (its reader does). Every rank calls it."""
    breaker = CrashLoopBreaker(queue.crash_marks(), cfg.learner.crash_loop_starts, ranks=layout.world_size,
                               crash_dir=run_dir / "crash")
    if layout.reads:  # the groups of a step (or a read-ahead decode) those learners died in
        breaker.on_start([*adopt_absent_ranks(queue, layout), *(f"learner-{r}" for r in layout.helpers)])
    if layout.sequence_parallel > 1:
        barrier(dist)  # a helper empties its crash record (arms it) once its reader has read it
    if not layout.reads:
        breaker.arm()
    return breaker


def _train(cfg: Config, *, stop: StopFlag | None, dist: DistInfo) -> int:

    stop = stop if stop is not None else StopFlag()
    main = dist.is_main
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_torch_threads()
    torch.manual_seed(cfg.seed)
    ckpt_root = run_dir / "checkpoints"
    for line in cfg.advice() if main else []:
        log.warning("config: %s", line)
    found = start_point(cfg.learner, run_dir, dist)
    weights_from = weights_source(cfg.learner, found, run_dir)

    # --- policy, reference, optimizer (DeepSpeed engine); resume ----------------------------
    learner = Learner(cfg, dist=dist)
    layout = ReadLayout(dist.rank, dist.world_size, cfg.learner.sequence_parallel)  # who reads the queue
    queue = open_queue(cfg.queue, queue_url(cfg.queue, run_dir), consumer=f"learner-{dist.rank}", stop=stop)
    if main:
        _startup_warnings(cfg, queue)
    audit_path = run_dir / "audit" / ("learner.jsonl" if main else f"learner-rank{dist.rank}.jsonl")
    again = _resume_or_reset(found, learner, queue, audit_path, run_dir, dist, resume=cfg.learner.resume)
    if weights_from is not None:
        start_from_weights(weights_from, learner, dist)
    state = learner.state

    # --- weights, metrics, wandb ---------------------------------------------------------------
    publisher = _start_publisher(cfg, run_dir) if main else None
    learner.publish(publisher, state.version)
    M.POLICY_VERSION.labels(role="learner").set(state.version)
    server = _serve_metrics(cfg, run_dir, dist)
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl") if main else None
    audit = _open_audit(audit_path, state, found, again=again)
    tracker = Tracker.from_config(cfg, run_dir, enabled=main)
    # generators = learner, watched live: staleness-0 tokens exactly, older ones against their own history
    agreement = (AgreementGuard.from_config(cfg.learner), DriftGuard.from_config(cfg.learner)) if main else None
    media = MediaResolver(cfg.data, cfg.learner.media_cache_mib, cfg.learner.media_workers,
                          max_source_pixels=cfg.learner.max_source_pixels)
    gate = Gate(queue, cfg.loss, state, audit, learner.processor, learner.vocab_size, media=media,
                media_watch=MediaWatch(cfg.data, cfg.learner.media_unavailable_s),
                max_staleness=cfg.learner.max_staleness)
    carry: list[Accepted] = []  # groups kept from a step that failed on another group
    last_metrics: dict[str, Any] = {}
    # checkpoint, then commit what it holds (in the background with learner.async_checkpoint)
    ckpts = Checkpointing(learner, queue, dist, ckpt_root, asynchronous=cfg.learner.async_checkpoint,
                          model_card=lambda: model_card(cfg, state.to_json(), last_metrics))
    want = layout.share(cfg.learner.groups_per_step)
    breaker = _crash_loop_breaker(cfg, queue, layout, dist, run_dir)
    media.breaker = breaker  # read-ahead decodes are marked too: a group that kills the learner there is counted
    screened = Screen(queue, gate, GroupLimits.from_config(cfg), breaker)  # too large, crash-looped: before decoding
    source = ReadAhead(screened, media, ahead=want)  # groups by reference: the next step's decoded while this one trains
    if main:
        log.info("learner ready: %d rank(s), policy v%d, %d groups per step (%d per %s), max %d steps",
                 dist.world_size, state.version, cfg.learner.groups_per_step, want,
                 "rank" if layout.sequence_parallel == 1 else f"group of {layout.sequence_parallel} ranks",
                 cfg.learner.max_steps)
    watch = MemoryWatch(queue) if main else None
    collector.started()  # set up: cyclic garbage collection from here on (paused by python -m streamgrpo)
    # held = trained since the last checkpoint, or in a background write not committed yet (it frees nothing
    # until its commit, which a learner waiting for groups in a full Redis would otherwise never reach)
    pressure = (lambda: watch.check(holding=ckpts.holding)) if watch is not None else None
    # Redis full and nothing trained to commit: a smaller step, whose commit then frees its groups
    redis_full = (lambda: watch.full and not ckpts.holding) if watch is not None else None
    finished = False
    try:
        while state.step < cfg.learner.max_steps:
            # 1. every reader collects its share of usable groups (all ranks go on, or all stop)
            t_wait = time.perf_counter()
            source.ahead = want if state.step + 1 < cfg.learner.max_steps else 0  # the last step reads nothing ahead
            batch = collect_groups(source, gate, stop, dist, want, carry, timeout_s=cfg.learner.get_timeout_s,
                                   pressure=pressure, redis_full=redis_full, reads=layout.reads)
            if isinstance(batch, CommitFirst):  # Redis near maxmemory: the commit frees what this learner holds
                log.warning("%s with %d step(s) of groups uncommitted%s: checkpointing at step %d now to commit and "
                            "free them", batch.why, state.step - ckpts.saved_step,
                            " and a checkpoint write in flight" if ckpts.in_flight else "", state.step)
                ckpts.commit_now()
                carry = batch.carry
                continue
            wait_s = time.perf_counter() - t_wait
            carry = []
            if batch is None:
                break  # stopping
            # 2. one optimizer step over all ranks' groups (a sequence-parallel group's: its reader's)
            t0 = time.perf_counter()
            batch, later = breaker.isolate(batch)  # a group the learner died with trains alone
            sp_group = learner.seq_parallel.group
            # every rank marks the groups it steps; a sequence-parallel helper its reader's, before it takes them
            with breaker.stepping(hand_out([a.group.group_id for a in batch], layout, sp_group)):
                batch = hand_out(batch, layout, sp_group)
                out, carry = guarded_step(learner, queue, gate, batch, dist, reads=layout.reads)
            carry += later
            step_s = time.perf_counter() - t0
            if out is None:  # nothing applied anywhere (a failed group was isolated, or a non-finite loss)
                continue
            # 3. bump the version (every rank alike); a reader's groups wait for the next checkpoint
            mine = batch if layout.reads else []  # a sequence-parallel group's groups are its reader's to count
            summary = (StepSummary.of_rank(batch, out, gate.drops, gate.dropped_at) if layout.reads
                       else StepSummary.of_helper(out))
            merged = StepSummary.merge(gather_json(dist, summary.to_json()))
            gate.drops.clear()
            gate.dropped_at = {}
            state.step += 1
            state.version += 1
            state.groups_trained += merged.groups
            state.tokens_trained += merged.stats.tokens
            state.dropped.update(merged.drops)
            state.remember(merged.group_ids)
            state.data_cursor = advance(state.data_cursor, merged.consumed_at)  # committed with the next checkpoint
            ids = [a.group.group_id for a in mine]
            ckpts.trained([(a.stream_id, a.group.group_id) for a in mine])
            record = _trained_record(state, ids, learner, cfg.learner.replica_check_every)  # every rank: a collective
            if layout.reads:
                audit.write(record)
            # 4. weights out, metrics
            if state.step % cfg.weights.sync_every == 0:
                learner.publish(publisher, state.version)
            rec = StepRecord.build(state, merged, out, step_s, wait_s, learner.last_lr())
            last_metrics = rec.to_json()
            _report_step(cfg, state, rec, last_metrics, mine, out, main, metrics_log, tracker, agreement)
            # 5. checkpoint, then commit what it holds (a background write: once it is durable)
            ckpts.poll()
            if state.step % cfg.learner.save_steps == 0:
                ckpts.save()
        finished = True
    except QueueStopped as exc:  # SIGTERM during a Redis outage: unacked groups stay pending for the next start
        log.warning("%s; stopping", exc)
        finished = dist.world_size == 1  # one rank: the final checkpoint needs no peers
    finally:
        if finished:  # a clean stop: every rank is here, so collectives are safe
            final_checkpoint(dist, gate, state, ckpts.saved_step, ckpts)
        if main:
            write_json(run_dir / "learner_state.json", {k: v for k, v in state.to_json().items()
                                                        if k not in ("recent_group_ids", "committing")})
        _close_all(media, tracker, publisher, queue, metrics_log, audit, server)
    return 0


def _startup_warnings(cfg: Config, queue) -> None:
    """Rank 0, once at start-up: a Redis that can lose acknowledged groups or is too small for what the
    learner may hold, and a media root that groups sent by reference cannot be read from."""
    _warn_if_not_durable(queue)
    _warn_if_redis_small(queue, cfg)
    no_media = check_media_root(cfg.data)
    if no_media:
        log.warning("%s: groups whose visuals travel by reference (rollout.media: reference) will be "
                    "dead-lettered; point data.media_root at the media here, or send inline", no_media)


def _resume_or_reset(found: Path | None, learner: Learner, queue, audit_path: Path, run_dir: Path,
                     dist: DistInfo, resume: bool = False) -> bool:
    """Resume from the checkpoint ``found``, if any; otherwise (step 0) the logs lose the steps of a learner
    that died before its first checkpoint (no checkpoint holds them: they are trained again), and rank 0
    forgets the committed step of a previous run in this namespace. True when this start resumes (a
    checkpoint, or ``--resume`` after a learner killed before its first checkpoint)."""
    if found:
        resume_from(found, learner, queue, audit_path, run_dir, dist)
        return True
    again = resume and audit_path.is_file() and audit_path.stat().st_size > 0
    rewound = rewind_jsonl(audit_path, 0)
    if dist.is_main:  # and the logs of ranks this start lacks (killed on more ranks): the audit reads them all
        for path in [run_dir / "metrics.jsonl", *_audits_of_absent_ranks(audit_path.parent, dist.world_size)]:
            rewound += rewind_jsonl(path, 0)
    if rewound:
        log.info("no checkpoint: dropped %d log line(s) of steps trained by a learner that stopped before its "
                 "first checkpoint (their training is re-done)", rewound)
    if dist.is_main:
        queue.reset_committed_step()  # step 0: a previous run's commits in this namespace are not ours
    return again


def _serve_metrics(cfg: Config, run_dir: Path, dist: DistInfo):
    """This rank's ``/metrics`` server. Rank 0 exports the step's gauges; every rank its own counters, so
    the other ranks drop the step gauges first."""
    if not dist.is_main:
        M.drop_step_gauges()
    return start_metrics(_rank_metrics(cfg.metrics, dist), run_dir,
                         "learner" if dist.is_main else f"learner-rank{dist.rank}")


def _start_publisher(cfg: Config, run_dir: Path):
    """Rank 0's weight publisher, its ports written to ``<run_dir>/ports/weights.json``."""

    publisher = publisher_from_config(cfg.weights, run_dir)
    if publisher is not None:
        write_json(run_dir / "ports" / "weights.json", {"pub": publisher.pub_port, "snapshot": publisher.snapshot_port})
    return publisher


def _open_audit(path: Path, state: LearnerState, found: Path | None, again: bool = False) -> JsonlWriter:
    """This rank's audit log; a resumed run (``again``) first notes the checkpoint it resumed from (none:
    step 0, a learner killed before its first checkpoint)."""
    audit = JsonlWriter(path)
    if again:
        audit.write({"event": "resumed", "step": state.step, "version": state.version, "from": str(found or "")})
    return audit


def _close_all(*parts) -> None:
    """Close each part that exists, in the given order."""
    for part in parts:
        if part is not None:
            part.close()


def _trained_record(state: LearnerState, ids: list[str], learner: Learner, every: int) -> dict[str, Any]:
    """The audit line of a trained step (with the replicas' weight checksum every ``every`` steps)."""
    record: dict[str, Any] = {"event": "trained", "step": state.step, "version": state.version, "group_ids": ids}
    if every and state.step % every == 0:
        record["weights_checksum"] = learner.replicas_agree()
    return record


def _report_step(cfg: Config, state: LearnerState, rec: StepRecord, last_metrics: dict[str, Any],
                 batch: list[Accepted], out: StepOutput, main: bool, metrics_log: JsonlWriter | None, tracker,
                 agreement: tuple[AgreementGuard, DriftGuard] | None) -> None:
    """A trained step's numbers: Prometheus on every rank, and on rank 0 the metrics file, wandb, the log
    and the live agreement guard."""
    export_prometheus(rec, batch, out, main)
    if main:
        _log_step(cfg, state, rec, last_metrics, batch, metrics_log, tracker)
    if agreement is not None:
        _watch_agreement(agreement, rec)


def _watch_agreement(agreement: tuple[AgreementGuard, DriftGuard], rec: StepRecord) -> None:
    """Rank 0: the step's staleness-0 tokens into the exact guard, its older tokens into the per-bucket drift
    guard; their numbers to Prometheus; one warning line when the generators stop computing the learner's policy."""
    exact, drift = agreement
    lines = []
    line = exact.observe((rec.kl_fresh or 0.0) * rec.fresh_tokens, rec.fresh_tokens)
    if line is not None:
        M.AGREEMENT_WARNINGS.labels(staleness="0").inc()
        lines.append(line)
    kl = exact.mean()
    M.AGREEMENT_KL.set(math.nan if kl is None else kl)
    M.AGREEMENT_MAX_KL.set(exact.max_kl)
    for b in BUCKETS:
        if b in rec.staleness_kl:
            M.AGREEMENT_STALE_KL.labels(staleness=b).set(rec.staleness_kl[b])
            M.AGREEMENT_LOG_RATIO.labels(staleness=b).set(rec.staleness_log_ratio[b])
    verdicts, drifted = drift.observe(rec.staleness_buckets())
    for v in verdicts:
        M.AGREEMENT_DRIFT.labels(staleness=v.bucket).set(1.0 if v.firing else 0.0)
        if v.warning is not None:
            M.AGREEMENT_WARNINGS.labels(staleness=v.bucket).inc()
    for line in lines + drifted:
        log.warning("%s", line)


def _log_step(cfg: Config, state: LearnerState, rec: StepRecord, last_metrics: dict[str, Any],
              batch: list[Accepted], metrics_log: JsonlWriter, tracker) -> None:
    """Rank 0: the ``metrics.jsonl`` line, wandb (sample rows every ``metrics.sample_every`` steps) and
    the log line every ``metrics.log_every`` steps."""

    metrics_log.write(last_metrics)
    tracker.log_step(last_metrics, sample_rows(batch, state.step)
                     if state.step % cfg.metrics.sample_every == 0 else None)
    if state.step % cfg.metrics.log_every == 0:
        log.info(
            "step %d v%d reward %.3f acc %s loss %.4f kl %.4f clip %.3f stale %.1f | %.2fs train %.2fs wait",
            state.step, state.version, rec.reward, _fmt(rec.accuracy), rec.loss, rec.kl, rec.clip_frac,
            rec.staleness_mean, rec.seconds, rec.wait_seconds,
        )


def _rank_metrics(mcfg: MetricsConfig, dist: DistInfo) -> MetricsConfig:
    """Rank r serves /metrics on ``metrics.port`` + its local rank (0 stays 0: a free port each), so every
    node's ranks use the same ports."""
    if dist.local_rank == 0 or not mcfg.port:
        return mcfg
    return mcfg.model_copy(update={"port": mcfg.port + dist.local_rank})


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


# ------------------------------------------------------------------------------ step numbers
def export_prometheus(rec: StepRecord, batch: list[Accepted], out: StepOutput, main: bool) -> None:
    """Rank 0 sets the step gauges (whole step); every rank counts its own groups and tokens."""
    if main:
        M.LOSS.set(rec.loss)
        M.KL.set(rec.kl)
        if math.isfinite(rec.grad_norm):
            M.GRAD_NORM.set(rec.grad_norm)
        if rec.entropy is not None:
            M.ENTROPY.set(rec.entropy)
        for side, value in (("low", rec.clip_frac_low), ("high", rec.clip_frac_high), ("total", rec.clip_frac)):
            M.CLIP_FRACTION.labels(side=side).set(value)
        for stat, value in (("mean", rec.ratio_mean), ("max", rec.ratio_max), ("min", rec.ratio_min)):
            if value is not None:
                M.IMPORTANCE_RATIO.labels(stat=stat).set(value)
        for stat, value in (("ess", rec.ess), ("kl_behaviour", rec.kl_behaviour), ("is_masked_frac", rec.is_masked_frac)):
            if value is not None:
                M.OFF_POLICY.labels(stat=stat).set(value)
        M.STEP_SECONDS.set(rec.seconds)
        M.LEARNER_TOKENS_PER_SECOND.set(rec.tokens_per_second)
        M.LEARNER_MFU.set(math.nan if rec.mfu is None else rec.mfu)
    M.POLICY_VERSION.labels(role="learner").set(rec.version)
    M.GROUPS.labels(event="trained").inc(len(batch))
    M.TOKENS.labels(role="learner").inc(out.tokens if batch else 0)  # no groups: a sequence-parallel reader's
    for a in batch:
        M.STALENESS.observe(a.staleness)
