"""Module freezing (model.tune_mm_llm / tune_mm_mlp / tune_mm_vision) for Qwen2.5-VL and Qwen3-VL.

A real optimizer step of the learner on real groups (demo videos, completions sampled by the tiny
model) changes exactly the parameters of the groups whose flag is on, and nothing else.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from streamgrpo.models.loading import parameter_group

FLAGS = [  # (llm, mlp, vision)
    (True, True, False),  # the seed-era default
    (False, True, False),
    (True, False, True),
    (False, False, True),
]


@pytest.fixture(scope="module")
def arch_groups(tmp_path_factory, tiny_model_dir, tiny_qwen3_dir, demo_data_dir):
    from benchmarks.rollouts import sample_groups

    train = Path(demo_data_dir) / "train.jsonl"
    return {arch: (d, sample_groups(d, train, 2, num_generations=3, max_tokens=4, seed=1))
            for arch, d in (("qwen2_5_vl", tiny_model_dir), ("qwen3_vl", tiny_qwen3_dir))}


def _cfg(model_dir, run_dir, llm, mlp, vision):
    from streamgrpo.config import load_config

    return load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={run_dir}", "learner.groups_per_step=2",
                                f"model.tune_mm_llm={llm}", f"model.tune_mm_mlp={mlp}", f"model.tune_mm_vision={vision}",
                                "loss.beta=0", "learner.learning_rate=1e-3"])


def test_every_parameter_belongs_to_one_group(tiny_any_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_any_dir)
    groups = {n: parameter_group(n) for n, _ in model.named_parameters()}
    assert set(groups.values()) == {"llm", "mlp", "vision"}
    assert all(g == "mlp" for n, g in groups.items() if ".merger" in n or "deepstack_merger" in n)
    assert all(g == "llm" for n, g in groups.items() if n.startswith(("model.language_model.", "lm_head.")))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("llm,mlp,vision", FLAGS)
def test_step_changes_exactly_the_unfrozen_groups(arch, llm, mlp, vision, arch_groups, tmp_path, caplog):
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner

    model_dir, groups = arch_groups[arch]
    with caplog.at_level(logging.INFO, logger="streamgrpo.models.loading"):
        learner = Learner(_cfg(model_dir, tmp_path, llm, mlp, vision))
    on = {"llm": llm, "mlp": mlp, "vision": vision}
    named = dict(learner.module.named_parameters())
    expect_trainable = sum(p.numel() for n, p in named.items() if on[parameter_group(n)])
    assert (learner.trainable, learner.total) == (expect_trainable, sum(p.numel() for p in named.values()))
    assert f"trainable parameters: {expect_trainable} of {learner.total}" in caplog.text
    before = {n: p.detach().clone() for n, p in named.items()}
    assert learner.train_step(Accepted.directly(groups, learner.processor)) is not None
    changed = {n for n, p in named.items() if not torch.equal(p.detach(), before[n])}
    expected = {n for n in named if on[parameter_group(n)]}
    assert changed == expected, (f"changed but frozen: {sorted(changed - expected)[:4]}; "
                                 f"trainable but unchanged: {sorted(expected - changed)[:4]}")


def test_everything_frozen_is_an_error(arch_groups, tmp_path):
    from streamgrpo.learner.trainer import Learner

    with pytest.raises(ValueError, match="no trainable parameters"):
        Learner(_cfg(arch_groups["qwen2_5_vl"][0], tmp_path, False, False, False))


def test_per_module_learning_rates(tiny_model_dir, tmp_path):
    """learner.vision_lr / merger_lr give the vision tower and the merger their own AdamW groups;
    unset, one group at learning_rate; a peft-prefixed or unknown name falls back to learning_rate."""
    from streamgrpo.config import load_config
    from streamgrpo.learner.optim import make_optimizer, param_groups
    from streamgrpo.models.loading import load_model

    base = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={tmp_path}"])
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={tmp_path}",
                               "learner.learning_rate=1e-4", "learner.vision_lr=3e-3", "learner.merger_lr=2e-3",
                               "learner.adam_eps=1e-6"])
    model = load_model(cfg.model, "cpu", dtype="float32", trainable=True)
    opt, sched = make_optimizer(model, cfg)
    by_name = {g["name"]: g for g in opt.param_groups}
    assert {n: g["lr"] for n, g in by_name.items()} == {"llm": 1e-4, "mlp": 2e-3, "vision": 3e-3}
    assert {g["eps"] for g in opt.param_groups} == {1e-6} and base.learner.adam_eps == 1e-8
    ids = {n: {id(p) for p in g["params"]} for n, g in by_name.items()}
    for name, p in model.named_parameters():
        assert id(p) in ids[parameter_group(name)], name
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert sched.get_last_lr()[0] == pytest.approx(1e-4)
    one, _ = make_optimizer(model, base)
    assert len(one.param_groups) == 1 and one.param_groups[0]["lr"] == base.learner.learning_rate
    p = torch.nn.Parameter(torch.zeros(1))
    groups = param_groups([("base_model.model.model.visual.blocks.0.attn.qkv.lora_A.default.weight", p),
                           ("some.adapter", p)], cfg.learner)
    assert [(g["name"], g["lr"], len(g["params"])) for g in groups] == [("llm", 1e-4, 1), ("vision", 3e-3, 1)]


def test_adamw_is_fused_on_a_gpu_and_under_offload_only(tiny_model_dir, tmp_path):
    from streamgrpo.config import load_config
    from streamgrpo.learner.optim import fused_adamw, make_optimizer
    from streamgrpo.models.loading import load_model

    assert fused_adamw("cuda", offload=False) is True and fused_adamw("cpu", offload=True) is True
    assert fused_adamw("cpu", offload=False) is None  # torch's default on a CPU learner
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={tmp_path}"])
    model = load_model(cfg.model, "cpu", dtype="float32", trainable=True)
    fused, _ = make_optimizer(model, cfg, fused=True)
    plain, _ = make_optimizer(model, cfg)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    for p in model.parameters():  # the fused kernel steps the same AdamW as the for-loop (CPU here)
        p.grad = torch.randn_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fused.step()
    after_fused = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    plain.step()
    for n, p in model.named_parameters():
        assert not torch.equal(after_fused[n], before[n]), n
        torch.testing.assert_close(p.detach(), after_fused[n], atol=1e-6, rtol=1e-5)
