"""The TRL ``GRPOTrainer`` side of ``bench_e2e``: the demo colour question on its PNG variant.

Run as a subprocess by ``benchmarks.bench_e2e`` (one process, ``--threads`` torch threads)::

    python -m benchmarks.trl_run --run-dir D --model M --data train_image.jsonl --steps N

Same settings as ``streamgrpo up --config demo`` where TRL has them: the warm-started tiny model,
G (``rollout.num_generations``), ``learner.groups_per_step`` prompts per optimizer step, learning
rate and Adam betas, grad clipping, beta (KL to the warm start), epsilon / epsilon_high, loss type
and reward scaling, temperature, max completion length, the same prompt text (the question plus the
no-think format instruction) and the same accuracy reward (``streamgrpo.rewards.get("accuracy")``
wrapped as a TRL reward function). TRL cannot take video, so each prompt carries the clip's middle
frame as a 56x56 image (4 vision tokens instead of the video's 16).

Writes ``D/metrics.jsonl`` with rows shaped like the learner's (``step``, ``time``,
``group_accuracy``, ``seconds``) so ``loop_runs.summarise_rows`` scores both alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _completion_text(c) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c:  # conversational: [{"role": "assistant", "content": ...}]
        content = c[-1].get("content", "")
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)
    return ""


def make_reward(G: int, sink: list[float]):
    """``streamgrpo.rewards.get("accuracy")`` as a TRL reward function; appends per-group mean
    accuracies (TRL lays out the G completions of a prompt consecutively) to ``sink``."""
    from streamgrpo.rewards import get

    acc = get("accuracy")

    def accuracy(prompts, completions, answer, question, **_: object) -> list[float]:
        texts = [_completion_text(c) for c in completions]
        vals = acc(texts, list(answer), question=list(question))
        for i in range(0, len(vals), G):
            chunk = vals[i : i + G]
            sink.append(sum(chunk) / len(chunk))
        return vals

    return accuracy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trl_run", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="train_image.jsonl of the demo data set")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="streamgrpo config overrides (as for `up`)")
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from datasets import Dataset, Image
    from transformers import AutoModelForImageTextToText, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from streamgrpo.config import load_config
    from streamgrpo.data.prompts import instruction
    from streamgrpo.data.records import load_records
    from streamgrpo.models.attention import resolve as resolve_attention
    from streamgrpo.models.loading import load_processor

    cfg = load_config("demo", [*a.set, "data.kinds=null"])  # the image records are tagged colour_image
    run_dir = Path(a.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [r for r in load_records(a.data, cfg.data) if r.images and r.question.count("<image>") == 1]
    if not records:
        raise SystemExit(f"{a.data}: no single-image records")
    suffix = instruction(cfg.data)
    ds = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"{r.question.replace('<image>', '').strip()} {suffix}"}] for r in records],
        "image": [r.images[0] for r in records],
        "answer": [r.answer for r in records],
        "question": [r.question for r in records],
    }).cast_column("image", Image())

    G = cfg.rollout.num_generations
    groups_per_step = cfg.learner.groups_per_step
    processor = load_processor(a.model)
    model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=torch.float32,
                                                         attn_implementation=resolve_attention(cfg.model.attn_implementation, "cpu"))
    args = GRPOConfig(
        output_dir=str(run_dir / "trl_out"), use_cpu=True, bf16=False, seed=cfg.seed, data_seed=cfg.seed,
        per_device_train_batch_size=G * groups_per_step, num_generations=G, gradient_accumulation_steps=1,
        max_completion_length=cfg.rollout.max_completion_length, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        learning_rate=cfg.learner.learning_rate, adam_beta1=cfg.learner.adam_beta1, adam_beta2=cfg.learner.adam_beta2,
        adam_epsilon=cfg.learner.adam_eps,
        weight_decay=cfg.learner.weight_decay, max_grad_norm=cfg.learner.max_grad_norm, lr_scheduler_type="constant",
        warmup_steps=0, beta=cfg.loss.beta, epsilon=cfg.loss.epsilon, epsilon_high=cfg.loss.epsilon_high,
        loss_type=cfg.loss.loss_type, scale_rewards=cfg.loss.scale_rewards, num_iterations=1,
        max_steps=a.steps, logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0,
        log_completions=False, disable_tqdm=True, gradient_checkpointing=cfg.learner.gradient_checkpointing,
    )
    sink: list[float] = []
    metrics = open(run_dir / "metrics.jsonl", "w")
    t_begin = [0.0]

    class Rows(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            t_begin[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            accs = sink[:]
            sink.clear()
            row = {"step": state.global_step, "time": time.time(), "group_accuracy": accs,
                   "accuracy": sum(accs) / len(accs) if accs else None,
                   "seconds": time.perf_counter() - t_begin[0], "groups": len(accs)}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    trainer = GRPOTrainer(model=model, reward_funcs=[make_reward(G, sink)], args=args, train_dataset=ds,
                          processing_class=processor, callbacks=[Rows()])
    t0 = time.time()
    trainer.train()
    metrics.close()
    (run_dir / "trl_done.json").write_text(json.dumps({"train_seconds": time.time() - t0, "steps": a.steps,
                                                       "torch_threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
