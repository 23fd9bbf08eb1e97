"""The Video-R1 recipe end to end on the CPU: a small file in Video-R1's format (all five problem types, each
as an image and a video record, real mp4 and PNG files) made here, prepared by the recipe's step, checked,
and trained 3 steps by `streamgrpo up` with the tiny model and the recipe's rewards and T-GRPO settings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.paths import REPO

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


# --- the recipe README's commands, as written --------------------------------------------------------------
README = REPO / "streamgrpo" / "recipes" / "video_r1" / "README.md"
# What cannot run here, and what stands in: no network (the `hf download` lines: the files are made here; `model
# push`: tests/integration/models/test_model_export.py pushes to a local server speaking the Hub's API), no
# training (`up` without --plan), no 7B model and no vLLM on the CPU (the tiny model, the HF engine), and short
# answers (the tiny random model would write 768 tokens).
SKIP = ("hf download ", "streamgrpo up --config my.yaml\n", "streamgrpo model push ")
STAND_INS = {"Qwen/Qwen2.5-VL-7B-Instruct": "{tiny}", "--set eval.engine=vllm": "--set eval.engine=hf --max-new-tokens 4"}


def readme_commands(text: str) -> list[str]:
    """Every command of the README's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for cmd in re.sub(r"\\\n\s*", "", block).splitlines():
            cmd = cmd.split(" #")[0].strip() if not cmd.lstrip().startswith("#") else ""
            if cmd:
                out.append(cmd)
    return out


def _shims(bin_dir: Path) -> dict:
    """`streamgrpo` and `python` on PATH: this interpreter, this checkout."""
    bin_dir.mkdir()
    for name, line in (("streamgrpo", f'exec {sys.executable} -m streamgrpo "$@"'), ("python", f'exec {sys.executable} "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)
    root = str(README.parents[3])
    return {**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}", "PYTHONPATH": root + os.pathsep + ENV.get("PYTHONPATH", "")}


def _bash(cmd: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_the_recipe_readme_commands_run_as_written(tiny_model_dir, tmp_path):
    import shutil

    work = tmp_path / "work"
    data = work / "data" / "video_r1"
    src = _video_r1_file(data)  # where step 1 puts Video-R1-260k.json and its media
    bench = [r for r in json.loads(src.read_text()) if r["problem_id"] != "missing"]
    (data / "eval_vsibench.json").write_text(json.dumps(bench))  # a benchmark JSON in Video-R1's format
    ckpt = work / "runs" / "video_r1_7b" / "checkpoints" / "step-001000"
    shutil.copytree(tiny_model_dir, ckpt)  # what training would have left
    env = _shims(tmp_path / "bin")

    commands = readme_commands(README.read_text())
    assert any(c.startswith("hf download Video-R1/Video-R1-data") for c in commands)  # hub 2.x: `hf`
    assert not any("huggingface-cli" in c for c in commands)
    ran = []
    for cmd in commands:
        if any((cmd + "\n").startswith(s) for s in SKIP):
            continue
        for old, new in STAND_INS.items():
            cmd = cmd.replace(old, new.format(tiny=tiny_model_dir))
        out = _bash(cmd, work, env)
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        ran.append((cmd, out))
    evals = [(c, o) for c, o in ran if c.startswith("streamgrpo eval ")]
    assert len(evals) == 1 and any(c.startswith("streamgrpo up --config my.yaml --plan") for c, _ in ran)
    eval_cmd, out = evals[0]
    result = json.loads((ckpt / "eval" / "eval.json").read_text())
    s = result["settings"]
    assert s["records"] == len(bench) and s["skipped"] == 0 and "skipped" not in out.stderr
    assert result["model"]["metrics"]["records"] == len(bench) == result["baseline"]["metrics"]["records"]
    # --set data.* is what the evaluation ran at (the config trains at 16 frames of 100352 pixels)
    assert s["data_limits"]["max_frames"] == 32 and s["data_limits"]["max_pixels"] == 200704
    assert "`data.max_frames` 32" in (ckpt / "eval" / "eval.md").read_text()

    # the videos gone: the images are scored, one line says what was skipped and why
    (data / "Video" / "clip.mp4").unlink()
    out = _bash(eval_cmd, work, env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((ckpt / "eval" / "eval.json").read_text())
    assert result["model"]["metrics"]["records"] == 5 and result["settings"]["skipped"] == 5
    line = next(x for x in out.stderr.splitlines() if x.startswith("skipped 5 of 10"))
    assert f"5 video file not found (first: {data.resolve() / 'Video' / 'clip.mp4'})" in line
    assert f"looked for under {data.resolve()}" in line

    # the media looked for elsewhere (the README's old layout): no record scored is an error, one line
    empty = work / "data" / "elsewhere"
    empty.mkdir()
    out = _bash(eval_cmd + f" --set data.media_root={empty}", work, env)
    assert out.returncode == 2
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr
    first = json.loads((data / "eval_vsibench.jsonl").read_text().splitlines()[0])["path"]
    assert f"file not found: {empty / first}" in errors[0] or f"file not found: {os.path.normpath(empty / first)}" in errors[0]
    assert f"looked for under {empty.resolve()}" in errors[0]
