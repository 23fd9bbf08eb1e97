"""`streamgrpo report`: plots from a recorded metrics.jsonl + audit logs; the eval table's pure parts."""

from __future__ import annotations

import json
import math
import random
import re
import struct
import zlib

import pytest

from streamgrpo.commands.evaluate import probe_rows, render_markdown, render_text, table_rows
from streamgrpo.commands.report import build_report, group_staleness, rates, read_jsonl, run_report, smooth
from streamgrpo.evaluator.scoring import difference, shuffle_drop, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_png(path) -> tuple[int, int]:
    """A complete, valid PNG: magic, IHDR first, every chunk CRC right, IEND last; returns (w, h)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    pos, chunks, size = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"{path}: bad CRC in {kind!r}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    assert size[0] > 100 and size[1] > 100
    return size


def _recorded_run(run, steps=60, generators=2, with_sync=True):
    """A run directory as the learner and generators write it (keys of step_data.StepRecord)."""
    rng = random.Random(0)
    run.mkdir(parents=True, exist_ok=True)
    (run / "audit").mkdir()
    t = 1_700_000_000.0
    version = 0
    gen_logs = {k: [] for k in range(generators)}
    learner_log = []
    trained = 0
    with open(run / "metrics.jsonl", "w") as fh:
        for step in range(1, steps + 1):
            ids = []
            for g in range(8):
                k = g % generators
                stale = rng.choice([0, 0, 1, 1, 2, 3])
                gid = f"g{step}-{g}"
                ids.append(gid)
                gen_logs[k].append({"event": "produced", "group_id": gid, "version": max(0, version - stale),
                                    "reward": rng.random(), "t": t - rng.random() * 3, "put_s": 0.001})
                if with_sync and g == 0:
                    gen_logs[k].append({"event": "applied", "version": version, "weight_sync_s": 0.05 + rng.random() / 10,
                                        "t": t})
            t += 2.0 + rng.random()
            version += 1
            trained += 8
            learner_log.append({"event": "trained", "step": step, "version": version, "group_ids": ids})
            acc = min(1.0, 0.3 + step / steps * 0.6 + rng.uniform(-0.05, 0.05))
            rec = {
                "step": step, "version": version, "time": t, "reward": 0.3 * 0.9 + 0.7 * acc,
                "rewards": {"format": 0.9, "accuracy": acc}, "accuracy": acc,
                "group_accuracy": [acc] * 8, "loss": 0.1 * math.exp(-step / 30), "kl": 0.001 * step,
                "entropy": 1.5 - step / 100, "clip_frac": 0.02, "clip_frac_low": 0.01, "clip_frac_high": 0.01,
                "ratio_mean": 1.0, "ratio_max": 1.2, "ratio_min": 0.8, "grad_norm": 0.5, "adv_mean": 0.0,
                "adv_std": 0.9, "staleness_mean": 1.2, "staleness_max": 3, "groups_trained": trained,
                "groups_dropped": {"stale": step // 10}, "tokens": 400 + step, "completion_len_mean": 6.0,
                "lr": 5e-4, "seconds": 1.5, "wait_seconds": 0.5,
            }
            if step == 7:
                rec["kl"] = None  # a step without a value
            fh.write(json.dumps(rec) + "\n")
        fh.write('{"step": 61, "rew')  # a line cut short by a kill
    for k, rows in gen_logs.items():
        (run / "audit" / f"generator-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "audit" / "learner.jsonl").write_text("".join(json.dumps(r) + "\n" for r in learner_log))
    return gen_logs, learner_log


def test_report_writes_valid_pngs_and_markdown(tmp_path, capsys):
    run = tmp_path / "run"
    _recorded_run(run)
    assert run_report(str(run)) == 0
    out = run / "report"
    names = ["rewards.png", "loss_kl.png", "staleness.png", "throughput.png", "weight_sync.png"]
    for name in names:
        w, h = _check_png(out / name)
        assert (out / name).stat().st_size > 5000  # a real plot, not an empty canvas
    md = (out / "report.md").read_text()
    for name in names:
        assert f"]({name})" in md
    assert "steps: 60" in md
    assert "1 unreadable line(s) skipped" in md
    assert "groups dropped: stale=6" in md
    assert "report.md" in capsys.readouterr().out


def test_report_copes_with_sparse_metrics(tmp_path):
    """Only step + reward recorded, no audit: the reward plot exists, the others say why not."""
    run = tmp_path / "sparse"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 6)))
    report = build_report(run)
    _check_png(run / "report" / "rewards.png")
    for name in ("loss_kl.png", "staleness.png", "throughput.png", "weight_sync.png", "eval.png"):
        assert not (run / "report" / name).exists()
    md = report.read_text()
    assert "](rewards.png)" in md
    assert md.count("*Not plotted:") == 5 and "`streamgrpo evaluator` did not run" in md
    assert "weight_sync_s" in md


def test_report_without_metrics_is_an_error(tmp_path, capsys):
    assert run_report(str(tmp_path)) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_group_staleness_joins_audit_logs(tmp_path):
    run = tmp_path / "run"
    gen_logs, learner_log = _recorded_run(run, steps=5)
    audit = {p.stem: read_jsonl(p)[0] for p in (run / "audit").glob("*.jsonl")}
    got = group_staleness(audit)
    produced = {r["group_id"]: r["version"] for rows in gen_logs.values() for r in rows if r["event"] == "produced"}
    want = [e["version"] - 1 - produced[g] for e in learner_log for g in e["group_ids"]]
    assert sorted(got) == sorted(want) and len(got) == 40
    assert min(got) >= 0


def test_smooth_and_rates():
    assert smooth([1, 2, 3, 4], 1) == [1, 2, 3, 4]
    assert smooth([2, 4, 6, 8], 2) == [2, 3, 5, 7]
    xs, ys = rates([10.0, 11.0, 19.0, 20.0] * 2, [1] * 8, t0=0.0, bins=2)
    assert ys == pytest.approx([0.0, 0.8])  # bins of 10 s: 0 in the first, 8 in the second
    assert xs == pytest.approx([5 / 60, 15 / 60])


# ------------------------------------------------------------------------- eval summary (pure)
def _row(rid, sample, text, acc, fmt, tokens):
    return {"id": rid, "sample": sample, "completion": text, "completion_tokens": tokens,
            "rewards": {"format": fmt, "accuracy": acc}, "reward": 0.3 * fmt + 0.7 * acc}


def test_summarize_pass_at_k_and_format():
    rows = [
        _row("a", 0, "<think>x</think> <answer>B</answer>", 1.0, 1.0, 10),
        _row("a", 1, "<answer>C</answer>", 0.0, 0.3, 4),
        _row("b", 0, "<think>y</think><answer>A</answer>", 0.0, 1.0, 8),
        _row("b", 1, "nothing", 0.0, 0.0, 6),
    ]
    s = summarize(rows, samples=2, reward_names=["format", "accuracy"], think_tag="think", answer_tag="answer")
    assert s["records"] == 2 and s["completions"] == 4
    assert s["accuracy"] == pytest.approx(0.25)
    assert s["pass@2"] == pytest.approx(0.5)
    assert s["reward/format"] == pytest.approx(0.575)
    assert s["format_compliance"] == pytest.approx(0.5)
    assert s["completion_tokens"] == pytest.approx(7.0)
    no_think = summarize(rows, samples=2, reward_names=["format", "accuracy"], think_tag=None, answer_tag="answer")
    assert no_think["format_compliance"] == pytest.approx(0.75)
    numeric = summarize([{**r, "rewards": {"numeric": r["rewards"]["accuracy"]}} for r in rows], samples=2,
                        reward_names=["numeric"], think_tag=None, answer_tag="answer")
    assert numeric["accuracy_reward"] == "numeric" and numeric["accuracy"] == pytest.approx(0.25)


def test_table_has_difference_column():
    m = {"records": 2, "accuracy": 0.75, "reward": 0.8, "completion_tokens": 5.0, "accuracy_reward": "accuracy"}
    b = {"records": 2, "accuracy": 0.25, "reward": 0.5, "completion_tokens": 9.0, "accuracy_reward": "accuracy"}
    result = {"model": {"name": "M", "metrics": m}, "baseline": {"name": "B", "metrics": b},
              "difference": difference(m, b),
              "settings": {"data": "d.jsonl", "records": 2, "skipped": 0, "samples": 1, "temperature": 0.0,
                           "max_new_tokens": 8, "prompt_format": "think", "rewards": {"accuracy": 1.0},
                           "outputs": {"model": "/x/outputs-model.jsonl"}}}
    rows = table_rows(result)
    assert rows[0] == ["metric", "model", "baseline", "difference"]
    by = {r[0]: r for r in rows[1:]}
    assert by["accuracy"] == ["accuracy", "0.7500", "0.2500", "+0.5000"]
    assert by["completion_tokens"][3] == "-4.0"
    md = render_markdown(result)
    assert "| accuracy | 0.7500 | 0.2500 | +0.5000 |" in md and "greedy" in md


def test_per_kind_accuracy_and_the_shuffled_frames_table():
    kinds = {"a": "colour", "b": "colour", "c": "direction", "d": None}
    ordered = [_row("a", 0, "<answer>A</answer>", 1.0, 1.0, 4), _row("b", 0, "<answer>B</answer>", 0.0, 1.0, 4),
               _row("c", 0, "<answer>C</answer>", 1.0, 1.0, 4), _row("d", 0, "x", 0.0, 0.0, 4)]
    shuffled = [{**r, "rewards": {**r["rewards"], "accuracy": acc}} for r, acc in zip(ordered, (1.0, 0.0, 0.0, 1.0))]
    kw = dict(samples=1, reward_names=["format", "accuracy"], think_tag=None, answer_tag="answer")
    plain = summarize(ordered, **kw)
    assert "by_kind" not in plain  # without kinds, the summary of today
    m, s = summarize(ordered, kinds=kinds, **kw), summarize(shuffled, kinds=kinds, **kw)
    assert {k: v for k, v in m.items() if k != "by_kind"} == plain
    assert m["by_kind"] == {"(no kind)": {"records": 1, "accuracy": 0.0}, "colour": {"records": 2, "accuracy": 0.5},
                            "direction": {"records": 1, "accuracy": 1.0}}
    drop = shuffle_drop(m, s)
    assert drop["accuracy"] == pytest.approx(0.5 - 0.5)
    assert drop["by_kind"] == pytest.approx({"(no kind)": -1.0, "colour": 0.0, "direction": 1.0})

    settings = {"data": "d.jsonl", "records": 4, "skipped": 0, "samples": 1, "temperature": 0.0, "max_new_tokens": 8,
                "prompt_format": "no_think", "rewards": {"accuracy": 1.0}, "outputs": {"model": "/x/outputs-model.jsonl"}}
    result = {"model": {"name": "M", "metrics": plain}, "settings": settings}
    assert probe_rows(result) is None and "shuffled" not in render_text(result)  # no flag: the table of today
    assert "Temporal probe" not in render_markdown(result)
    result = {"model": {"name": "M", "metrics": m, "shuffled": s, "shuffle_drop": drop},
              "settings": {**settings, "shuffle_frames": True, "shuffle_seed": 5}}
    rows = probe_rows(result)
    assert rows[0] == ["kind", "records", "model ordered", "model shuffled", "model drop"]
    by = {r[0]: r for r in rows[1:]}
    assert list(by) == ["(no kind)", "colour", "direction", "overall"]
    assert by["direction"] == ["direction", "1", "1.0000", "0.0000", "+1.0000"]
    assert by["overall"] == ["overall", "4", "0.5000", "0.5000", "+0.0000"]
    assert table_rows(result) == table_rows({"model": {"name": "M", "metrics": plain}})  # by_kind is not a row
    text = render_text(result)
    assert "seed 5" in text and re.search(r"^direction\s+1\s+1\.0000\s+0\.0000\s+\+1\.0000$", text, re.M)
    md = render_markdown(result)
    assert "| kind | records | model ordered | model shuffled | model drop |" in md
    assert "| colour | 2 | 0.5000 | 0.5000 | +0.0000 |" in md


def _eval_lines() -> list[dict]:
    def line(v, acc, direction, colour, shuffled_dir):
        return {"version": v, "accuracy": acc, "by_kind": {"colour": {"accuracy": colour}, "direction": {"accuracy": direction}},
                "shuffled": {"accuracy": acc - 0.1, "by_kind": {"colour": {"accuracy": colour},
                                                               "direction": {"accuracy": shuffled_dir}}}}
    return [line(20, 0.6, 0.5, 0.7, 0.25), line(0, 0.3, 0.25, 0.35, 0.25), line(10, 0.6, 0.45, 0.75, 0.3)]


def test_eval_curves_and_the_best_held_out_accuracy():
    """eval.jsonl lines (any order) become curves over versions per kind, ordered and shuffled; the
    summary's best held-out accuracy is the earliest version that reached it."""
    from streamgrpo.commands.report import eval_series
    from streamgrpo.commands.up_watch import best_eval

    curves = eval_series(_eval_lines())
    assert curves["all"] == ([0.0, 10.0, 20.0], [0.3, 0.6, 0.6])
    assert curves["direction (shuffled)"] == ([0.0, 10.0, 20.0], [0.25, 0.3, 0.25])
    assert set(curves) == {"all", "colour", "direction", "all (shuffled)", "colour (shuffled)", "direction (shuffled)"}
    assert best_eval(_eval_lines()) == {"best_eval_accuracy": 0.6, "best_eval_version": 10}
    assert best_eval([{"version": 1, "accuracy": None}]) == {"best_eval_accuracy": None, "best_eval_version": None}


def test_report_plots_held_out_accuracy_from_eval_jsonl(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 6)))
    (run / "eval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in _eval_lines()))
    md = build_report(run).read_text()
    _check_png(run / "report" / "eval.png")
    assert (run / "report" / "eval.png").stat().st_size > 5000 and "](eval.png)" in md
