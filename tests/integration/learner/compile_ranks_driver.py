"""Run under torchrun (2 gloo ranks on the CPU) by test_learner_compile_ranks.py: ``learner.compile`` with DeepSpeed.

Each rank builds an eager and a compiled DeepSpeed learner (``--zero``: a shipped config's name; the tiny model,
``loss.beta > 0``: a compiled reference too) and trains both on its own share of the same groups, two steps of
different completion lengths; then each loads the other's checkpoint and trains a third step. Every rank writes
``--out``-rank<N>.json with what the test checks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgpack
import numpy as np
import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--groups", required=True, help="msgpack list of wire-encoded ScoredGroups: 2 steps' worth")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--zero", default="zero2")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from streamgrpo.config import load_config
    from streamgrpo.learner.distributed import init_distributed
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.models.batching import unwrap_model
    from streamgrpo.models.compile import compiled_graphs, decoder_layers, is_compiled
    from streamgrpo.models.files import read_model_tensors
    from streamgrpo.wire import decode

    groups = [decode(b) for b in msgpack.unpackb(Path(args.groups).read_bytes())]
    dist = init_distributed("deepspeed", dist_backend="gloo")
    half = len(groups) // 2  # two steps; each rank its own 2 groups of each (groups_per_step 4 over 2 ranks)
    mine = [groups[s * half + 2 * dist.rank: s * half + 2 * dist.rank + 2] for s in (0, 1)]

    def learner(run: str, *sets: str) -> Learner:
        cfg = load_config("demo", [f"model.name_or_path={args.model}", f"run_dir={Path(args.run_dir) / run}",
                                   "learner.groups_per_step=4", "loss.loss_type=dapo", "learner.learning_rate=1e-3",
                                   "model.tune_mm_vision=false", "learner.gradient_checkpointing=true",
                                   "loss.beta=0.04", "learner.backend=deepspeed",
                                   f"learner.deepspeed_config={args.zero}", *sets])
        torch.manual_seed(0)
        return Learner(cfg, dist=dist)

    def weights(lrn: Learner) -> dict[str, torch.Tensor]:  # ZeRO-0/1/2: whole on every rank
        return {n: p.detach().float().clone() for n, p in lrn.module.named_parameters() if p.requires_grad}

    eager = learner("eager")
    compiled = learner("compiled", "learner.compile=true", f"learner.compile_backend={args.backend}")
    seen: list[int] = []  # the decoder's sequence length of every compiled forward
    unwrap_model(compiled.module).model.language_model.register_forward_pre_hook(
        lambda _m, a, kw: seen.append(int(kw["inputs_embeds"].shape[1])), with_kwargs=True)
    out = {"rank": dist.rank, "zero_stage": compiled.zero_stage,
           "compiled": all(is_compiled(m) for m in decoder_layers(compiled.module) + decoder_layers(compiled.ref)),
           "eager_compiled": any(is_compiled(m) for m in decoder_layers(eager.module)),
           "same_names": list(compiled.module.state_dict()) == list(eager.module.state_dict()),
           "hooks": len(compiled.optimizer._grad_acc_hooks), "steps": [], "graphs": [], "lengths": []}
    start = weights(eager)
    first = Accepted.directly(mine[0], eager.processor, version=0)
    lp = [np.concatenate(lrn.own_logprobs(first)) for lrn in (eager, compiled)]
    out["logprob_diff"] = float(np.abs(lp[0] - lp[1]).max())

    def step(lrn: Learner, part, version: int) -> list[float]:
        res = lrn.train_step(Accepted.directly(part, lrn.processor, version=version))
        assert res is not None
        lrn.state.step += 1
        lrn.state.version += 1
        return [res.loss, res.grad_norm, res.stats.kl]

    for i, part in enumerate(mine):
        out["steps"].append([step(eager, part, i), step(compiled, part, i)])
        out["graphs"].append(compiled_graphs())
        out["lengths"].append(sorted(set(seen)))
        seen.clear()
    out["checksums"] = [eager.replicas_agree(), compiled.replicas_agree()]  # raises where the ranks differ
    w_e, w_c = weights(eager), weights(compiled)
    out["weight_diff"] = max(float((w_e[n] - w_c[n]).abs().max()) for n in w_e)
    out["moved"] = max(float((w_e[n] - t).abs().max()) for n, t in start.items())  # the steps did train

    # checkpoints across: the compiled learner's into the eager one and the eager's into the compiled one
    root_e, root_c = Path(args.run_dir) / "eager" / "checkpoints", Path(args.run_dir) / "compiled" / "checkpoints"
    ckpt_e, ckpt_c = eager.save(root_e), compiled.save(root_c)
    out["ckpt_names_equal"] = set(read_model_tensors(ckpt_e)) == set(read_model_tensors(ckpt_c))
    out["ckpt_orig_mod"] = any("_orig_mod" in n for n in read_model_tensors(ckpt_c))
    eager.load(ckpt_c)
    compiled.load(ckpt_e)
    out["loaded_exact"] = [all(torch.equal(weights(eager)[n], t) for n, t in w_c.items()),
                           all(torch.equal(weights(compiled)[n], t) for n, t in w_e.items())]
    out["third"] = [step(eager, mine[0], 2), step(compiled, mine[0], 2)]
    out["graphs"].append(compiled_graphs())
    Path(f"{args.out}-rank{dist.rank}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
