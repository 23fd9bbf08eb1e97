"""The Video-R1 recipe's prepare step (pure parts): Video-R1's prompt additions, and what it leaves out."""

from __future__ import annotations

import json

import pytest

from streamgrpo.recipes.video_r1.prepare import ANSWER_INSTRUCTION, main, prepare, prepare_record

RAW = {"problem_id": 7, "problem": "Which colour?", "problem_type": "multiple choice",
       "options": ["A. red", "B. green"], "process": "<think>long</think>", "solution": "<answer>B</answer>",
       "path": "./Image/x.png", "data_type": "image", "data_source": "test"}


def test_prepare_record_folds_options_and_the_instruction_into_the_problem():
    rec = prepare_record(RAW)
    assert rec["problem"] == "Which colour?\nOptions:\nA. red\nB. green\n" + ANSWER_INSTRUCTION["multiple choice"]
    assert "options" not in rec and "process" not in rec and rec["solution"] == "<answer>B</answer>"
    ocr = prepare_record({**RAW, "problem_type": "OCR", "options": ["ignored"]})
    assert ocr["problem"] == "Which colour?\n" + ANSWER_INSTRUCTION["OCR"]
    assert prepare_record({k: v for k, v in RAW.items() if k != "data_type"} | {"path": "./v/a.MP4"})["data_type"] == "video"
    for bad, msg in (({**RAW, "problem_type": "caption"}, "problem_type 'caption' is none of"),
                     ({**RAW, "solution": ""}, "no 'solution'"), ({**RAW, "path": None}, "no 'path'")):
        with pytest.raises(ValueError, match=msg):
            prepare_record(bad)


def test_prepare_keeps_records_whose_media_exists_and_counts_the_rest(tmp_path, capsys):
    (tmp_path / "Image").mkdir()
    (tmp_path / "Image" / "x.png").write_bytes(b"png")
    rows = [RAW, {**RAW, "path": "./Image/absent.png"}, {**RAW, "problem_type": "regression"}, "not a record",
            {**RAW, "problem_type": "shape"}]
    kept, counts = prepare(rows, tmp_path)
    assert len(kept) == 2 and counts["skipped/missing media"] == 1 and counts["kept/image"] == 2
    assert counts["skipped/no 'problem'"] == 1 and counts["skipped/problem_type 'shape' is none of multiple choice, "
                                                            "numerical, OCR, free-form, regression"] == 1
    kept, counts = prepare(rows, tmp_path, types=["regression"])
    assert [r["problem_type"] for r in kept] == ["regression"] and counts["skipped/type filter"] == 2
    assert len(prepare(rows, tmp_path, limit=1)[0]) == 1
    src = tmp_path / "in.json"
    src.write_text(json.dumps(rows))
    assert main([str(src), "--media-root", str(tmp_path), "--out", str(tmp_path / "out.jsonl")]) == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    assert "out.jsonl: 2 of 5 records" in capsys.readouterr().out
    (tmp_path / "broken.json").write_text("[{")
    assert main([str(tmp_path / "broken.json"), "--media-root", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("prepare: ")
