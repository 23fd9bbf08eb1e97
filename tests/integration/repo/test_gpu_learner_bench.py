"""benchmarks/gpu_learner.py at ``--size tiny`` (a real process, the real Learner on the tiny model): one row per
backend x mode with step time, tokens/s, FLOPs and MFU; on a GPU (skipped elsewhere) with peak memory too."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.common import child_pythonpath, module_argv
from tests.paths import REPO

SMALL = ["--size", "tiny", "--steps", "1", "--warmup", "0", "--G", "2", "--completion-len", "4", "--frames", "2",
         "--frame-size", "56", "--groups", "2"]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": child_pythonpath()}
    out = subprocess.run(module_argv("gpu_learner", *args), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_tiny_size_rows_for_every_backend_and_mode(tmp_path):
    out = _run(tmp_path, *SMALL, "--peak-tflops", "0.001", "--out", str(tmp_path / "r.json"))
    doc = json.loads((tmp_path / "r.json").read_text())
    rows = {(r["backend"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {(b, m) for b in ("torch", "deepspeed") for m in ("full", "full_vision", "lora", "full_shared")}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    tokens = {r["seq_tokens"] for r in rows.values()}
    assert len(tokens) == 1 and tokens.pop() > 2 * 2 * 4  # the same batch everywhere: prompts + completions
    for r in rows.values():
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["seq_tokens"] / r["step_s"])
        assert r["mfu"] == pytest.approx(r["flops"] / (r["step_s"] * 1e9))
        assert (r["peak_gib"] is None) == (not torch.cuda.is_available())  # CUDA peak memory only
        assert r["plan_gib"] > 0 and r["plan_host_gib"] == 0  # the static plan; nothing offloaded
        if r["peak_gib"] is not None:
            assert r["peak_gib"] >= r["plan_gib"]  # a lower bound
    for b in ("torch", "deepspeed"):  # what trains decides the backward
        assert rows[(b, "lora")]["flops"] < rows[(b, "full")]["flops"] < rows[(b, "full_vision")]["flops"]
        assert rows[(b, "lora")]["trainable"] < rows[(b, "full")]["trainable"] < rows[(b, "full_vision")]["trainable"]
    assert rows[("torch", "full")]["flops"] == rows[("deepspeed", "full")]["flops"]
    for b in ("torch", "deepspeed"):  # each group's prompt once: the same trainable weights, fewer FLOPs
        assert rows[(b, "full_shared")]["flops"] < rows[(b, "full")]["flops"]
        assert rows[(b, "full_shared")]["trainable"] == rows[(b, "full")]["trainable"]
    names = [f["name"] for f in doc["figures"]]
    assert "step_torch_full_s" in names and "mfu_deepspeed_lora" in names
    assert "step_deepspeed_full_vision_s: " in out.stdout and "MFU" in out.stdout


def test_zero_offload_moves_the_optimizer_to_the_host_without_the_peak_mfu_is_absent_and_real_sizes_need_cuda(
        tmp_path):
    """One run (each is a model load): ZeRO-Offload against ZeRO-2 on the device, without ``--peak-tflops``."""
    _run(tmp_path, *SMALL, "--backends", "deepspeed,deepspeed_offload", "--modes", "full", "--out", str(tmp_path / "r.json"))
    rows = {r["backend"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    on, off = rows["deepspeed"], rows["deepspeed_offload"]
    # the static parts: moments, master copy and gradients move to the host (the step's parts differ: pinned
    # buffers on the host, no fp32 gradient copy on the device)
    assert off["static_host_gib"] > 0 and off["static_gib"] < on["static_gib"]
    assert off["static_gib"] + off["static_host_gib"] == pytest.approx(on["static_gib"])
    assert off["plan_gib"] >= off["static_gib"] and on["plan_gib"] >= on["static_gib"]
    assert off["flops"] == on["flops"] and off["trainable"] == on["trainable"]
    if torch.cuda.is_available():
        assert off["peak_gib"] < on["peak_gib"]
    else:
        assert all(r["mfu"] is None and r["peak_flops"] is None for r in rows.values())  # a CPU without the peak
        out = _run(tmp_path, "--size", "7b", "--out", str(tmp_path / "none.json"))
        assert "no CUDA device here" in out.stdout and not (tmp_path / "none.json").exists()


@pytest.mark.parametrize("argv", [["--checkpoint-every", "2"], ["--checkpoint-offload"],
                                  ["--no-gradient-checkpointing", "--checkpoint-every", "2"]])
def test_recompute_options_reach_the_learner_config(argv):
    from benchmarks.gpu_learner import build_parser, combo_sets
    from streamgrpo.config import build_config

    a = build_parser().parse_args(argv)
    a.model_dir = "/models/qwen"
    cfg = build_config({}, combo_sets(a, "torch", "full", cuda=True)).learner
    if a.gradient_checkpointing:
        assert cfg.gradient_checkpointing and (cfg.checkpoint_every, cfg.checkpoint_offload) == (
            a.checkpoint_every, a.checkpoint_offload) != (1, False)
    else:  # nothing is recomputed: the recompute knobs stay out of the config
        assert (cfg.gradient_checkpointing, cfg.checkpoint_every, cfg.checkpoint_offload) == (False, 1, False)


def test_the_memory_plan_sees_the_video_measured_and_lora_modes_get_their_r():
    """The plan sizes a prompt from data.max_frames/max_pixels: the combination sets them to the synthetic video's
    (the defaults' 12k-token prompt made the 3B plan refuse a step that fits in 63 GiB); every lora* mode is LoRA."""
    from benchmarks.gpu_learner import build_parser, combo_sets
    from streamgrpo.config import build_config
    from streamgrpo.learner.memory.step import prompt_tokens
    from streamgrpo.models.params import ModelShape

    a = build_parser().parse_args(["--lora-r", "64"])
    a.model_dir = "/models/qwen"
    cfg = build_config({}, combo_sets(a, "torch", "full", cuda=True))
    shape = ModelShape(layers=36, hidden=2048, intermediate=11008, vocab=151936, kv_heads=2, head_dim=128)
    assert prompt_tokens(cfg, shape) == 16 * 448 * 448 // shape.pixels_per_video_token + 128 == 2048 + 128
    for mode in ("lora", "lora_nodropout", "lora_compiled"):
        lora = build_config({}, combo_sets(a, "torch", mode, cuda=True)).model.lora
        assert lora is not None and lora.r == 64 and (lora.dropout == 0) == (mode != "lora")


def test_gpu_session_script_runs_its_smoke_stage_and_refuses_an_unknown_one(tmp_path):
    import sys

    script = REPO / "benchmarks" / "gpu_session.sh"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": child_pythonpath(),
           "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    out = subprocess.run(["bash", str(script), "smoke"], cwd=script.parents[1], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "gpu_learner_smoke.json").read_text())["rows"]
    assert [(r["mode"], r["status"]) for r in rows] == [("full", "ok"), ("full_shared", "ok")]
    assert "static plan" in (tmp_path / "out" / "smoke.log").read_text()
    for r in rows:  # one profiled step each: its top ops as a table, the ops it issued counted
        table = (tmp_path / "out" / "profile_smoke" / f"torch_{r['mode']}.txt").read_text()
        assert "aten::mm" in table and r["profile"]["aten_ops"] > 100
        assert (r["profile"]["gpu_kernels"] is None) == (not torch.cuda.is_available())
    bad = subprocess.run(["bash", str(script), "nonsense"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage:" in bad.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_size_on_a_gpu_reports_peak_memory_and_mfu(tmp_path):
    _run(tmp_path, *SMALL, "--backends", "torch", "--out", str(tmp_path / "r.json"))
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert all(r["status"] == "ok" and r["peak_gib"] > 0 for r in rows)
    if "H100" in torch.cuda.get_device_name() or "H200" in torch.cuda.get_device_name():
        assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in rows)


@pytest.mark.parametrize("backend", ["torch", "deepspeed", "deepspeed_offload"])
def test_full_compiled_is_a_combination_of_every_backend(backend):
    """``full_compiled``: ``learner.compile`` with the torch backend and under DeepSpeed ZeRO-2 (optimizer offload
    too), measured against the backend's ``full`` (gpu_session.sh deepspeed3b)."""
    from benchmarks.gpu_learner import BACKENDS, build_parser, combo_sets
    from streamgrpo.config import build_config

    a = build_parser().parse_args([])
    a.model_dir = "/models/qwen"
    compiled = build_config({}, combo_sets(a, backend, "full_compiled", cuda=True)).learner
    full = build_config({}, combo_sets(a, backend, "full", cuda=True)).learner
    assert compiled.compile and not full.compile and compiled.backend == BACKENDS[backend][0]
    assert compiled.model_copy(update={"compile": False}) == full  # the one lever
