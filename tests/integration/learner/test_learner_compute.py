"""The learner's compute path (issue 52): a frozen vision trunk once per micro-batch, bf16 parameters with
float32 master weights. Real Learners on the tiny Qwen2.5-VL and demo groups it sampled; the op counts are
benchmarks/op_counts.py's (a TorchDispatchMode over the whole step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.op_counts import counting
from streamgrpo.config import ConfigError
from streamgrpo.models.logprobs import BF16_LOGPROB_MEAN_TOL, BF16_LOGPROB_TOL
from tests.integration.learner.test_learner_core import _accept, _cfg, _learner, groups  # noqa: F401 - groups: a fixture

FROZEN = ("model.tune_mm_vision=false", "learner.gradient_checkpointing=true")


def test_a_frozen_trunk_runs_once_per_micro_batch_for_policy_reference_and_probes(groups, tiny_model_dir,  # noqa: F811
                                                                                   tmp_path):
    learner = _learner(_cfg(tiny_model_dir, tmp_path, *FROZEN, "loss.beta=0.04", "learner.max_update_kl=100"))
    runs: list[int] = []
    hooks = [m.model.visual.blocks[0].register_forward_hook(lambda *_: runs.append(1)) for m in (learner.module,
                                                                                              learner.ref)]
    try:
        out = learner.train_step(_accept(groups[:4], learner))
    finally:
        for h in hooks:
            h.remove()
    assert out is not None and out.micro_batches >= 1
    # one trunk pass per micro-batch (the demo's prompts are videos); before: the reference's, the policy's and
    # the update guard's probe each ran the tower
    assert len(runs) == out.micro_batches


def _per_token(learner, batch):
    return np.concatenate(learner.own_logprobs(batch))


@pytest.mark.parametrize("shared", [False, True], ids=["rows", "shared-prompt"])
def test_master_weights_train_like_float32_within_bf16_tolerance_and_cast_no_weight(groups, tiny_model_dir,  # noqa: F811
                                                                                     tmp_path, shared):
    sets = (*FROZEN, "loss.beta=0.04", f"learner.shared_prompt={str(shared).lower()}")
    fp32 = _learner(_cfg(tiny_model_dir, tmp_path / "a", *sets))
    autocast = _learner(_cfg(tiny_model_dir, tmp_path / "b", *sets, "learner.bf16=true"))
    master = _learner(_cfg(tiny_model_dir, tmp_path / "c", *sets, "learner.bf16=true", "learner.master_weights=true"))
    assert {p.dtype for p in master.module.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in master.optimizer.masters()} == {torch.float32}
    batches = [groups[:4], groups[4:8]]
    counts = {}
    for step, part in enumerate(batches):
        outs = {}
        for name, lr in (("fp32", fp32), ("autocast", autocast), ("master", master)):
            acc = _accept(part, lr, version=step)
            if step == 1:
                with counting(lr.module, lr.ref) as c:
                    outs[name] = lr.train_step(acc)
                counts[name] = c.summary()["total"]
            else:
                outs[name] = lr.train_step(acc)
            assert outs[name] is not None
        assert outs["master"].loss == pytest.approx(outs["fp32"].loss, abs=0.02)
    # after two steps: the same policy within bf16 tolerance, per token, as the float32 learner
    probe = _accept(groups[:4], fp32)
    want = _per_token(fp32, probe)
    got = _per_token(master, probe)
    diff = np.abs(got - want)
    assert diff.max() <= BF16_LOGPROB_TOL and diff.mean() <= BF16_LOGPROB_MEAN_TOL
    assert diff.max() > 0  # bf16 ran
    # the masters moved as the float32 weights did
    for (n, p), m in zip(((n, p) for n, p in fp32.module.named_parameters() if p.requires_grad),
                         master.optimizer.masters(), strict=True):
        torch.testing.assert_close(m, p.detach(), atol=5e-3, rtol=0.05, msg=n)
    # autocast casts the float32 weights in every forward; bf16 parameters need no cast
    assert counts["autocast"]["weight_casts"] > 0
    assert counts["master"]["weight_casts"] == 0 and counts["fp32"]["weight_casts"] == 0


def test_master_weights_resume_exactly(groups, tiny_model_dir, tmp_path):  # noqa: F811
    sets = (*FROZEN, "learner.bf16=true", "learner.master_weights=true")
    straight = _learner(_cfg(tiny_model_dir, tmp_path / "a", *sets))
    first = _learner(_cfg(tiny_model_dir, tmp_path / "b", *sets))
    for lr in (straight, first):
        assert lr.train_step(_accept(groups[:4], lr)) is not None
        lr.state.step += 1
    ckpt = first.save(tmp_path / "ckpt")
    resumed = _learner(_cfg(tiny_model_dir, tmp_path / "c", *sets))
    resumed.load(ckpt)
    for m_a, m_b in zip(resumed.optimizer.masters(), first.optimizer.masters(), strict=True):
        assert torch.equal(m_a, m_b)  # the float32 masters, not the bf16 model rounded back
    for lr in (straight, resumed):
        assert lr.train_step(_accept(groups[4:8], lr, version=1)) is not None
    for m_a, m_b in zip(resumed.optimizer.masters(), straight.optimizer.masters(), strict=True):
        torch.testing.assert_close(m_a, m_b, atol=0, rtol=0)
    for (n, a), b in zip(resumed.module.named_parameters(), straight.module.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("sets", [["learner.bf16=false"], ["learner.bf16=true", "model.lora={r: 4, alpha: 8}"]],
                         ids=["no-bf16", "lora"])
def test_master_weights_outside_full_bf16_torch_training_is_refused_in_one_line(tiny_model_dir, tmp_path, sets):
    with pytest.raises(ConfigError, match="learner.master_weights") as e:
        _learner(_cfg(tiny_model_dir, tmp_path, "learner.master_weights=true", *sets))
    assert "\n" not in str(e.value)
