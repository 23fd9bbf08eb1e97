"""Run under torchrun (2 gloo ranks on the CPU) by test_seq_parallel.py: ``learner.sequence_parallel: 2``.

Part 1, the log-probs: for each ``--model`` (the tiny Qwen2.5-VL with sdpa and eager, then Qwen3-VL with sdpa; float32;
and the first with one key/value head, fewer than the ranks, and in float64) and each
layout (rows, shared prompt), every rank computes the completion log-probs, entropies and the gradient of a weighted
sum of them once without sequence parallelism (this process alone: no collective) and once with the two ranks
splitting the sequences (:mod:`streamgrpo.models.ulysses`), its gradient summed over the ranks; the largest
differences go to ``--out``-rank<N>.json.

Part 2, the learner's step (``--groups``: wire-encoded ScoredGroups): for each setting (the torch backend with rows,
with ``learner.shared_prompt``, with LoRA, with ``learner.compile`` (aot_eager); DeepSpeed ZeRO-2; DeepSpeed ZeRO-3
with no weight kept whole, over ``--short-groups`` whose videos are one temporal patch each, so that one rank has no
frames of its own and runs the vision trunk over a stand-in), a learner without sequence parallelism on this process
alone and one with ``learner.sequence_parallel: 2`` over both ranks each take two steps (two micro-batches, ``dapo``,
``loss.beta`` 0.04 or 0) on the same groups: the losses, gradient norms, the gradients the optimizer steps with (torch
backend) and the weights after the steps; then a checkpoint of the sequence-parallel learner loaded into a fresh one
and a step of each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch


def gathered(lrn, params):
    """DeepSpeed ZeRO-3's context that makes ``params`` whole on every rank; else nothing."""
    if lrn.zero_stage < 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def _grads(model, fn, weights_BT, mask_BT):
    model.zero_grad(set_to_none=True)
    lp = fn()
    (lp * weights_BT * mask_BT).sum().backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def logprob_checks(model_dir: str, attn: str, sp, kv_heads: int | None = None, dtype=torch.float32) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from streamgrpo.models.batching import build_batch
    from streamgrpo.models.logprobs import completion_logprobs
    from tests.unit.models.test_logprobs import _three_groups

    proc = AutoProcessor.from_pretrained(model_dir)
    if kv_heads is None:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    else:  # fewer key/value heads than ranks: repeated before the exchange (random weights, the same on every rank)
        cfg = AutoConfig.from_pretrained(model_dir)
        cfg.text_config.num_key_value_heads = kv_heads
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    model.train()  # dropout is 0: train mode only checks nothing depends on it
    out = {}
    for shared in (False, True):
        batch = build_batch(_three_groups(proc, model.config.model_type), proc.tokenizer.pad_token_id, model=model)
        m = batch.completion_mask
        w = torch.randn(m.shape, generator=torch.Generator().manual_seed(0))
        kw = dict(temperature=0.7, shared_prompt=shared)
        with torch.no_grad():
            lp1, ent1 = completion_logprobs(model, batch, with_entropy=True, **kw)
            lp2, ent2 = completion_logprobs(model, batch, with_entropy=True, seq_parallel=sp, **kw)
        g1 = _grads(model, lambda b=batch, kw=kw: completion_logprobs(model, b, **kw)[0], w, m)
        g2 = _grads(model, lambda b=batch, kw=kw: completion_logprobs(model, b, seq_parallel=sp, **kw)[0], w, m)
        for t in g2.values():
            dist.all_reduce(t)
        name = "shared" if shared else "rows"
        out[name] = {
            "lp": float((lp1 - lp2).abs().max()), "ent": float((ent1 - ent2).abs().max()),
            "lp_scale": float(lp1[m].abs().max()), "tokens": int(m.sum()),
            "same_grads": sorted(g1) == sorted(g2),
            "grad": max(float((g1[k] - g2[k]).abs().max()) for k in g1),
            "grad_scale": max(float(g1[k].abs().max()) for k in g1),
            # per tensor, the largest difference over the tensor's largest element
            "grad_norm_rel": (sum(float((g1[k] - g2[k]).pow(2).sum()) for k in g1)
                              / sum(float(g1[k].pow(2).sum()) for k in g1)) ** 0.5,
            "grad_rel": max(float((g1[k] - g2[k]).abs().max()) / max(float(g1[k].abs().max()), 1e-30) for k in g1),
            "vision_grad": any(k.startswith("model.visual.") and float(g1[k].abs().sum()) > 0 for k in g1),
            "length": int(batch.input_ids.shape[1]),
        }
    return out


SETTINGS = {  # the demo's loss.beta 0.04 (a reference model, or LoRA's disabled adapters), or 0: the policy alone
    "torch_rows": [],
    "torch_shared": ["learner.shared_prompt=true", "loss.beta=0"],
    "torch_lora": ["model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0"],
    "zero2_rows": ["learner.backend=deepspeed", "learner.deepspeed_config=zero2", "loss.beta=0"],
    "zero3_rows": ["learner.backend=deepspeed"],  # --zero3-config; the reference partitioned too (loss.beta 0.04)
    "torch_compile": ["learner.compile=true", "learner.compile_backend=aot_eager", "loss.beta=0"],
}
RESUME = ("torch_lora", "zero2_rows", "zero3_rows")


def step_checks(model_dir: str, groups_path: str, run_dir: Path, name: str, dist_info, extra: list[str]) -> dict:
    import msgpack

    from streamgrpo.config import load_config
    from streamgrpo.learner.distributed import DistInfo
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.models.batching import unwrap_model
    from streamgrpo.models.compile import decoder_layers, is_compiled
    from streamgrpo.wire import decode

    groups = [decode(b) for b in msgpack.unpackb(Path(groups_path).read_bytes())]

    def learner(tag: str, *sets: str, dist=None) -> Learner:
        cfg = load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir / name / tag}",
                                   f"learner.groups_per_step={len(groups)}", "loss.loss_type=dapo",
                                   "learner.learning_rate=1e-3", "model.tune_mm_vision=false",
                                   "learner.micro_batch_tokens=400", "learner.async_checkpoint=false",
                                   *SETTINGS[name], *extra, *sets])
        torch.manual_seed(0)
        return Learner(cfg, dist=dist or DistInfo())

    def trained(lrn: Learner) -> dict[str, torch.Tensor]:
        params = [(n, p) for n, p in lrn.module.named_parameters() if p.requires_grad]
        with gathered(lrn, [p for _, p in params]):  # ZeRO-3: each rank holds a part (every rank gathers)
            return {n: p.detach().float().clone() for n, p in params}

    def step(lrn: Learner) -> tuple[list[float], dict[str, torch.Tensor]]:
        grads: dict[str, torch.Tensor] = {}
        if lrn.engine is None:  # the gradients the optimizer steps with (after the ranks' average)
            names = {id(p): n for n, p in lrn.module.named_parameters()}
            lrn.optimizer.register_step_pre_hook(lambda opt, *_: grads.update(
                {names[id(p)]: p.grad.detach().clone() for g in opt.param_groups for p in g["params"]
                 if p.grad is not None}))
        res = lrn.train_step(Accepted.directly(groups, lrn.processor, version=0))
        assert res is not None
        return [res.loss, res.grad_norm, res.stats.kl, res.micro_batches, res.tokens_global], grads

    # without sequence parallelism: one process, the torch backend (DeepSpeed's ZeRO-2 steps the same AdamW)
    # learner.compile: the sequence-parallel learner compiled against the eager one (its compile is what is tested)
    one = learner("one", "learner.backend=torch", "learner.compile=false")
    sp = learner("sp", "learner.sequence_parallel=2", dist=dist_info)
    start = trained(one)
    out: dict = {"steps": [], "vision_rows": []}
    for lrn in (one, sp):  # the patches each vision trunk pass runs over (sequence parallel: its share of the frames)
        rows: list[int] = []
        out["vision_rows"].append(rows)
        for m in {id(x): x for x in (lrn.module, lrn.ref) if x is not None}.values():  # the reference's runs first
            unwrap_model(m).model.visual.blocks[0].register_forward_pre_hook(
                lambda _m, a, rows=rows: rows.append(int(a[0].shape[0])))
    for k in range(2):  # the second step's ratios and KL are not 1 and 0: its loss is not ~0
        (n1, g1), (n2, g2) = step(one), step(sp)
        out["steps"].append([n1, n2])
        if g2 and k == 0:  # from the same weights (Adam's first step moves a weight whose gradient is ~0 by +-lr)
            out["same_grads"] = sorted(g1) == sorted(g2)
            out["grad_rel"] = max(float((g1[n] - g2[n]).abs().max()) / max(float(g1[n].abs().max()), 1e-30)
                                  for n in g1)
    w1, w2 = trained(one), trained(sp)
    out["moved"] = max(float((w1[k] - start[k]).abs().max()) for k in w1)
    out["compiled"] = all(is_compiled(layer) for layer in decoder_layers(sp.module))
    out["weight"] = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    if name in RESUME:  # a checkpoint of the sequence-parallel learner into a fresh one: the same weights, next step
        sp.state.step += 2
        ckpt = sp.save(run_dir / name / "sp" / "checkpoints")
        again = learner("again", "learner.sequence_parallel=2", dist=dist_info)
        again.load(ckpt)
        out["resumed_exact"] = all(torch.equal(trained(again)[k], w2[k]) for k in w2) and again.state.step == 2
        out["after_resume"] = [step(sp)[0], step(again)[0]]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--groups", help="msgpack list of wire-encoded ScoredGroups of the first --model")
    ap.add_argument("--short-groups", help="the same, videos of one temporal patch (ZeRO-3's setting)")
    ap.add_argument("--zero3-config", help="a DeepSpeed ZeRO-3 JSON")
    ap.add_argument("--run-dir")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch.distributed as dist

    from streamgrpo.learner.distributed import init_distributed
    from streamgrpo.models.sp_group import new_groups

    info = init_distributed("deepspeed", dist_backend="gloo")  # the process group DeepSpeed joins too
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = new_groups(world, rank, world)
    out: dict = {"rank": rank, "logprobs": {}, "steps": {}}
    for i, model_dir in enumerate(args.model):
        for attn in ("sdpa", "eager")[: 2 if i == 0 else 1]:  # eager on the first model only (time)
            out["logprobs"][f"{Path(model_dir).name}/{attn}"] = logprob_checks(model_dir, attn, sp)
    out["logprobs"][f"{Path(args.model[0]).name}/sdpa/kv1"] = logprob_checks(args.model[0], "sdpa", sp, kv_heads=1)
    # float64: what is left of the float32 differences is the order of its sums, not the method
    out["logprobs"][f"{Path(args.model[0]).name}/sdpa/float64"] = logprob_checks(args.model[0], "sdpa", sp,
                                                                                 dtype=torch.float64)
    if args.groups:
        for name in SETTINGS:
            zero3 = name.startswith("zero3")
            extra = [f"learner.deepspeed_config={args.zero3_config}"] if zero3 else []
            out["steps"][name] = step_checks(args.model[0], args.short_groups if zero3 else args.groups,
                                             Path(args.run_dir), name, info, extra)
    Path(f"{args.out}-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
