"""The learner's training core driven directly (no Redis): micro-batching, memory knobs, exact resume.

Real groups: demo videos, completions sampled by the tiny Qwen2.5-VL, fed to ``Learner.train_step``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from streamgrpo.learner.micro_batches import MicroBudget


@pytest.fixture(scope="module")
def groups(tiny_model_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    return sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 8, num_generations=4, max_tokens=6)


def _cfg(model_dir, run_dir, *sets):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}", "learner.groups_per_step=4",
                                "loss.loss_type=dapo", "learner.learning_rate=1e-3", *sets])


def _learner(cfg):
    from streamgrpo.learner.trainer import Learner

    return Learner(cfg)


def _step_grads(learner, batch):
    """Run one train_step; return (its output, the gradients the optimizer saw)."""
    seen = {}
    original = learner._optimizer_step

    def capture():
        seen.update({n: p.grad.detach().clone() for n, p in learner.module.named_parameters() if p.grad is not None})
        return original()

    learner._optimizer_step = capture
    out = learner.train_step(batch)
    learner._optimizer_step = original
    return out, seen


def _accept(groups, learner, version=0):
    from streamgrpo.learner.state import Accepted

    return Accepted.directly(groups, learner.processor, version=version)


def _assert_same_step(out_a, grads_a, out_b, grads_b, *, grad_norm_rel, grad_atol):
    """Two learners' steps on the same groups: the same grad norm, loss statistics and gradients."""
    assert out_b.grad_norm == pytest.approx(out_a.grad_norm, rel=grad_norm_rel)
    for key in ("kl", "clip_frac", "entropy", "ratio_mean"):
        assert getattr(out_b.stats, key) == pytest.approx(getattr(out_a.stats, key), rel=1e-5, abs=1e-7), key
    assert grads_a.keys() == grads_b.keys()
    for n, g in grads_a.items():
        torch.testing.assert_close(grads_b[n], g, rtol=1e-4, atol=grad_atol, msg=n)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_micro_batched_step_equals_one_batch_dapo(groups, tiny_model_dir, tmp_path, beta):
    from streamgrpo.learner.micro_batches import split_micro_batches

    whole = _learner(_cfg(tiny_model_dir, tmp_path / "a", f"loss.beta={beta}"))
    micro = _learner(_cfg(tiny_model_dir, tmp_path / "b", f"loss.beta={beta}", "learner.micro_batch_tokens=100",
                          "learner.peak_tflops=0.5"))
    batch = _accept(groups[:4], whole)
    assert len(split_micro_batches(batch, 100)) == 4  # one group per micro-batch
    out_a, grads_a = _step_grads(whole, batch)
    out_b, grads_b = _step_grads(micro, _accept(groups[:4], micro))
    assert (out_a.micro_batches, out_b.micro_batches) == (1, 4)
    assert out_a.tokens_global == out_b.tokens_global == sum(len(c.token_ids) for g in groups[:4] for c in g.completions)
    assert out_b.loss == pytest.approx(out_a.loss, abs=1e-6)
    # the step's work (streamgrpo.learner.flops) does not depend on the micro-batching; the peak only when configured
    assert out_a.seq_tokens == out_b.seq_tokens == sum(len(g.prompt_ids) + len(c.token_ids)
                                                       for g in groups[:4] for c in g.completions)
    assert out_a.flops == out_b.flops > 6 * out_a.seq_tokens * whole.total * 0.5
    assert (out_a.peak_flops, out_b.peak_flops) == (None, 0.5e12)  # a CPU without learner.peak_tflops: unknown
    assert whole.work.counter.training.reference == (beta > 0)
    _assert_same_step(out_a, grads_a, out_b, grads_b, grad_norm_rel=1e-5, grad_atol=1e-7)


@pytest.mark.parametrize("shared", [False, True])
def test_groups_cut_into_runs_of_rows_train_like_one_batch(groups, tiny_model_dir, tmp_path, shared):
    """After running out of memory the learner cuts groups into runs of their completions (each run its
    own vision pass): the step's loss and gradients are those of one batch, rows and shared prompt."""
    sets = ("loss.beta=0.04", f"learner.shared_prompt={str(shared).lower()}")
    whole = _learner(_cfg(tiny_model_dir, tmp_path / "a", *sets))
    cut = _learner(_cfg(tiny_model_dir, tmp_path / "b", *sets))
    cut.budget = MicroBudget(16, cut_groups=True)  # below one sequence: every sequence alone
    out_a, grads_a = _step_grads(whole, _accept(groups[:4], whole))
    out_b, grads_b = _step_grads(cut, _accept(groups[:4], cut))
    assert (out_a.micro_batches, out_b.micro_batches) == (1, 16)
    assert out_b.loss == pytest.approx(out_a.loss, abs=1e-6)
    assert out_b.fresh_tokens == out_a.fresh_tokens and out_b.fresh_kl_sum == pytest.approx(out_a.fresh_kl_sum, abs=1e-6)
    _assert_same_step(out_a, grads_a, out_b, grads_b, grad_norm_rel=1e-5, grad_atol=1e-7)


def test_split_into_exactly_n_parts_keeps_order_and_budget(groups, tiny_model_dir, tmp_path):
    from streamgrpo.learner.micro_batches import group_tokens, split_micro_batches

    batch = _accept(groups, _learner(_cfg(tiny_model_dir, tmp_path)))
    budget = 2 * group_tokens(batch[0]) + 5
    greedy = split_micro_batches(batch, budget)
    assert all(sum(map(group_tokens, p)) <= budget for p in greedy)
    for n in range(len(greedy), len(batch) + 1):
        parts = split_micro_batches(batch, budget, n_parts=n)
        assert len(parts) == n and all(parts) and [a for p in parts for a in p] == batch
    with pytest.raises(ValueError, match="cannot split"):
        split_micro_batches(batch, budget, n_parts=len(batch) + 1)


def test_gradient_checkpointing_gives_the_same_gradients(groups, tiny_model_dir, tmp_path):
    plain = _learner(_cfg(tiny_model_dir, tmp_path / "a"))
    ckpt = _learner(_cfg(tiny_model_dir, tmp_path / "b", "learner.gradient_checkpointing=true"))
    on = getattr(type(ckpt.module), "is_activation_checkpointing", None) and "is_activation_checkpointing" or \
        "is_gradient_checkpointing"
    assert getattr(ckpt.module, on) and not getattr(plain.module, on)
    _, ga = _step_grads(plain, _accept(groups[:4], plain))
    _, gb = _step_grads(ckpt, _accept(groups[:4], ckpt))
    for n, g in ga.items():
        torch.testing.assert_close(gb[n], g, rtol=1e-5, atol=1e-8, msg=n)


def _mlp_calls(learner):
    """Calls of each decoder layer's MLP: a recomputed layer runs it again in backward. Counted by wrapping
    ``mlp.forward`` on the instance (module hooks are not run again when torch recomputes a checkpoint)."""
    layers = [m for n, m in learner.module.named_modules() if re.search(r"language_model\.layers\.\d+$", n)]
    calls = [0] * len(layers)

    def counted(i, forward):
        def run(*args, **kwargs):
            calls[i] += 1
            return forward(*args, **kwargs)
        return run

    for i, layer in enumerate(layers):
        layer.mlp.forward = counted(i, layer.mlp.forward)
    return calls


@pytest.mark.parametrize("sets", [(), ("model.lora={r: 4, alpha: 8, dropout: 0.0}",)], ids=["full", "lora"])
def test_checkpoint_every_recomputes_every_other_layer_with_the_same_gradients(groups, tiny_model_dir, tmp_path,
                                                                                sets):

    plain = _learner(_cfg(tiny_model_dir, tmp_path / "a", *sets))
    every = _learner(_cfg(tiny_model_dir, tmp_path / "b", *sets, "learner.gradient_checkpointing=true",
                          "learner.checkpoint_every=2"))
    flags = checkpointed_layers(every.module)
    assert flags == [i % 2 == 0 for i in range(len(flags))] and not any(checkpointed_layers(plain.module))
    calls_plain, calls_every = _mlp_calls(plain), _mlp_calls(every)
    _, ga = _step_grads(plain, _accept(groups[:4], plain))
    _, gb = _step_grads(every, _accept(groups[:4], every))
    # the decoder layers follow the vision blocks in the count: which of them recompute is what the flags say
    decoder = flags[-len(calls_every):]
    assert len(set(calls_plain)) == 1 and calls_plain[0] >= 1  # the step's forward passes, each layer alike
    assert calls_every == [n + f for n, f in zip(calls_plain, decoder)] and any(decoder) and not all(decoder)
    for n, g in ga.items():
        torch.testing.assert_close(gb[n], g, rtol=1e-5, atol=1e-8, msg=n)


def test_lora_adapters_are_a_function_of_the_seed(tiny_model_dir, tmp_path):
    lora = "model.lora={r: 4, alpha: 8, dropout: 0.0}"

    def adapters(learner):
        return {n: p.detach().clone() for n, p in learner.module.named_parameters() if "lora_A" in n}

    state = torch.random.get_rng_state()
    first = adapters(_learner(_cfg(tiny_model_dir, tmp_path / "a", lora)))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left alone
    torch.manual_seed(1234)  # whatever ran before
    again = adapters(_learner(_cfg(tiny_model_dir, tmp_path / "b", lora)))
    other = adapters(_learner(_cfg(tiny_model_dir, tmp_path / "c", lora, "seed=7")))
    assert first and first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


def test_checkpoint_offload_is_refused_on_a_cpu_learner_in_one_line(tiny_model_dir, tmp_path):
    from streamgrpo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _learner(_cfg(tiny_model_dir, tmp_path, "learner.device=cpu", "learner.gradient_checkpointing=true",
                      "learner.checkpoint_offload=true"))
    assert "\n" not in str(err.value) and "learner.checkpoint_offload" in str(err.value) and "cpu" in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="activation offload moves saved tensors off a CUDA device")
def test_checkpoint_offload_on_cuda_gives_the_same_gradients(groups, tiny_model_dir, tmp_path):
    sets = ("learner.device=cuda", "learner.gradient_checkpointing=true")
    kept = _learner(_cfg(tiny_model_dir, tmp_path / "a", *sets))
    offloaded = _learner(_cfg(tiny_model_dir, tmp_path / "b", *sets, "learner.checkpoint_offload=true"))
    _, ga = _step_grads(kept, _accept(groups[:4], kept))
    _, gb = _step_grads(offloaded, _accept(groups[:4], offloaded))
    for n, g in ga.items():
        torch.testing.assert_close(gb[n], g, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("sets", [("loss.beta=0.04",), ("loss.beta=0.04", "learner.gradient_checkpointing=true",
                                                         "learner.micro_batch_tokens=100"),
                                  ("loss.beta=0.04", "model.lora={r: 4, alpha: 8, dropout: 0.0}")],
                         ids=["reference", "checkpointing-micro", "lora-reference"])
def test_shared_prompt_step_equals_rows_with_fewer_decoder_flops(groups, tiny_model_dir, tmp_path, sets):
    rows = _learner(_cfg(tiny_model_dir, tmp_path / "a", *sets))
    shared = _learner(_cfg(tiny_model_dir, tmp_path / "b", *sets, "learner.shared_prompt=true"))
    out_a, grads_a = _step_grads(rows, _accept(groups[:4], rows))
    out_b, grads_b = _step_grads(shared, _accept(groups[:4], shared))
    assert out_b.loss == pytest.approx(out_a.loss, abs=1e-6)
    _assert_same_step(out_a, grads_a, out_b, grads_b, grad_norm_rel=1e-4, grad_atol=1e-6)
    # tokens/s counts the same rows; the FLOPs count each prompt once (4 groups of 4 completions)
    assert out_b.seq_tokens == out_a.seq_tokens
    assert shared.work.counter.training.shared_prompt and not rows.work.counter.training.shared_prompt
    assert out_b.flops < out_a.flops


def _dtypes(learner):
    """{requires_grad: the set of floating dtypes of those parameters}."""
    out: dict[bool, set] = {True: set(), False: set()}
    for p in learner.module.parameters():
        out[p.requires_grad].add(p.dtype)
    return out


def _param_bytes(learner):
    return sum(p.numel() * p.element_size() for p in learner.module.parameters())


@pytest.mark.parametrize("lora", [False, True], ids=["full-frozen-vision", "lora"])
def test_bf16_on_cpu_autocasts_trains_float32_and_stores_frozen_weights_in_bf16(groups, tiny_model_dir, tmp_path, lora):
    sets = ["model.lora={r: 4, alpha: 8, dropout: 0.0}"] if lora else ["model.tune_mm_vision=false"]
    fp32 = _learner(_cfg(tiny_model_dir, tmp_path / "a", *sets))
    bf16 = _learner(_cfg(tiny_model_dir, tmp_path / "b", "learner.bf16=true", *sets))
    assert _dtypes(fp32) == {True: {torch.float32}, False: {torch.float32}}
    assert _dtypes(bf16) == {True: {torch.float32}, False: {torch.bfloat16}}  # what trains keeps fp32
    frozen = sum(p.numel() for p in bf16.module.parameters() if not p.requires_grad)
    assert frozen > 0 and _param_bytes(fp32) - _param_bytes(bf16) == 2 * frozen
    if lora:  # the same adapters in both, so that the steps compare
        bf16.module.load_state_dict({n: t for n, t in fp32.module.state_dict().items() if "lora_" in n}, strict=False)
    out32 = fp32.train_step(_accept(groups[:4], fp32))
    out16 = bf16.train_step(_accept(groups[:4], bf16))
    assert out16 is not None and torch.isfinite(torch.tensor(out16.grad_norm))
    assert out16.seq_logprob_sum != out32.seq_logprob_sum  # the bf16 matmuls ran ...
    assert out16.seq_logprob_sum == pytest.approx(out32.seq_logprob_sum, rel=0.05)  # ... and agree roughly
    assert _dtypes(bf16) == {True: {torch.float32}, False: {torch.bfloat16}}  # the step kept them so


def _train(learner, batches, start_version=0):
    for i, part in enumerate(batches):
        assert learner.train_step(_accept(part, learner, version=start_version + i)) is not None
        learner.state.step += 1
        learner.state.version += 1


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-dropout"])
def test_resume_then_n_steps_equals_uninterrupted(groups, tiny_model_dir, tmp_path, lora):
    sets = ["learner.warmup_steps=3", "learner.micro_batch_tokens=200", "loss.beta=0.04"]
    if lora:  # adapters with dropout: the resumed run must also restore the RNG
        sets += ["model.lora={r: 4, alpha: 8, dropout: 0.2}"]
    batches = [groups[0:2], groups[2:4], groups[4:6], groups[6:8]]
    cfg = _cfg(tiny_model_dir, tmp_path / "run", "learner.groups_per_step=2", *sets)

    torch.manual_seed(0)
    straight = _learner(cfg)
    _train(straight, batches[:2])
    ckpt = straight.save(tmp_path / "run" / "checkpoints")
    _train(straight, batches[2:], start_version=2)

    torch.manual_seed(123)  # a different process state: everything must come from the checkpoint
    resumed = _learner(cfg)
    meta = resumed.load(ckpt)
    assert meta["learner"]["step"] == 2 and resumed.state.version == 2 and resumed.resumed_from == ckpt
    _train(resumed, batches[2:], start_version=2)

    a, b = dict(straight.module.named_parameters()), dict(resumed.module.named_parameters())
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)
    assert resumed.last_lr() == straight.last_lr()
    assert not any(p.suffix in (".pt", ".bin", ".pkl") for p in ckpt.rglob("*"))


def test_max_update_kl_halves_or_undoes_a_step_and_measures_it_on_the_steps_own_completions(groups, tiny_model_dir,
                                                                                           tmp_path):
    from streamgrpo import metrics as M
    from streamgrpo.learner.update_guard import kl_terms
    from streamgrpo.models.batching import GroupInputs, build_batch
    from streamgrpo.models.logprobs import completion_logprobs

    def weights(learner):
        return {n: p.detach().clone() for n, p in learner.module.named_parameters() if p.requires_grad}

    def moved(a, b):
        return sum(float((a[n] - b[n]).abs().sum()) for n in a)

    def update_kl(learner, batch, start):
        """The KL the step moved the policy by, measured independently of the learner's own probe."""
        tb = build_batch([GroupInputs.from_processor(a.inputs, [torch.tensor(c.token_ids) for c in a.group.completions])
                          for a in batch], learner.processor.tokenizer.pad_token_id)
        now = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
        with torch.no_grad():
            new, _ = completion_logprobs(learner.module, tb)
            for n, p in learner.module.named_parameters():
                if n in start:
                    p.copy_(start[n])
            old, _ = completion_logprobs(learner.module, tb)
            for n, p in learner.module.named_parameters():
                p.copy_(now[n])
        s, k = kl_terms(old, new, tb.completion_mask)
        return s / k

    # a bound no step can meet: every step is undone, the weights stay, Adam's moments still move
    strict = _learner(_cfg(tiny_model_dir, tmp_path / "strict", "learner.max_update_kl=1e-12",
                           "learner.max_update_halvings=2"))
    start = weights(strict)
    undone_before = M.UPDATES_SHRUNK.labels(outcome="undone")._value.get()
    out = strict.train_step(_accept(groups[:4], strict))
    assert out.update is not None and out.update.undone and out.update.halvings == 2
    assert out.update.kl_first > 1e-12 and moved(start, weights(strict)) == 0.0
    assert any(s["exp_avg"].abs().sum() > 0 for s in strict.optimizer.state.values())
    assert M.UPDATES_SHRUNK.labels(outcome="undone")._value.get() == undone_before + 1

    # a loose bound keeps the whole step; its update_kl is what an independent measurement finds
    loose = _learner(_cfg(tiny_model_dir, tmp_path / "loose", "learner.max_update_kl=100"))
    plain = _learner(_cfg(tiny_model_dir, tmp_path / "plain"))
    start = weights(loose)
    batch = _accept(groups[:4], loose)
    out = loose.train_step(batch)
    assert (out.update.scale, out.update.halvings) == (1.0, 0) and out.update.kl == out.update.kl_first > 0
    assert out.update.kl == pytest.approx(update_kl(loose, batch, start), rel=1e-3)
    assert plain.train_step(_accept(groups[:4], plain)).update is None
    full = weights(plain)
    for n, w in weights(loose).items():  # the guard changes nothing about a step it keeps
        torch.testing.assert_close(w, full[n], rtol=0, atol=1e-7, msg=n)

    # a bound between: the step is halved once (Adam's step direction, half its length)
    half = _learner(_cfg(tiny_model_dir, tmp_path / "half", f"learner.max_update_kl={out.update.kl * 0.6}"))
    out_h = half.train_step(_accept(groups[:4], half))
    assert out_h.update.halvings >= 1 and 0 < out_h.update.scale < 1 and out_h.update.kl <= out.update.kl * 0.6
    for n, w in weights(half).items():
        torch.testing.assert_close(w, start[n] + out_h.update.scale * (full[n] - start[n]), rtol=0, atol=1e-6, msg=n)


def test_max_update_kl_is_refused_with_deepspeed(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="max_update_kl needs learner.backend: torch"):
        _learner(_cfg(tiny_model_dir, tmp_path / "ds", "learner.max_update_kl=0.1", "learner.backend=deepspeed"))


def test_zero_variance_weight_trains_on_groups_grpo_leaves_flat(groups, tiny_model_dir, tmp_path):
    """All-wrong and all-right groups: no gradient under GRPO; with loss.zero_variance_weight the wrong
    answers get negative advantages and the right ones positive (measured against the step's mean)."""
    import dataclasses

    def flat(group, reward):
        return dataclasses.replace(group, completions=[dataclasses.replace(c, reward=reward) for c in group.completions])

    four = [flat(g, r) for g, r in zip(groups[:4], (0.0, 0.0, 1.0, 1.0))]
    sizes = [len(g.completions) for g in four]
    plain = _learner(_cfg(tiny_model_dir, tmp_path / "plain", "loss.beta=0"))
    out, grads = _step_grads(plain, _accept(four, plain))
    assert out.zero_variance == 4 and torch.equal(out.adv_N, torch.zeros(sum(sizes)))
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())
    zvw = _learner(_cfg(tiny_model_dir, tmp_path / "zvw", "loss.beta=0", "loss.zero_variance_weight=0.5"))
    out, grads = _step_grads(zvw, _accept(four, zvw))
    wrong = sum(sizes[:2])
    assert out.zero_variance == 4  # still counted: their rewards are all equal
    assert bool((out.adv_N[:wrong] < 0).all()) and bool((out.adv_N[wrong:] > 0).all())
    assert out.grad_norm > 0 and all(bool(torch.isfinite(g).all()) for g in grads.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_learner_steps_with_fused_adamw_and_bf16_frozen_weights(groups, tiny_model_dir, tmp_path):
    learner = _learner(_cfg(tiny_model_dir, tmp_path / "cuda", "learner.device=cuda", "learner.bf16=true",
                            "model.tune_mm_vision=false"))
    assert learner.optimizer.defaults["fused"] is True
    assert _dtypes(learner) == {True: {torch.float32}, False: {torch.bfloat16}}
    out = learner.train_step(_accept(groups[:4], learner))
    assert out is not None and math.isfinite(out.grad_norm) and out.grad_norm > 0


def checkpointed_layers(model) -> list[bool]:
    """Whether each layer of ``model`` (vision blocks and decoder layers, in order) recomputes in backward."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [bool(m.gradient_checkpointing) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
