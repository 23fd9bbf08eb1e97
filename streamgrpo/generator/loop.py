"""The generator process: prompts in, scored groups out (``streamgrpo generator --config F --id K``).

One top-down loop. Per batch of prompts: apply the newest verified weights (a safe point), sample
G completions per prompt, score them, and push one ScoredGroup per prompt into the Redis stream
(blocking under backpressure). A batch that runs the engine out of memory is sampled again in halves,
and the smaller batch is kept (:mod:`streamgrpo.generator.oom`); a generator where one prompt alone
does not fit stops with one line naming the settings to lower. Generator K reads shard K of ``rollout.num_generators``,
from where the learner's committed data cursor says the shard got (:mod:`streamgrpo.data.cursor`; the
beginning in a new run), and each group says where its prompt came from (``ScoredGroup.source``). SIGTERM
finishes the current batch and exits 0.

A generator that gets no weights from the learner says so
(:class:`~streamgrpo.generator.weights_watch.WeightsWatch`): it keeps
generating with its initial weights (v0), warns every ``weights.warn_every_s`` with the reason (key
refused, handshake failed, learner unreachable, nothing published yet), and exits with code 3
(``WEIGHTS_UNAVAILABLE_EXIT``) once ``weights.max_wait_s`` has passed without any version.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np

from streamgrpo import metrics
from streamgrpo.config import Config, ConfigError
from streamgrpo.config.roles import GeneratorConfig
from streamgrpo.data.cursor import Start, start_for
from streamgrpo.data.dataset import iter_positions
from streamgrpo.data.records import load_records
from streamgrpo.engines.base import Engine, SamplingParams
from streamgrpo.engines.hf import HFEngine
from streamgrpo.generator.applier import WeightApplier
from streamgrpo.generator.sampling import Sampler
from streamgrpo.generator.send import send_groups
from streamgrpo.generator.weights_watch import WEIGHTS_UNAVAILABLE_EXIT, WeightsUnavailable, WeightsWatch
from streamgrpo.metrics import start_metrics
from streamgrpo.models.loading import load_model, load_processor, resolve_device
from streamgrpo.models.lora import make_weight_applier
from streamgrpo.rewards import RewardSet
from streamgrpo.runtime import collector
from streamgrpo.runtime.jsonl import JsonlWriter
from streamgrpo.runtime.processes import StopFlag, setup_torch_threads
from streamgrpo.transport.queue.base import QueueStopped
from streamgrpo.transport.queue.factory import open_queue, queue_url
from streamgrpo.transport.weights.factory import subscriber_from_config
from streamgrpo.wire import Source

log = logging.getLogger("streamgrpo.generator")


def run_generator(cfg: Config | GeneratorConfig, generator_id: int = 0, *, stop: StopFlag | None = None,
                  applier: type[WeightApplier] = WeightApplier) -> int:
    """Sample, score and send groups until the data ends or a stop signal; ``applier`` applies weight
    versions at safe points (the staleness benchmark's lagging one, ``recipes/demo/lag.py``). The loop sees
    the generator's sections only (:class:`GeneratorConfig`)."""
    import torch

    cfg = GeneratorConfig.of(cfg)
    if not 0 <= generator_id < cfg.rollout.num_generators:
        raise ValueError(f"--id {generator_id} is outside 0..{cfg.rollout.num_generators - 1} (rollout.num_generators)")
    stop = stop if stop is not None else StopFlag()
    name = f"generator-{generator_id}"
    run_dir = Path(cfg.run_dir)
    setup_torch_threads()
    torch.manual_seed(cfg.seed * 1000 + generator_id)
    server = start_metrics(cfg.metrics, run_dir, name, hint="give each generator on a host its own --local-index K "
                           "(it serves metrics.port + K), or set metrics.port=0 (a free port)")
    audit = JsonlWriter(run_dir / "audit" / f"{name}.jsonl")

    # --- the policy, its processor, the engine; data, rewards, queue, weights ------------------
    device = resolve_device(cfg.rollout.device)
    processor = load_processor(cfg.model.name_or_path, cfg.model.revision)
    engine = make_engine(cfg, processor, device, name=name)
    records = train_records(cfg)
    rewards = RewardSet(cfg)
    tc = cfg.rollout.temporal_contrast  # T-GRPO: shuffled-frame groups, scored and never sent
    if tc is not None and tc.reward not in rewards.names:
        raise ConfigError(f"rollout.temporal_contrast.reward: {tc.reward!r} is not one of rewards.functions "
                          f"({', '.join(rewards.names)})")
    queue = open_queue(cfg.queue, queue_url(cfg.queue, run_dir), consumer=name, stop=stop)
    relay = None
    if cfg.weights.relay:  # versions from this host's relay (started here when none runs), not the learner
        from streamgrpo.relay.keeper import RelayKeeper

        relay = RelayKeeper(cfg, run_dir, name)
        relay.check()
    weights = subscriber_from_config(cfg.weights, run_dir, client_key=f"client-{generator_id}" if cfg.weights.curve_keys_dir else None,
                                     pin_memory=device.type == "cuda" and cfg.rollout.engine == "hf")
    sampler = Sampler(engine, processor, cfg, SamplingParams.from_config(cfg.rollout), rewards, name,
                       np.random.default_rng([cfg.seed, generator_id, 7]))
    apply_newest = applier(weights, make_weight_applier(cfg, engine), audit, name)
    watch = WeightsWatch.from_config(weights, cfg.weights, name)
    if cfg.rollout.inflight_updates:  # new versions also between the decoding steps of a batch (vLLM)
        sampler.between_steps = lambda: apply_newest(not_below=engine.version)
        if cfg.rollout.engine != "vllm":
            log.warning("%s: rollout.inflight_updates needs rollout.engine=vllm; the HF engine applies weights "
                        "between batches", name)
    apply_newest.snapshot(min(10.0, cfg.weights.max_wait_s or 10.0))  # a (re)started generator catches up first
    num_shards = cfg.rollout.num_generators
    shard_size = (len(records) + num_shards - 1 - generator_id) // num_shards
    log.info("%s: %d records in shard %d/%d, starting at policy v%d%s", name, shard_size, generator_id, num_shards,
             engine.version, "" if apply_newest.snapped else " (the initial weights: none from the learner yet)")
    vp = processor.video_processor
    shard = ShardSamples(lambda begin: iter_positions(
        records, cfg.data, shard=generator_id, num_shards=num_shards, seed=cfg.seed, epochs=cfg.rollout.num_epochs,
        factor=vp.patch_size * vp.merge_size, temporal_patch=vp.temporal_patch_size, start=begin),
        num_shards, generator_id, shard_size, name)
    # where this shard goes on: after the furthest record the learner consumed and committed (read once its
    # snapshot wait is over, so a learner that started too has reset it for a new run or restored it); with no
    # weights yet the learner may still be starting (a requeued job's learner resumes after its generators read
    # the cursor), so it is read again with each new version applied: a version at start may come from a relay
    # that outlived the last allocation, before the learner resumed and moved the cursor (one Redis read a version)
    shard.start(queue.committed_cursors())
    cursor_read_at = engine.version
    collector.started()  # set up: cyclic garbage collection from here on (paused by python -m streamgrpo)

    # --- one batch of prompts per turn: weights in (a safe point), groups out ------------------
    produced = code = 0
    try:
        while not stop:
            if relay is not None:
                relay.check()  # a relay that died is replaced
            apply_newest()
            if engine.version != cursor_read_at:  # a new version (lower too: a learner resumed from a checkpoint)
                shard.move_ahead(queue.committed_cursors())
                cursor_read_at = engine.version
            watch.check()  # warns while no weights arrive; raises WeightsUnavailable past weights.max_wait_s
            batch_size = sampler.batch.size  # rollout.prompts_per_batch, halved after running out of memory
            if cfg.rollout.sync:
                batch_size = queue.claim_sync_slots(engine.version, batch_size, cfg.sync_groups_per_step)
                if batch_size == 0:  # this version's share is produced: wait for the next one
                    apply_newest(block_s=1.0)
                    continue
            chunk = shard.take(batch_size)
            if not chunk:
                log.info("%s: data exhausted after %d groups", name, produced)
                break
            groups = with_sources(sampler.groups([(record, visuals) for _, _, record, visuals in chunk]), chunk,
                                  num_shards, generator_id)
            sent, gave_up = send_groups(queue, groups, stop, name, audit, tick=watch.check,
                                        grace_s=cfg.rollout.stop_grace_s)
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


class ShardSamples:
    """This generator's shard of the data from a data cursor (``make((epoch, position))`` iterates it from
    there), moved to a later committed cursor when the learner committed one after the generator started."""

    def __init__(self, make, num_shards: int, shard: int, shard_size: int, name: str):
        self.make, self.num_shards, self.shard, self.shard_size, self.name = make, num_shards, shard, shard_size, name
        self.at = (0, 0)
        self._it = iter(())
        self.cursor_step: int | None = None  # the learner's step of the cursor read at start
        self.seen_newer = False  # a cursor of a later step read since (the resumed learner's)

    def _go(self, start: Start) -> None:
        self.at = (start.epoch, start.position)
        self._it = self.make(self.at)
        self._passes()

    def _passes(self) -> None:  # streamgrpo_data_epochs: the passes this shard has had, where it is now
        metrics.DATA_EPOCHS.set(self.at[0] + self.at[1] / max(1, self.shard_size))

    def _step(self, committed) -> int | None:
        mine = committed.get((self.num_shards, self.shard))
        return None if mine is None else mine[2]

    def start(self, committed) -> None:
        start = start_for(committed, self.num_shards, self.shard, self.shard_size)
        (log.warning if start.warning else log.info)("%s: %s", self.name, start.line)
        self.cursor_step = self._step(committed)
        self._go(start)

    def move_ahead(self, committed) -> None:
        """Go to the committed cursor if it is past where this shard is (never back). The first cursor of a
        later step than the one read at start (a learner that resumed after this generator started) is said
        either way."""
        later = start_for(committed, self.num_shards, self.shard, self.shard_size)
        step = self._step(committed)
        newer = step is not None and (self.cursor_step is None or step > self.cursor_step)
        if (later.epoch, later.position) > self.at:
            log.info("%s: the learner committed a later data cursor: %s", self.name, later.line)
            self._go(later)
        elif newer and not self.seen_newer:
            log.info("%s: shard %d/%d: already past the data cursor committed by the learner at step %d (at epoch %d, "
                     "record %d)", self.name, self.shard, self.num_shards, step, *self.at)
        self.seen_newer = self.seen_newer or newer

    def take(self, n: int) -> list:
        chunk = list(itertools.islice(self._it, n))
        if chunk:
            self.at = (chunk[-1][0], chunk[-1][1] + 1)
            self._passes()
        return chunk


def with_sources(groups: list, chunk: list, num_shards: int, shard: int) -> list:
    """Each group of ``chunk`` (``(epoch, position, record, visuals)``, one group per prompt, in order) told
    where its prompt came from: the learner's data cursor moves by it."""
    if len(groups) != len(chunk):
        raise RuntimeError(f"{len(groups)} groups for {len(chunk)} prompts")
    for group, (epoch, position, _record, _visuals) in zip(groups, chunk):
        group.source = Source(num_shards, shard, int(epoch), int(position))
    return groups


def make_engine(cfg: Config | GeneratorConfig, processor, device, *, name: str = "generator") -> Engine:
    """The generator's engine for ``cfg`` (``check agreement`` samples with it too)."""
    cfg = GeneratorConfig.of(cfg)
    if cfg.rollout.engine == "vllm":
        from streamgrpo.engines.vllm import VLLMEngine

        return VLLMEngine.from_config(cfg, processor, name=name)

    return HFEngine(load_model(cfg.model, device, custom_mask=cfg.custom_mask), processor, device=device,
                    vision_cache_mib=cfg.rollout.vision_cache_mib)


def train_records(cfg: Config | GeneratorConfig) -> list:
    """The training records the generators read (``data.kinds`` applied)."""
    records = load_records(cfg.data.train_path, cfg.data)
    if cfg.data.kinds:
        records = [r for r in records if r.kind in cfg.data.kinds]
    if not records:
        raise ValueError(f"{cfg.data.train_path}: no records (kinds filter: {cfg.data.kinds})")
    return records


