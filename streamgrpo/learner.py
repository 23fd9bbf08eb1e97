"""The learner process (``streamgrpo learner --config F``): groups in, new weights out.

One process, or several DeepSpeed ranks under ``torchrun`` (``learner.backend=deepspeed``). Every
rank is consumer ``learner-<rank>`` of the same Redis consumer group, so groups spread over the
ranks with no coordinator. One top-down loop per optimizer step:

1. every rank takes its share (``groups_per_step / world_size``) of groups from the queue, dropping
   stale ones (``loss.max_staleness`` versions behind, or ahead: made by weights a resumed learner
   rolled back), ones whose token ids the model cannot embed (dead-lettered), ones it trained before
   (``duplicate``) and ones whose re-processed prompt ids differ from the message (``mismatch``);
   the ranks poll in lockstep rounds and go on once every rank has its share (or all stop together);
2. :meth:`~streamgrpo.training.Learner.train_step`: advantages, log-probs (+ reference), the
   clipped loss, micro-batched backward, one optimizer step (see :mod:`streamgrpo.training`). If it
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
   deleted in Redis, atomically).

Exactly once. A group's effect becomes durable with the checkpoint that holds it, and only then is
it committed in Redis: until then its entry stays pending and held. After a crash the learner
resumes from the newest checkpoint, first commits what that checkpoint recorded as committing (it
may have crashed in between), trims ``metrics.jsonl`` and its audit log back to the checkpoint's
step, and re-reads its pending entries: the groups trained after the checkpoint are trained again,
those in it never are. Cost: Redis keeps the messages of up to ``save_steps x groups_per_step``
trained groups until the next checkpoint.

Each rank serves ``/metrics`` (rank r on ``metrics.port + r``, or a free port when it is 0; ports in
``<run_dir>/ports/learner.json`` and ``learner-rank<r>.json``): counters (groups, tokens, drops,
idle time) are per rank, step gauges (loss, KL, ...) come from rank 0 and cover the whole step.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamgrpo import metrics as M
from streamgrpo.config import Config, ConfigError
from streamgrpo.distributed import DistInfo, barrier, broadcast_json, gather_json, init_distributed, share
from streamgrpo.micro_batches import split_micro_batches  # noqa: F401 - re-exported: the learner's vocabulary
from streamgrpo.optim import lr_lambda, make_optimizer  # noqa: F401 - re-exported: the learner's vocabulary
from streamgrpo.runtime import (
    LEARNER_OUTPUTS,
    JsonlWriter,
    StopFlag,
    archive_previous,
    queue_url,
    rewind_jsonl,
    setup_torch_threads,
    start_metrics,
    write_json,
)
from streamgrpo.step_data import Probe, StepOutput, StepRecord, StepSummary
from streamgrpo.training import (  # noqa: F401 - re-exported: the learner's vocabulary
    Accepted,
    Learner,
    LearnerState,
)

log = logging.getLogger("streamgrpo.learner")


def _warn_if_not_durable(queue) -> None:
    """Say once at start-up when the queue's Redis can lose acknowledged groups in a crash."""
    import redis

    from streamgrpo.transport.redis_server import durability_warning

    try:
        settings = queue.client.config_get("append*")
    except redis.RedisError:  # CONFIG refused (managed Redis, ACL): nothing to say
        return
    text = lambda x: x.decode() if isinstance(x, bytes) else str(x)  # noqa: E731 - the client replies in bytes
    line = durability_warning({text(k): text(v) for k, v in settings.items()})
    if line:
        log.warning("%s", line)


def run_learner(cfg: Config, *, stop: StopFlag | None = None, dist: DistInfo | None = None) -> int:
    from streamgrpo.models.card import model_card
    from streamgrpo.tracking import Tracker
    from streamgrpo.transport.queue import QueueStopped, RedisQueue

    stop = stop if stop is not None else StopFlag()
    dist = dist or init_distributed(cfg.learner.backend, dist_backend=cfg.learner.dist_backend)
    main = dist.is_main
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_torch_threads()
    torch.manual_seed(cfg.seed)
    ckpt_root = run_dir / "checkpoints"
    for line in cfg.advice() if main else []:
        log.warning("config: %s", line)
    found = start_point(cfg, run_dir, dist)

    # --- policy, reference, optimizer (DeepSpeed engine); resume ----------------------------
    learner = Learner(cfg, dist=dist)
    queue = RedisQueue.from_config(cfg.queue, queue_url(cfg, run_dir), consumer=f"learner-{dist.rank}", stop=stop)
    if main:
        _warn_if_not_durable(queue)
    audit_path = run_dir / "audit" / ("learner.jsonl" if main else f"learner-rank{dist.rank}.jsonl")
    if found:
        resume_from(found, learner, queue, audit_path, run_dir, dist)
    state = learner.state

    # --- weights, metrics, wandb ---------------------------------------------------------------
    publisher = _start_publisher(cfg, run_dir) if main else None
    learner.publish(publisher, state.version)
    M.POLICY_VERSION.labels(role="learner").set(state.version)
    server = start_metrics(_rank_metrics_cfg(cfg, dist), run_dir, "learner" if main else f"learner-rank{dist.rank}")
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl") if main else None
    audit = _open_audit(audit_path, state, found)
    tracker = Tracker.from_config(cfg, run_dir, enabled=main)
    gate = Gate(queue, cfg, state, audit, learner.processor, learner.vocab_size)
    uncommitted: list[tuple[str, str]] = []  # (stream id, group id) this rank trained since the last checkpoint
    carry: list[Accepted] = []  # groups kept from a step that failed on another group

    def checkpoint_and_commit() -> None:
        state.committing = [tuple(e) for part in gather_json(dist, uncommitted) for e in part]
        learner.save(ckpt_root, model_card=model_card(cfg, state.to_json(), last_metrics) if main else None)
        queue.commit(uncommitted)  # the checkpoint is on disk: these groups' training is durable
        uncommitted.clear()
        state.committing = []

    last_metrics: dict[str, Any] = {}
    saved_step = state.step
    want = cfg.learner.groups_per_step // dist.world_size
    if main:
        log.info("learner ready: %d rank(s), policy v%d, %d groups per step (%d per rank), max %d steps",
                 dist.world_size, state.version, cfg.learner.groups_per_step, want, cfg.learner.max_steps)
    finished = False
    try:
        while state.step < cfg.learner.max_steps:
            # 1. every rank collects its share of usable groups (all ranks go on, or all stop)
            t_wait = time.perf_counter()
            batch = collect_groups(queue, gate, stop, dist, want, carry)
            wait_s = time.perf_counter() - t_wait
            carry = []
            if batch is None:
                break  # stopping
            # 2. one optimizer step over all ranks' groups
            t0 = time.perf_counter()
            out, carry = guarded_step(learner, queue, gate, batch, dist)
            step_s = time.perf_counter() - t0
            if out is None:  # nothing applied anywhere (a failed group was isolated, or a non-finite loss)
                continue
            # 3. bump the version (every rank alike); this rank's groups wait for the next checkpoint
            merged = StepSummary.merge(gather_json(dist, StepSummary.of_rank(batch, out, gate.drops).to_json()))
            gate.drops.clear()
            state.step += 1
            state.version += 1
            state.groups_trained += merged.groups
            state.tokens_trained += merged.stats.tokens
            state.dropped.update(merged.drops)
            state.remember(merged.group_ids)
            ids = [a.group.group_id for a in batch]
            uncommitted.extend((a.stream_id, a.group.group_id) for a in batch)
            audit.write(_trained_record(state, ids, learner, cfg.learner.replica_check_every))
            # 4. weights out, metrics
            if state.step % cfg.weights.sync_every == 0:
                learner.publish(publisher, state.version)
            rec = StepRecord.build(state, merged, out, step_s, wait_s, learner.last_lr())
            last_metrics = rec.to_json()
            export_prometheus(rec, batch, out, main)
            if main:
                _log_step(cfg, state, rec, last_metrics, batch, metrics_log, tracker, step_s, wait_s)
            # 5. checkpoint, then commit what it holds
            if state.step % cfg.learner.save_steps == 0:
                checkpoint_and_commit()
                saved_step = state.step
        finished = True
    except QueueStopped as exc:  # SIGTERM during a Redis outage: unacked groups stay pending for the next start
        log.warning("%s; stopping", exc)
        finished = dist.world_size == 1  # one rank: the final checkpoint needs no peers
    finally:
        if finished:  # a clean stop: every rank is here, so collectives are safe
            final_checkpoint(dist, gate, state, saved_step, checkpoint_and_commit)
        if main:
            write_json(run_dir / "learner_state.json", {k: v for k, v in state.to_json().items()
                                                        if k not in ("recent_group_ids", "committing")})
        _close_all(tracker, publisher, queue, metrics_log, audit, server)
    return 0


def resume_from(found: Path, learner: Learner, queue, audit_path: Path, run_dir: Path, dist: DistInfo) -> None:
    """Load the checkpoint ``found``, trim the logs back to its step (their training is re-done) and
    roll its commit forward on rank 0 (it may not have happened); every rank waits for that before it
    reads its pending entries."""
    learner.load(found)
    log.info("resumed from %s at step %d (policy v%d)", found, learner.state.step, learner.state.version)
    rewound = rewind_jsonl(audit_path, learner.state.step)
    if dist.is_main:
        rewound += rewind_jsonl(run_dir / "metrics.jsonl", learner.state.step)
        if learner.state.committing:  # roll the checkpoint's commit forward (it may not have happened)
            queue.commit(learner.state.committing)
    if rewound:
        log.info("dropped %d log line(s) written after step %d (their training is re-done)", rewound,
                 learner.state.step)
    barrier(dist)  # no rank reads its pending entries before the roll-forward


def final_checkpoint(dist: DistInfo, gate: Gate, state: LearnerState, saved_step: int,
                     checkpoint_and_commit: Callable[[], None]) -> None:
    """On a clean stop (every rank here): merge the drops since the last step, then checkpoint and
    commit what was trained since the last checkpoint."""
    from streamgrpo.transport.queue import QueueError

    for late in gather_json(dist, dict(gate.drops)):  # drops since the last step, of every rank
        state.dropped.update(late)
    if state.step > saved_step:
        try:
            checkpoint_and_commit()
        except QueueError as exc:  # checkpoint written; the next start commits what it recorded
            log.warning("checkpoint written, commit deferred to the next start: %s", exc)


def _start_publisher(cfg: Config, run_dir: Path):
    """Rank 0's weight publisher, its ports written to ``<run_dir>/ports/weights.json``."""
    from streamgrpo.transport.weight_channels import publisher_from_config

    publisher = publisher_from_config(cfg)
    if publisher is not None:
        write_json(run_dir / "ports" / "weights.json", {"pub": publisher.pub_port, "snapshot": publisher.snapshot_port})
    return publisher


def _open_audit(path: Path, state: LearnerState, found: Path | None) -> JsonlWriter:
    """This rank's audit log; a resumed run first notes the checkpoint it resumed from."""
    audit = JsonlWriter(path)
    if found:
        audit.write({"event": "resumed", "step": state.step, "version": state.version, "from": str(found)})
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


def _log_step(cfg: Config, state: LearnerState, rec: StepRecord, last_metrics: dict[str, Any],
              batch: list[Accepted], metrics_log: JsonlWriter, tracker, step_s: float, wait_s: float) -> None:
    """Rank 0: the ``metrics.jsonl`` line, wandb (sample rows every ``metrics.sample_every`` steps) and
    the log line every ``metrics.log_every`` steps."""
    from streamgrpo.tracking import sample_rows

    metrics_log.write(last_metrics)
    tracker.log_step(last_metrics, sample_rows(batch, state.step)
                     if state.step % cfg.metrics.sample_every == 0 else None)
    if state.step % cfg.metrics.log_every == 0:
        log.info(
            "step %d v%d reward %.3f acc %s loss %.4f kl %.4f clip %.3f stale %.1f | %.2fs train %.2fs wait",
            state.step, state.version, rec.reward, _fmt(rec.accuracy), rec.loss, rec.kl, rec.clip_frac,
            rec.staleness_mean, step_s, wait_s,
        )


def start_point(cfg: Config, run_dir: Path, dist: DistInfo) -> Path | None:
    """The checkpoint to resume from (None: start at step 0), agreed by every rank.

    A run directory with checkpoints is resumed with ``learner.resume`` (``--resume``) or set aside
    with ``learner.fresh`` (``--fresh``: checkpoints, metrics.jsonl and the learner's audit logs move
    to ``<run_dir>/previous/<time>/``); with neither, the learner refuses (ConfigError) rather than
    start at v0 next to them.
    """
    from streamgrpo.checkpoint import latest_checkpoint

    lc, root = cfg.learner, run_dir / "checkpoints"
    if lc.resume and lc.fresh:
        raise ConfigError("learner.resume and learner.fresh are both set: pick one")
    newest = broadcast_json(dist, str(latest_checkpoint(root) or ""))  # rank 0 decides for everyone
    if lc.resume:
        if not newest:
            log.info("resume: no checkpoint under %s, starting fresh", root)
        return Path(newest) if newest else None
    if newest and not lc.fresh:
        raise ConfigError(f"{run_dir} already has checkpoints (newest {Path(newest).name}): pass --resume "
                          "(learner.resume=true) to continue from it, or --fresh (learner.fresh=true) to start "
                          "over (they move to previous/)")
    if newest and dist.is_main:
        dest = archive_previous(run_dir, LEARNER_OUTPUTS)
        log.warning("--fresh: the previous run's checkpoints and logs moved to %s", dest)
    barrier(dist)
    return None


def _rank_metrics_cfg(cfg: Config, dist: DistInfo) -> Config:
    """Rank r serves /metrics on ``metrics.port + r`` (0 stays 0: a free port each)."""
    if dist.rank == 0 or not cfg.metrics.port:
        return cfg
    return cfg.model_copy(update={"metrics": cfg.metrics.model_copy(update={"port": cfg.metrics.port + dist.rank})})


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def token_problem(group, vocab_size: int) -> str | None:
    """Why the model cannot train on ``group``'s completion tokens (an id it cannot embed), or None."""
    for i, c in enumerate(group.completions):
        ids = np.asarray(c.token_ids)
        if ids.size and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
            return f"completions[{i}].token_ids: token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})"
    return None


class Gate:
    """What a rank lets into a step: staleness, de-duplication, all-equal rewards (with
    ``loss.drop_zero_variance``), vocabulary, prompt re-processing.

    Refused groups are released (stale, rolled_back, duplicate, zero_variance, mismatch) or
    dead-lettered (invalid, poison),
    counted in ``groups_dropped{reason}`` and in :attr:`drops` (merged into the step's numbers), and
    written to the audit log. Stale drops are also logged in bursts (one line per 10 s at most).
    """

    def __init__(self, queue, cfg: Config, state: LearnerState, audit, processor, vocab_size: int):
        self.queue, self.cfg, self.state, self.audit = queue, cfg, state, audit
        self.processor, self.vocab_size = processor, vocab_size
        self.drops: Counter = Counter()  # this rank's drops since the last step
        self._stale: list[int] = []  # policy versions of stale groups not logged yet
        self._stale_logged = 0.0

    def admit(self, d) -> Accepted | None:
        from streamgrpo.advantages import is_zero_variance
        from streamgrpo.data.prompts import processor_inputs

        g, state = d.group, self.state
        M.GROUPS.labels(event="consumed").inc()
        staleness = state.version - int(g.policy_version)
        if abs(staleness) > self.cfg.loss.max_staleness:
            # ahead of the learner: made by weights of a run that was rolled back (resumed) past them
            self.drop(d.stream_id, g.group_id, "stale" if staleness > 0 else "rolled_back")
            self._note_stale(int(g.policy_version))
            return None
        if state.trained_recently(g.group_id):  # in this learner's checkpoint although Redis forgot it
            self.drop(d.stream_id, g.group_id, "duplicate")
            return None
        if self.cfg.loss.drop_zero_variance and is_zero_variance([c.reward for c in g.completions]):
            self.drop(d.stream_id, g.group_id, "zero_variance")  # no gradient: take another group instead
            return None
        problem = token_problem(g, self.vocab_size)
        if problem:
            self.dead_letter(d.stream_id, g, f"group {g.group_id}: {problem}", "invalid")
            return None
        try:
            inputs = processor_inputs(self.processor, g.prompt_text, g.visuals)
            same = np.array_equal(np.asarray(inputs["input_ids"]).reshape(-1), g.prompt_ids)
        except Exception as exc:  # noqa: BLE001 - any failure to re-create the inputs is a mismatch
            log.warning("group %s (entry %s): cannot re-process its prompt: %s", g.group_id, d.stream_id, exc)
            same = False
        if not same:
            self.drop(d.stream_id, g.group_id, "mismatch")
            return None
        return Accepted(d.stream_id, g, inputs, staleness)

    def drop(self, stream_id: str, group_id: str, reason: str) -> None:
        M.GROUPS_DROPPED.labels(reason=reason).inc()
        self.drops[reason] += 1
        self.audit.write({"event": "dropped", "reason": reason, "group_id": group_id})
        self.queue.ack([stream_id])

    def dead_letter(self, stream_id: str, group, reason: str, label: str) -> None:
        self.drops[label] += 1
        self.audit.write({"event": "dropped", "reason": label, "group_id": group.group_id, "why": reason})
        self.queue.dead_letter(stream_id, group, reason, label=label)

    def _note_stale(self, version: int) -> None:
        self._stale.append(version)
        now = time.monotonic()
        if now - self._stale_logged >= 10.0:
            log.warning("dropped %d stale group(s) (policy v%d..v%d; learner at v%d, max_staleness %d): "
                        "generators are not keeping up with the weights", len(self._stale), min(self._stale),
                        max(self._stale), self.state.version, self.cfg.loss.max_staleness)
            self._stale, self._stale_logged = [], now


def collect_groups(queue, gate: Gate, stop, dist: DistInfo, want: int, carry: list[Accepted]) -> list[Accepted] | None:
    """This rank's ``want`` usable groups once every rank has its share; None when stopping.

    ``carry``: groups already accepted (kept from a failed step) that count toward ``want``. Ranks
    poll in rounds of at most ``learner.get_timeout_s`` and agree after each round (one small
    all-reduce), so no rank waits in a collective for longer than a round. With
    ``loss.drop_zero_variance`` a step that has waited ``loss.fill_timeout_s`` trains on what it has
    once every rank holds at least one group.
    """
    accepted: list[Accepted] = list(carry)
    state = gate.state
    loss = gate.cfg.loss
    fill_by = time.monotonic() + loss.fill_timeout_s if loss.drop_zero_variance else math.inf
    while True:
        if len(accepted) < want and not stop:
            t0 = time.perf_counter()
            deliveries = queue.get(want - len(accepted), timeout_s=gate.cfg.learner.get_timeout_s)
            if not deliveries:
                M.IDLE_SECONDS.labels(role="learner").inc(time.perf_counter() - t0)
            for d in deliveries:
                a = gate.admit(d)
                if a is not None:
                    accepted.append(a)
        enough = len(accepted) >= want or (bool(accepted) and time.monotonic() >= fill_by)
        flags = share(dist, [enough, bool(stop), state.version])
        if (flags[:, 2] != state.version).any():  # identical by construction; a mismatch is a bug worth stopping for
            raise RuntimeError(f"learner ranks disagree on the policy version: {flags[:, 2].astype(int).tolist()}")
        if flags[:, 0].all():
            if len(accepted) < want:
                log.info("step %d: %d of %d groups after waiting %.0fs for informative ones (drop_zero_variance)",
                         state.step + 1, len(accepted), want, loss.fill_timeout_s)
            return accepted
        if flags[:, 1].any():
            return None  # held groups stay pending: re-read by this consumer after a restart


def guarded_step(learner: Learner, queue, gate: Gate, batch: list[Accepted],
                 dist: DistInfo) -> tuple[StepOutput | None, list[Accepted]]:
    """``learner.train_step(batch)`` that one bad group cannot stop: returns ``(out, carry)``.

    ``out`` is None when nothing was applied; ``carry`` are groups to train in the next step. On an
    exception or a non-finite loss a one-rank torch learner probes each group alone (forward +
    backward, nothing applied): the groups that fail alone are dead-lettered (``poison``) and the
    rest carried over. When no single group explains the failure (or with several ranks, where one
    rank cannot probe alone), an exception is counted per group in Redis and re-raised (a restarted
    learner dead-letters a group at ``queue.max_failures``), and a non-finite loss drops the step's
    groups as ``nan_loss``.
    """
    try:
        out = learner.train_step(batch)
        error = None if out is not None else "non-finite loss or gradient"
    except Exception as exc:  # noqa: BLE001 - isolated below, re-raised when no group explains it
        out, error, raised = None, f"{type(exc).__name__}: {exc}", exc
    else:
        raised = None
    if out is not None:
        return out, []
    M.ERRORS.labels(kind="train").inc()
    where = ", ".join(f"{a.group.group_id} (entry {a.stream_id})" for a in batch)
    log.error("training step failed (%s) on groups %s", error, where)
    bad: list[tuple[Accepted, str]] = []
    if dist.world_size == 1 and not learner.deepspeed:
        learner.discard_gradients()
        for a in batch:
            try:
                probe: Probe = learner.train_step([a], dry_run=True)
                why = None if probe.finite else "non-finite loss"
            except Exception as exc:  # noqa: BLE001 - this group alone raises: it is the poison
                why = f"{type(exc).__name__}: {exc}"
            if why:
                bad.append((a, why))
        learner.discard_gradients()
    if bad and len(bad) < len(batch):
        for a, why in bad:
            gate.dead_letter(a.stream_id, a.group, f"group {a.group.group_id}: training on it alone failed: {why}",
                             "poison")
        poisoned = {id(a) for a, _ in bad}
        return None, [a for a in batch if id(a) not in poisoned]
    if raised is not None:
        queue.record_failure([a.group.group_id for a in batch], error)
        raise raised
    for a in batch:
        gate.drop(a.stream_id, a.group.group_id, "nan_loss")
    return None, []


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
    M.TOKENS.labels(role="learner").inc(out.tokens)
    for a in batch:
        M.STALENESS.observe(a.staleness)
