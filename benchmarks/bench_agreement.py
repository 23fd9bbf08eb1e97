"""Generator = learner agreement at Qwen2.5-VL-3B's layer shapes in bf16, and what ``model.fp32_lm_head`` does.

A random-weight model at the real 3B shapes with ``--layers`` decoder layers and vision blocks (2: what a
CPU carries; every layer has its real size, the vocabulary and its projection too), the demo clips.
``streamgrpo check agreement``'s measurement (:func:`streamgrpo.commands.agreement.measure`: the HF
engine samples G completions per prompt at version 0, the torch learner recomputes them) under three
settings of the same model:

* ``bf16``: what the shipped GPU configs run: the engine in bf16, the learner with float32 master
  weights under bf16 autocast (``learner.bf16``). The baseline.
* ``bf16_fp32_head``: the same with ``model.fp32_lm_head`` (both roles' last projection in float32).
* ``fp32``: both roles in float32 (the floor: rounding of one float32 computation against another).

Figures: ``agreement_kl_<setting>`` (KL(behaviour || learner), k3, mean over tokens) and
``agreement_p99_<setting>`` (99th percentile of |d log p|), each against the ``bf16`` baseline (ratio <
1: closer agreement). Writes ``benchmarks/results/bench_agreement.json``.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_agreement [--layers 2] [--groups 2] [--n 4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import emit, figure, machine_info, write_result

SETTINGS = {
    "bf16": ["model.dtype=bfloat16", "learner.bf16=true"],
    "bf16_fp32_head": ["model.dtype=bfloat16", "learner.bf16=true", "model.fp32_lm_head=true"],
    "fp32": ["model.dtype=float32", "learner.bf16=false"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_agreement", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=4, help="completions per prompt (G)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="a model directory (default: build one at the 3B shapes)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from streamgrpo.commands.agreement import measure
    from streamgrpo.config import build_config
    from streamgrpo.models.tiny import build_tiny
    from streamgrpo.recipes.demo.data import make_demo

    with tempfile.TemporaryDirectory(prefix="bench-agreement-") as tmp:
        model = Path(a.model) if a.model else build_tiny(Path(tmp) / "model", size="3b", layers=a.layers)
        data = make_demo(Path(tmp) / "data", n=max(8, a.groups), seed=0)
        base = [f"model.name_or_path={model}", f"data.train_path={data / 'train.jsonl'}", "data.min_frames=4",
                "data.max_frames=4", "data.min_pixels=3136", "data.max_pixels=3136", "data.prompt_format=no_think",
                f"rollout.num_generations={a.n}", "rollout.device=cpu", "learner.device=cpu", "loss.beta=0",
                f"run_dir={Path(tmp) / 'run'}"]
        got = {name: measure(build_config({}, base + sets), a.groups, a.max_tokens, seed=0)
               for name, sets in SETTINGS.items()}
    for name, ag in got.items():
        print(f"# {name}: {ag.describe()}")
    figures = []
    for name, ag in got.items():
        figures.append(emit(figure(f"agreement_kl_{name}", ag.kl, got["bf16"].kl,
                                   note=f"KL(behaviour || learner) at staleness 0, {ag.tokens} tokens")))
        figures.append(emit(figure(f"agreement_p99_{name}", ag.abs_delta_p99, got["bf16"].abs_delta_p99,
                                   note="99th percentile of |learner - behaviour log-prob|")))
    write_result("bench_agreement", figures, machine_info(), vars(a),
                 data={"agreement": {k: v.to_dict() for k, v in got.items()}}, out=a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
