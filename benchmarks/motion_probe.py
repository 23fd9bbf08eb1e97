"""How fast can the tiny model learn the motion demo's directions *with labels*? (a capacity probe)

Supervised training on the answer letter only (cross-entropy over the four option letters at the
position after ``<answer>``), batch 16, AdamW, all weights trained, from the motion demo's warmed
model; every 25 steps, greedy accuracy on held-out direction records (the last fifth of the first
300 shuffled records). GRPO cannot learn faster than this, so a data or model setting that makes
the probe slow or seed-dependent will make the RL demo so too; one probe run takes ~20-50 s on one
core, a GRPO run minutes.

Figure: ``motion_probe_seeds_at_0.9`` = seeds whose held-out accuracy reached 0.9 within
``--steps``, against the number of seeds; per-seed accuracy curves under the result's ``runs``.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.motion_probe [--seeds 0,1,2,3,4,5] [--steps 200] \\
        [--set data.min_pixels=12544 --set data.max_pixels=12544]
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.common import emit, figure, machine_info, write_result
from benchmarks.loop_runs import WORK

MOTION_WORK = WORK / "motion"
BATCH = 16
EVAL_EVERY = 25


def probe(model_dir: Path, train: Path, seed: int, steps: int, lr: float, sets: list[str],
          config: str = "demo-motion", kind: str = "direction") -> dict[str, Any]:
    """One supervised run; returns {"accs": [...every EVAL_EVERY steps], "hit": step or None, "seconds"}."""
    import torch
    from transformers import AutoModelForImageTextToText

    from streamgrpo.config import load_config
    from streamgrpo.data.prompts import build_prompt_text, processor_inputs
    from streamgrpo.data.records import load_records
    from streamgrpo.data.video import load_visuals
    from streamgrpo.engines.hf import collate_prompts
    from streamgrpo.models.loading import load_processor
    from streamgrpo.recipes.demo.warm import append_tokens

    cfg = load_config(config, [f"data.train_path={train}", "demo.make_data=false", *sets])
    records = [r for r in load_records(train, cfg.data) if r.kind == kind]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rng.shuffle(records)
    proc = load_processor(str(model_dir))
    tok = proc.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    vp = proc.video_processor
    items = []
    for rec in records[:300]:
        visuals = load_visuals(rec, cfg.data, factor=vp.patch_size * vp.merge_size, temporal_patch=vp.temporal_patch_size)
        letter = re.search(r"\(([A-D])\)", rec.answer).group(1)
        items.append((processor_inputs(proc, build_prompt_text(proc, rec, cfg.data), visuals), "ABCD".index(letter)))
    cut = int(0.8 * len(items))
    train_items, test_items = items[:cut], items[cut:]
    letters = torch.tensor([tok.convert_tokens_to_ids(c) for c in "ABCD"])
    answer_ids = torch.tensor(tok.encode(f"<{cfg.data.answer_tag}>", add_special_tokens=False))

    def batch_of(chosen):
        rows = [append_tokens(inp, answer_ids) for inp, _ in chosen]
        return collate_prompts(rows, tok.pad_token_id), torch.tensor([t for _, t in chosen])

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=cfg.learner.adam_eps)
    accs: list[float] = []
    hit = None
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        model.train()
        batch, target = batch_of([train_items[rng.randrange(len(train_items))] for _ in range(BATCH)])
        loss = torch.nn.functional.cross_entropy(model(**batch).logits[:, -1][:, letters], target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                batch, target = batch_of(test_items)
                correct = int((model(**batch).logits[:, -1][:, letters].argmax(1) == target).sum())
            acc = correct / len(test_items)  # counted, not a float32 mean: 54/60 must count as 0.9
            accs.append(round(acc, 3))
            if hit is None and correct >= 0.9 * len(test_items) - 1e-9:
                hit = step
    return {"accs": accs, "hit": hit, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(MOTION_WORK / "model"), help="warmed motion model (bench_motion builds it)")
    ap.add_argument("--data", default=str(MOTION_WORK / "data" / "train.jsonl"))
    ap.add_argument("--seeds", default="0,1,2,3,4,5")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--set", action="append", default=[], help="config overrides (data.min_pixels=..., ...)")
    ap.add_argument("--config", default="demo-motion", help="demo-needle: the needle recipe (with its --model/--data)")
    ap.add_argument("--kind", default="direction", help="question kind to train and test on (needle for demo-needle)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"{args.model}: no model there; `python -m benchmarks.bench_motion` builds it first")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs = {}
    for seed in seeds:
        runs[seed] = probe(Path(args.model), Path(args.data), seed, args.steps, args.lr, args.set, args.config, args.kind)
        print(f"# seed {seed}: hit 0.9 at step {runs[seed]['hit']}; accuracy every {EVAL_EVERY} steps "
              f"{runs[seed]['accs']} ({runs[seed]['seconds']} s)", flush=True)
    reached = sum(1 for r in runs.values() if r["hit"] is not None)
    fig = emit(figure("motion_probe_seeds_at_0.9", reached, len(seeds),
                      note=f"seeds whose supervised held-out accuracy reached 0.9 within {args.steps} steps; "
                           f"overrides {args.set or 'none'}"))
    write_result("motion_probe", [fig], machine_info(), vars(args), {"runs": runs}, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
