"""Generator = learner agreement on the tiny Qwen2.5-VL: the check's three verdicts (agree, disagree by
dtype, disagree by logic), a learner blind to the video (the transformers 5.17 failure) named as such,
and the command's one line and exit code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from streamgrpo.agreement import Agreement, verdict
from streamgrpo.commands.agreement import check_agreement
from streamgrpo.config import build_config


def _cfg(model_dir, data_dir, tmp_path, *extra: str):
    return build_config({}, [
        f"model.name_or_path={model_dir}", "model.dtype=float32", f"data.train_path={data_dir / 'train.jsonl'}",
        "data.min_frames=4", "data.max_frames=4", "data.min_pixels=3136", "data.max_pixels=3136",
        "data.prompt_format=no_think", "rollout.num_generations=4", "rollout.max_completion_length=8",
        "rollout.device=cpu", "learner.device=cpu", f"run_dir={tmp_path / 'run'}", *extra])


def test_the_generator_and_the_learner_agree_in_fp32(tiny_model_dir, demo_data_dir, tmp_path):
    lines: list[str] = []
    v = check_agreement(_cfg(tiny_model_dir, demo_data_dir, tmp_path), groups=2, say=lines.append)
    assert v.agree and v.cause == "", v.line
    assert len(lines) == 1 and "ESS 1.000" in lines[0] and "ratio 1-1" in lines[0]  # nothing to diagnose


def test_a_bf16_generator_against_an_fp32_learner_is_a_dtype_disagreement(tiny_model_dir, demo_data_dir, tmp_path):
    """The generator samples in bf16, the learner computes in fp32: at a threshold below bf16 rounding the
    check says they disagree, and that fp32 in both roles is what makes them agree."""
    gen = _cfg(tiny_model_dir, demo_data_dir, tmp_path, "model.dtype=bfloat16")
    learner = _cfg(tiny_model_dir, demo_data_dir, tmp_path)  # float32, no autocast
    lines: list[str] = []
    v = check_agreement(gen, groups=1, max_kl=1e-7, learner_cfg=learner, say=lines.append)
    assert not v.agree and v.cause == "fp32", "\n".join(lines)
    assert v.line.startswith("generator and learner disagree: KL ") and "with fp32 they agree" in v.line
    assert "model.fp32_lm_head" in v.line
    assert any(line.strip().startswith("vision per row:") for line in lines)  # tried first, did not explain it


def test_another_policy_in_the_learner_is_a_disagreement_no_switch_explains(tiny_model_dir, demo_data_dir, tmp_path):
    from streamgrpo.models.tiny import build_tiny

    other = build_tiny(tmp_path / "other", arch="qwen2_5_vl", seed=1)  # other weights: a logic mismatch
    lines: list[str] = []
    v = check_agreement(_cfg(tiny_model_dir, demo_data_dir, tmp_path), groups=1,
                        learner_cfg=_cfg(other, demo_data_dir, tmp_path), say=lines.append)
    assert not v.agree and v.cause == "logic", "\n".join(lines)
    assert "no single switch explains it" in v.line
    for name in ("vision per row", "fp32", "eager attention", "no KV cache"):
        assert f"{name} " in v.line.split("KL with ")[1], name  # every switch tried and named


def test_a_learner_blind_to_the_video_is_named(tiny_model_dir, demo_data_dir, tmp_path, monkeypatch):
    """What transformers 5.17 did: the vision-once features never reach the decoder. The check finds the
    gap and that vision per row closes it."""
    import streamgrpo.models.vision_inputs as vi

    monkeypatch.setattr(vi, "encode_once", lambda *a, **k: {})  # the features dropped, as an unknown kwarg was
    lines: list[str] = []
    v = check_agreement(_cfg(tiny_model_dir, demo_data_dir, tmp_path), groups=2, say=lines.append)
    assert not v.agree and v.cause == "vision per row", "\n".join(lines)
    assert "transformers" in v.line


def test_the_verdict_is_pure_and_takes_the_first_switch_that_agrees():
    ok = Agreement.of([[-1.0, -2.0]], [[-1.0, -2.0]])
    bad = Agreement.of([[-1.0, -2.0]], [[-2.5, -0.5]])
    assert ok.kl == 0.0 and ok.ess == 1.0 and ok.ratio_min == ok.ratio_max == 1.0 and ok.tokens == 2
    assert bad.kl > 0.5 and bad.ess < 1.0 and bad.abs_delta_max == 1.5
    assert verdict(ok, {}).agree
    v = verdict(bad, {"vision per row": bad, "fp32": ok, "eager attention": ok})
    assert not v.agree and v.cause == "fp32"
    assert verdict(bad, {"fp32": bad}).cause == "logic"
    with pytest.raises(ValueError):
        Agreement.of([[-1.0]], [[-1.0, -2.0]])


def test_the_command_prints_one_verdict_and_exits_1_on_disagreement(tiny_model_dir, demo_data_dir, tmp_path):
    base = [sys.executable, "-m", "streamgrpo", "check", "agreement", "--groups", "1", "--max-tokens", "4",
            "--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.dtype=float32",
            "--set", f"data.train_path={demo_data_dir / 'train.jsonl'}", "--set", "data.min_pixels=3136",
            "--set", "data.max_pixels=3136", "--set", "data.max_frames=4", "--set", "data.min_frames=4",
            "--set", "rollout.num_generations=2", "--set", "rollout.device=cpu", "--set", "learner.device=cpu"]
    out = tmp_path / "verdict.json"
    ok = subprocess.run([*base, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("OK: generator and learner agree: KL ")
    assert json.loads(out.read_text())["agree"] is True
    # a learner in bf16 autocast against an fp32 sampler, judged at a threshold below bf16 rounding
    bad = subprocess.run([*base, "--set", "learner.bf16=true", "--max-kl", "1e-9", "--no-diagnose"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert bad.stdout.splitlines()[-1].startswith("FAIL: generator and learner disagree: KL ")
    assert "Traceback" not in bad.stderr
