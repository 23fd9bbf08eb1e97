"""The Video-R1 recipe end to end on the CPU: a small file in Video-R1's format (all five problem types, each
as an image and a video record, real mp4 and PNG files) made here, prepared by the recipe's step, checked,
and trained 3 steps by `streamgrpo up` with the tiny model and the recipe's rewards and T-GRPO settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("jiwer")
pytest.importorskip("rouge_score")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "WANDB_MODE": "offline"}

# problem_type -> (question, options, solution)
CASES = {
    "multiple choice": ("Which way does the square move?", ["A. left", "B. right", "C. up"], "<answer>B</answer>"),
    "numerical": ("How many squares are there?", None, "<answer>1</answer>"),
    "OCR": ("What does the sign say?", None, "<answer>HELLO WORLD</answer>"),
    "free-form": ("Describe the motion.", None, "<answer>the square moves right</answer>"),
    "regression": ("How far does the square move, in metres?", None, "<answer>2.5</answer>"),
}


def _video_r1_file(root: Path) -> Path:
    """Video-R1-260k's format: ``problem_id``, ``problem``, ``data_type``, ``problem_type``, ``options``,
    ``process``, ``solution``, ``path``, ``data_source``; paths relative to the data folder."""
    from PIL import Image

    from streamgrpo.recipes.demo.data import render, write_mp4

    (root / "Video").mkdir(parents=True)
    (root / "Image").mkdir()
    write_mp4(root / "Video" / "clip.mp4", render("red", "right", 0))
    Image.fromarray(np.full((56, 56, 3), 200, dtype=np.uint8)).save(root / "Image" / "still.png")
    rows = []
    for kind, (problem, options, solution) in CASES.items():
        for data_type, path in (("video", "./Video/clip.mp4"), ("image", "./Image/still.png")):
            rows.append({"problem_id": f"{kind.replace(' ', '_')}-{data_type}", "problem": problem,
                         "data_type": data_type, "problem_type": kind, "options": options or [],
                         "process": "<think>...</think>", "solution": solution, "path": path,
                         "data_source": "test"})
    rows.append({**rows[0], "problem_id": "missing", "path": "./Video/not_downloaded.mp4"})
    src = root / "Video-R1-260k.json"
    src.write_text(json.dumps(rows, indent=1))
    return src


def test_video_r1_format_prepares_checks_and_trains_three_steps(tiny_model_dir, tmp_path):
    from streamgrpo.config import load_config
    from streamgrpo.recipes.video_r1.prepare import main as prepare_main
    from streamgrpo.rewards import extract_answer
    from streamgrpo.rewards.problem_types import TEXT_RULES

    data = tmp_path / "video_r1"
    src = _video_r1_file(data)
    assert prepare_main([str(src), "--media-root", str(data), "--out", str(data / "train.jsonl")]) == 0
    prepared = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    assert len(prepared) == 10 and "missing" not in {r["problem_id"] for r in prepared}  # its mp4 is absent
    mc = next(r for r in prepared if r["problem_type"] == "multiple choice")
    assert "Options:\nA. left\nB. right\nC. up\n" in mc["problem"] and "options" not in mc

    recipe = load_config("video_r1/qwen2_5_vl_3b_1node")
    run = tmp_path / "run"
    cfg = load_config("demo", [f"data.train_path={data / 'train.jsonl'}", f"data.media_root={data}", "data.kinds=null",
                               "data.prompt_format=think", f"model.name_or_path={tiny_model_dir}", f"run_dir={run}",
                               "demo.tiny_model=false", "demo.make_data=false", "eval.enabled=false",
                               "launch.agreement_check=false", "learner.max_steps=3", "learner.groups_per_step=4",
                               "learner.save_steps=1000", "rollout.num_generations=4", "rollout.prompts_per_batch=2",
                               "rollout.max_completion_length=12", "rollout.num_generators=1",
                               "metrics.log_every=1", f"rewards.debug_log={run / 'rewards.jsonl'}",
                               "rollout.stop_grace_s=0"])  # `up` ends with the learner: no room comes
    cfg.rewards = recipe.rewards.model_copy(update={"debug_log": str(run / "rewards.jsonl")})
    cfg.rollout.temporal_contrast = recipe.rollout.temporal_contrast.model_copy(update={"num_generations": 2})
    run.mkdir()
    path = run / "test-config.yaml"
    path.write_text(cfg.to_yaml())

    check = subprocess.run([sys.executable, "-m", "streamgrpo", "data", "check", str(data / "train.jsonl"),
                            "--config", str(path)], env=ENV, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]

    out = subprocess.run([sys.executable, "-m", "streamgrpo", "up", "--config", str(path), "--generators", "1"],
                         env=ENV, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and [r["step"] for r in rows] == [1, 2, 3]
    assert summary["groups_trained"] == 12

    # every scored completion: no reward error, and the accuracy is the rule of its record's problem type
    scored = [json.loads(x) for x in (run / "rewards.jsonl").read_text().splitlines()]
    by_id = {r["problem_id"]: r for r in prepared}
    ids = {s["prompt_id"] for s in scored}
    assert {i for i in ids if "#" not in i} == set(by_id)  # 12 groups trained: every record was sampled
    shuffled = {i.split("#")[0] for i in ids if i.endswith("#shuffled")}  # T-GRPO: the videos only
    assert shuffled and all(by_id[i]["data_type"] == "video" for i in shuffled)
    rules = recipe.rewards.functions[1].params["by_kind"]
    for s in scored:
        assert "errors" not in s, s
        kind = by_id[s["prompt_id"].split("#")[0]]["problem_type"]
        if rules[kind] in TEXT_RULES:
            pred = extract_answer(s["completion"])
            want = TEXT_RULES[rules[kind]](pred.strip(), s["answer"]) if pred and pred.strip() else 0.0
            assert s["rewards"]["accuracy"] == pytest.approx(want), s
