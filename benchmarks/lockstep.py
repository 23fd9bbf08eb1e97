"""The demo's GRPO loop in one process, with an exact, forced policy lag: the staleness study's driver.

Every optimizer step ``v`` trains on ``learner.groups_per_step`` groups sampled by policy version
``max(0, v - k)`` (the learner's weights of ``k`` steps ago), so every group of the run is exactly
``k`` steps stale (after the first ``k`` steps). The parts are the real ones a generator and the
learner use: the demo records and mp4 clips, the chat prompt and processor, :class:`HFEngine` sampling
with behaviour log-probs, :class:`RewardSet`, :class:`ScoredGroup`, and ``Learner.train_step`` with the
configured loss. Only the Redis queue and the ZeroMQ weight broadcast are left out: the sampler gets
``learner.policy_tensors()`` of version ``v - k`` directly, from a ring of the last ``k + 1`` versions.

Why not the real ``streamgrpo up`` with ``demo.weight_apply_delay=k``: there the lag is k plus
whatever the queue holds (k+0.5 on average, varying with timing), and two processes share the two
cores, so one run costs the whole machine. Here the lag is exact, the run is deterministic for a seed
and one run uses one core, so two runs go side by side.

Writes ``metrics.jsonl`` rows of the shape ``streamgrpo up`` writes (``step``, ``time``,
``group_accuracy``, ``seconds``, ``groups_trained``, ``staleness_mean``), so
:mod:`benchmarks.loop_runs` scores both the same way.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.lockstep --run-dir D --model M --data train.jsonl \\
        --lag 4 --steps 60 [--set loss.ratio_mode=current ...]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any


def lagged_version(step: int, lag: int) -> int:
    """The policy version that samples the groups of optimizer step ``step`` (1-based) under ``lag``."""
    return max(0, step - 1 - lag)


def run(run_dir: Path, model: Path, data: Path, *, lag: int, steps: int, sets: list[str], seed: int = 0,
        config: str = "demo", stop_after: int | None = None) -> dict[str, Any]:
    import numpy as np
    import torch

    from streamgrpo.config import load_config
    from streamgrpo.data.dataset import iter_samples
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs
    from streamgrpo.data.records import load_records
    from streamgrpo.engines.base import PromptRequest, SamplingParams
    from streamgrpo.engines.hf import HFEngine
    from streamgrpo.generator.sampling import sample_shuffled, score_group
    from streamgrpo.learner.trainer import Accepted, Learner
    from streamgrpo.models.loading import load_model
    from streamgrpo.rewards import RewardSet
    from streamgrpo.runtime.accuracy import target_reached

    torch.set_num_threads(1)
    cfg = load_config(config, [f"model.name_or_path={model}", "demo.tiny_model=false",
                               f"data.train_path={data}", "demo.make_data=false", f"seed={seed}",
                               f"run_dir={run_dir}", *sets])
    torch.manual_seed(seed)
    learner = Learner(cfg)
    processor = learner.processor
    engine = HFEngine(load_model(cfg.model, "cpu"), processor)
    vp = processor.video_processor
    records = load_records(cfg.data.train_path, cfg.data)
    if cfg.data.kinds:
        records = [r for r in records if r.kind in cfg.data.kinds]
    samples = iter_samples(records, cfg.data, shard=0, num_shards=1, seed=seed, epochs=None,
                           factor=vp.patch_size * vp.merge_size, temporal_patch=vp.temporal_patch_size)
    rewards = RewardSet(cfg)
    sampling = SamplingParams.from_config(cfg.rollout)
    contrast = cfg.rollout.temporal_contrast  # T-GRPO: shuffled-frame groups decide the `temporal` bonus
    shuffle_rng = np.random.default_rng(seed)
    history: collections.deque = collections.deque(maxlen=lag + 1)  # (version, tensors) of the last lag+1 versions
    history.append((0, {k: v.clone() for k, v in learner.policy_tensors().items()}))
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / "metrics.jsonl", "w")
    gps, ppb = cfg.learner.groups_per_step, cfg.rollout.prompts_per_batch
    t_start = time.time()
    gen_total = train_total = 0.0
    trained = 0
    recent: collections.deque = collections.deque(maxlen=40)  # accuracies of the last 40 groups, for the progress line
    rows: list[dict[str, Any]] = []  # for --stop-after: the step at which the 50-group accuracy reached 0.9
    hit: int | None = None
    for step in range(1, steps + 1):
        want = lagged_version(step, lag)
        version, tensors = next((v, t) for v, t in history if v == want)
        if engine.version != version or step == 1:
            engine.load_weights(version, tensors)
        t0 = time.perf_counter()
        groups = []
        while len(groups) < gps:
            chunk = list(itertools.islice(samples, min(ppb, gps - len(groups))))
            if not chunk:
                raise RuntimeError(f"lockstep: the data ran out at step {step} ({len(groups)} of {gps} groups)")
            reqs = []
            for record, visuals in chunk:
                text = build_prompt_text(processor, record, cfg.data)
                reqs.append(PromptRequest(text, visuals, processor_inputs(processor, text, visuals), record.id))
            outs_all = engine.generate(reqs, sampling)
            shuffled = sample_shuffled(engine, processor, reqs, sampling, contrast, shuffle_rng) if contrast else {}
            for i, ((record, visuals), req, outs) in enumerate(zip(chunk, reqs, outs_all)):
                groups.append(score_group(record, visuals, req, outs, rewards, version=version,
                                          generator_id="lockstep", model_id=str(model),
                                          temperature=sampling.temperature, shuffled=shuffled.get(i), contrast=contrast))
        gen_s = time.perf_counter() - t0
        batch = [Accepted(g.group_id, g, processor_inputs(processor, g.prompt_text, g.visuals), step - 1 - version)
                 for g in groups]
        t1 = time.perf_counter()
        result = learner.train_step(batch)
        train_s = time.perf_counter() - t1
        gen_total, train_total, trained = gen_total + gen_s, train_total + train_s, trained + len(groups)
        learner.state.step = step
        history.append((step, {k: v.clone() for k, v in learner.policy_tensors().items()}))
        acc = [float(np.mean([c.rewards.get("accuracy", c.reward) for c in g.completions])) for g in groups]
        temporal = [g.meta["temporal"] for g in groups if "temporal" in g.meta]
        recent.extend(acc)
        row = {"step": step, "time": time.time(), "group_accuracy": acc, "answers": [g.answer for g in groups],
               "seconds": train_s, "generate_s": gen_s,
               "groups_trained": trained, "staleness_mean": float(step - 1 - version),
               "loss": None if result is None else result.loss, "kl": None if result is None else result.stats.kl,
               "entropy": None if result is None else result.stats.entropy,
               "completions": [[c.text for c in g.completions] for g in groups],  # per group: which answers it sampled
               "skipped": result is None}
        if result is not None and result.update is not None:
            row["update_kl"], row["update_scale"] = result.update.kl_first, result.update.scale
        if temporal:
            row["temporal_applied"] = sum(bool(t["applied"]) for t in temporal) / len(temporal)
            row["p_shuffled"] = float(np.mean([t["p_shuffled"] for t in temporal]))
        out.write(json.dumps(row) + "\n")
        out.flush()
        if step % 10 == 0 or step == steps:
            print(f"[{run_dir.name}] step {step}/{steps} lag {step - 1 - version} accuracy(last 40 groups) "
                  f"{sum(recent) / len(recent):.3f}  {time.time() - t_start:.0f}s", flush=True)
        if stop_after is not None:
            rows.append({"step": step, "time": row["time"], "group_accuracy": acc})
            hit = hit if hit is not None else (target_reached(rows) or (None,))[0]
            if hit is not None and step >= hit + stop_after:
                steps = step
                break
    out.close()
    summary = {"steps": steps, "lag": lag, "wall_s": time.time() - t_start, "generate_s": gen_total,
               "train_s": train_total, "groups_trained": trained}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lockstep", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--lag", type=int, default=0, help="forced staleness k: groups of step v come from policy v-1-k")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="demo", help="shipped config name or YAML file (demo, demo-motion)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override, e.g. learner.learning_rate=1e-3")
    ap.add_argument("--stop-after", type=int, default=-1,
                    help="stop this many steps after the 50-group accuracy reached 0.9 (-1: run all --steps)")
    args = ap.parse_args(argv)
    if args.lag < 0 or args.steps < 1:
        ap.error("--lag must be >= 0 and --steps >= 1")
    run(args.run_dir, args.model, args.data, lag=args.lag, steps=args.steps, sets=args.sets, seed=args.seed,
        config=args.config, stop_after=None if args.stop_after < 0 else args.stop_after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
