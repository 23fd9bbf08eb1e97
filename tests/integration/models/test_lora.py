"""LoRA mode end to end in one process: the learner trains adapters only (reference = adapters off),
only adapters are published, generators merge them, and ``streamgrpo model merge`` writes a model
that plain transformers loads with the same log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def trained(tiny_model_dir, demo_data_dir, tmp_path_factory):
    """A LoRA learner (beta > 0) after two steps on real groups, with the weights before/after."""
    from conftest import sampled_groups as sample_groups  # sampled once per session

    from streamgrpo.config import load_config
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner

    groups = sample_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 4, num_generations=4, max_tokens=6)
    run = tmp_path_factory.mktemp("lora_run")
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={run}", "learner.groups_per_step=2",
                               "model.lora={r: 4, alpha: 16, dropout: 0.0}", "loss.beta=0.04",
                               "learner.learning_rate=5e-3"])
    learner = Learner(cfg)
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    outs = [learner.train_step(Accepted.directly(groups[i:i + 2], learner.processor)) for i in (0, 2)]
    learner.state.step = 2
    return {"learner": learner, "cfg": cfg, "groups": groups, "before": before, "outs": outs, "run": run}


def _batch(trained):
    from streamgrpo.models.batching import GroupInputs, build_batch

    learner = trained["learner"]
    groups = []
    for g in trained["groups"][:2]:
        from streamgrpo.data.prompts import processor_inputs

        feats = processor_inputs(learner.processor, g.prompt_text, g.visuals)
        groups.append(GroupInputs.from_processor(feats, [torch.as_tensor(c.token_ids, dtype=torch.long)
                                                         for c in g.completions]))
    return build_batch(groups, learner.processor.tokenizer.pad_token_id)


def _logprobs(model, trained):
    from streamgrpo.models.logprobs import completion_logprobs

    model.eval()
    with torch.no_grad():
        lp, _ = completion_logprobs(model, _batch(trained))
    return lp


def test_only_adapters_train_and_the_reference_is_the_base(trained):
    learner, before = trained["learner"], trained["before"]
    assert learner.ref is None  # the reference is the same model with adapters disabled
    names = dict(learner.module.named_parameters())
    lora = {n for n in names if "lora_" in n}
    assert lora and all(".language_model." in n for n in lora)  # vision tower has no adapters
    assert {n for n, p in names.items() if p.requires_grad} == lora
    assert learner.trainable == sum(names[n].numel() for n in lora) < learner.total / 5
    for n, p in names.items():
        if n in lora:
            assert not torch.equal(p, before[n]), f"adapter {n} did not change"
        else:
            assert torch.equal(p, before[n]), f"base weight {n} changed"
    assert trained["outs"][0].stats.kl == pytest.approx(0.0, abs=1e-7)  # adapters B = 0: policy == reference
    assert trained["outs"][1].stats.kl > 0


def test_generators_receive_adapters_and_merge_them(trained, tiny_model_dir):
    from streamgrpo.engines.hf import HFEngine
    from streamgrpo.models.apply import apply_to_model
    from streamgrpo.models.loading import load_model
    from streamgrpo.models.lora import make_weight_applier

    learner, cfg = trained["learner"], trained["cfg"]
    sent = learner.policy_tensors()
    assert set(sent) == {n for n, p in learner.module.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in sent)
    want = _logprobs(learner.module, trained)
    assert not torch.allclose(want, _logprobs(load_model(cfg.model, "cpu"), trained))  # training moved it

    engine = HFEngine(load_model(cfg.model, "cpu"), learner.processor)
    apply = make_weight_applier(cfg, engine)
    apply(7, sent)
    apply(7, sent)  # applying twice must not accumulate: merges go into the pristine base
    assert engine.version == 7
    torch.testing.assert_close(_logprobs(engine.model, trained), want, rtol=1e-5, atol=1e-5)

    class WeightsOnlyEngine:  # an engine without a torch module (like vLLM): base weights come from disk
        def __init__(self, model):
            self._model = model

        def load_weights(self, version, tensors):
            self.version = version
            apply_to_model(self._model, tensors)

    other = WeightsOnlyEngine(load_model(cfg.model, "cpu"))
    make_weight_applier(cfg, other)(8, sent)
    torch.testing.assert_close(_logprobs(other._model, trained), want, rtol=1e-5, atol=1e-5)


def test_merge_writes_a_plain_transformers_model_with_the_same_logprobs(trained, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from streamgrpo.cli import main

    learner = trained["learner"]
    ckpt = learner.save(trained["run"] / "checkpoints", model_card="---\nbase_model: x\n---\n# streamgrpo run\n")
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    out = tmp_path / "merged"
    assert main(["model", "merge", "--adapter", str(ckpt), "--out", str(out)]) == 0
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForImageTextToText.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logprobs(merged, trained), _logprobs(learner.module, trained), rtol=1e-5, atol=1e-5)
    assert AutoProcessor.from_pretrained(out).tokenizer.pad_token_id == learner.processor.tokenizer.pad_token_id
    card = (out / "README.md").read_text()
    assert "streamgrpo run" in card and "## LoRA merge" in card and "alpha = 16" in card
    with pytest.raises(FileExistsError):
        main(["model", "merge", "--adapter", str(ckpt), "--out", str(out)])


def test_resumed_lora_learner_restores_adapters(trained, tmp_path):
    from streamgrpo.learner.trainer import Learner

    ckpt = trained["learner"].save(tmp_path / "ck")
    again = Learner(trained["cfg"])
    again.load(ckpt)
    for (n, a), (_, b) in zip(trained["learner"].module.named_parameters(), again.module.named_parameters()):
        assert torch.equal(a, b), n


def test_qlora_without_cuda_is_a_clear_error(tiny_model_dir, tmp_path):
    from streamgrpo.config import load_config
    from streamgrpo.learner.trainer import Learner

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", f"run_dir={tmp_path}",
                               "model.lora={r: 4, alpha: 8, quantize_4bit: true}"])
    with pytest.raises(RuntimeError, match="QLoRA.*needs a CUDA GPU"):
        Learner(cfg)
