"""benchmarks/bench_engine.py on the tiny model (a real process): the HF engine, plain generate and the old
stacked-scores capture sample the same tokens; the figures come out with their baselines."""

from __future__ import annotations

import json
import os
import subprocess

from benchmarks.common import child_pythonpath, module_argv


def test_bench_engine_writes_its_figures(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": child_pythonpath()}
    out = subprocess.run(module_argv("bench_engine", "--prompts", "1", "--n", "2", "--max-tokens", "4", "--frames", "2",
                                     "--size", "56", "--long-frames", "4", "--repeats", "1", "--device", "cpu", "--out", str(tmp_path / "r.json")),
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    figs = {f["name"]: f for f in doc["figures"]}
    assert set(figs) == {"hf_engine_generate_s", "hf_engine_vs_output_scores_s", "logprob_capture_bytes",
                         "hf_prompt_once_long_video_s", "hf_vision_cache_hit_long_video_s"}
    assert figs["hf_prompt_once_long_video_s"]["baseline"] > 0
    assert figs["hf_engine_generate_s"]["value"] > 0 and figs["hf_engine_generate_s"]["baseline"] > 0
    assert figs["logprob_capture_bytes"]["value"] < figs["logprob_capture_bytes"]["baseline"]
    assert "tiny qwen2_5_vl" in figs["hf_engine_generate_s"]["note"]
