"""`streamgrpo data demo` + `streamgrpo data check` through the real CLI: exit codes and report lines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streamgrpo.config import DataConfig
from streamgrpo.data.check import run_check
from tests.paths import REPO


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "streamgrpo", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def cli_demo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "demo"
    res = _cli("data", "demo", "--out", str(out), "--n", "20", "--seed", "3", cwd=out.parent)
    assert res.returncode == 0, res.stderr
    assert (out / "train.jsonl").exists() and (out / "test.jsonl").exists() and (out / "train_image.jsonl").exists()
    return out


def test_check_clean_data_set_exits_0(cli_demo):
    res = _cli("data", "check", str(cli_demo / "train.jsonl"), cwd=cli_demo)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "data check summary" in res.stdout
    assert "records   20 (20 ok, 0 with errors)" in res.stdout
    assert "errors    0" in res.stdout and "ERROR" not in res.stdout
    assert "answers   " in res.stdout and "choice" in res.stdout
    assert "data check" in res.stderr  # the progress bar goes to stderr


def test_check_truncated_and_missing_exits_1_naming_both(cli_demo, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(cli_demo, broken)
    rows = [json.loads(x) for x in (broken / "train.jsonl").read_text().splitlines()]
    used = sorted({v for r in rows for v in ([r["video"]] if isinstance(r["video"], str) else r["video"])})
    truncated, missing = broken / used[0], broken / used[1]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    missing.unlink()
    res = _cli("data", "check", str(broken / "train.jsonl"), "--workers", "2", cwd=broken)
    assert res.returncode == 1, res.stdout + res.stderr
    err_lines = [x for x in res.stdout.splitlines() if x.startswith("ERROR")]
    assert any(str(truncated) in x and "unreadable_video" in x for x in err_lines)
    assert any(str(missing) in x and "missing_file" in x and "not found" in x for x in err_lines)
    assert all("record 'train-" in x for x in err_lines)
    assert "FAILED" in res.stdout and "missing_file" in res.stdout.split("data check summary")[1]
    allowed = _cli("data", "check", str(broken / "train.jsonl"), "--allow-errors", cwd=broken)
    assert allowed.returncode == 0 and "errors allowed" in allowed.stdout


def test_check_reports_record_problems(cli_demo, tmp_path):
    rows = [json.loads(x) for x in (cli_demo / "train.jsonl").read_text().splitlines()][:3]
    for r in rows:
        if isinstance(r["video"], str):
            r["video"] = str(cli_demo / r["video"])
        else:
            r["video"] = [str(cli_demo / v) for v in r["video"]]
    rows[0]["conversations"][0]["value"] = "<video><video> two placeholders, one video?"
    rows[0]["video"] = rows[0]["video"] if isinstance(rows[0]["video"], str) else rows[0]["video"][0]
    rows[1]["conversations"][1]["value"] = "<answer></answer>"
    rows[2]["meta"]["frame_cnts"] = [99] * (1 if isinstance(rows[2]["video"], str) else len(rows[2]["video"]))
    rows.append({"id": "no-gpt", "conversations": [{"from": "human", "value": "hi"}]})
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    lines: list[str] = []

    class Out:
        def write(self, s: str) -> None:
            lines.append(s)

    code = run_check(str(path), DataConfig(), workers=1, out=Out())
    text = "".join(lines)
    assert code == 1
    assert f"ERROR placeholder_mismatch record {rows[0]['id']!r}" in text
    assert f"ERROR no_answer record {rows[1]['id']!r}" in text and "ground truth is empty" in text
    assert f"WARN  record {rows[2]['id']!r}" in text and "meta.frame_cnts says 99" in text
    assert "ERROR no_answer record 'no-gpt'" in text and "no gpt turn" in text
    assert "records   4 (1 ok, 3 with errors)" in text and "warnings  " in text
    assert run_check(str(tmp_path / "absent.jsonl"), DataConfig(), out=Out()) == 1


def test_check_image_variant_and_workers(cli_demo):
    lines: list[str] = []

    class Out:
        def write(self, s: str) -> None:
            lines.append(s)

    assert run_check(str(cli_demo / "train_image.jsonl"), DataConfig(), workers=3, out=Out()) == 0
    text = "".join(lines)
    assert "videos    0" in text and "kinds     colour_image" in text
