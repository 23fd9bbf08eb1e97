"""`streamgrpo infer` / `streamgrpo eval` on the tiny Qwen2.5-VL with the demo videos; model card.

Real parts throughout: the CLI parser, the tiny model from disk, real mp4/PNG files, the HF engine,
the reward set, checkpoints written by ``save_checkpoint``.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from streamgrpo.cli import main
from streamgrpo.config import load_config
from streamgrpo.metrics import ERRORS
from streamgrpo.rewards import RewardSet, extract_answer

DEMO = ["--config", "demo", "--set", "data.kinds=null"]  # the demo's frame/pixel settings, every question kind
INFER_KEYS = {"id", "prompt", "completion", "answer", "finish_reason", "completion_tokens"}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _input_file(tmp_path, demo_data_dir):
    """The demo test records plus three bad ones (missing video, broken JSON, unreadable mp4) and
    one without a ground truth."""
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video")
    lines = (demo_data_dir / "test.jsonl").read_text().splitlines()
    good = [json.loads(x) for x in lines]
    q = "<video>\nWhat colour is the moving square? (A) red (B) green (C) blue."
    extra = [
        json.dumps({"id": "bad-missing", "conversations": [{"from": "human", "value": q},
                    {"from": "gpt", "value": "<answer>A</answer>"}], "video": "videos/no_such_clip.mp4"}),
        '{"id": "bad-json", "conversations": [',
        json.dumps({"id": "bad-decode", "conversations": [{"from": "human", "value": q},
                    {"from": "gpt", "value": "<answer>A</answer>"}], "video": str(broken)}),
        json.dumps({"id": "no-truth", "conversations": [{"from": "human", "value": q}],
                    "video": good[0]["video"] if isinstance(good[0]["video"], str) else good[0]["video"][0]}),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines[:3] + extra[:2] + lines[3:6] + extra[2:] + lines[6:]) + "\n")
    ids = [g["id"] for g in good]
    return path, ids[:6] + ["no-truth"] + ids[6:]


def _infer(model, inp, out, demo_data_dir, *extra):
    return main(["infer", "--model", str(model), "--input", str(inp), "--output", str(out), "--max-new-tokens", "6",
                 *DEMO, "--set", f"data.media_root={demo_data_dir}", *extra])


def test_infer_single_video_and_image(tiny_model_dir, demo_data_dir, tmp_path, capsys):
    videos = sorted((demo_data_dir / "videos").glob("*.mp4"))[:2]
    image = sorted((demo_data_dir / "images").glob("*.png"))[0]
    out = tmp_path / "single.jsonl"
    argv = ["infer", "--model", str(tiny_model_dir), "--video", str(videos[0]), "--video", str(videos[1]),
            "--image", str(image), "--prompt", "Which clip shows a red square?", "--max-new-tokens", "5",
            "--output", str(out), *DEMO]
    assert main(argv) == 0
    (row,) = _lines(out)
    assert INFER_KEYS <= set(row) and "rewards" not in row  # no ground truth, nothing to score
    assert row["prompt"] == "<video>\n<video>\n<image>\nWhich clip shows a red square?"
    assert 1 <= row["completion_tokens"] <= 5
    assert row["answer"] == extract_answer(row["completion"])
    assert row["completion"] in capsys.readouterr().out
    # placeholders in the prompt must match the files given
    assert main(["infer", "--model", str(tiny_model_dir), "--video", str(videos[0]), "--prompt",
                 "<video> <video> two?", *DEMO]) == 2
    assert "placeholders" in capsys.readouterr().err


def test_infer_batch_schema_bad_records_and_rewards(tiny_model_dir, demo_data_dir, tmp_path, capsys):
    inp, want_ids = _input_file(tmp_path, demo_data_dir)
    out = tmp_path / "out.jsonl"
    errors_before = ERRORS.labels(kind="data")._value.get()
    assert _infer(tiny_model_dir, inp, out, demo_data_dir, "--batch-size", "3") == 0
    rows = _lines(out)
    assert [r["id"] for r in rows] == want_ids  # input order, each good record once, bad ones absent
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 3
    assert any("'bad-missing'" in s and "no_such_clip.mp4" in s for s in skipped)
    assert any("'bad-decode'" in s and "broken.mp4" in s for s in skipped)
    assert any("in.jsonl:5" in s and "not valid JSON" in s for s in skipped)
    assert ERRORS.labels(kind="data")._value.get() - errors_before == 3

    cfg = load_config("demo", ["data.kinds=null"])
    rewards = RewardSet(cfg)
    truth = {json.loads(x)["id"]: x for x in (demo_data_dir / "test.jsonl").read_text().splitlines()}
    for r in rows:
        assert INFER_KEYS <= set(r)
        assert r["answer"] == extract_answer(r["completion"])
        assert r["finish_reason"] in ("stop", "length") and 1 <= r["completion_tokens"] <= 6
        if r["id"] == "no-truth":
            assert "rewards" not in r and "ground_truth" not in r
            continue
        gt = re.search(r"<answer>(.*)</answer>", json.loads(truth[r["id"]])["conversations"][1]["value"]).group(1)
        assert r["ground_truth"] == gt
        again = rewards.score([r["completion"]], gt)
        assert r["rewards"] == again.for_completion(0) and r["reward"] == pytest.approx(again.totals[0])


def test_infer_batch_resumes_after_interruption(tiny_model_dir, demo_data_dir, tmp_path, capsys):
    inp, want_ids = _input_file(tmp_path, demo_data_dir)
    full = tmp_path / "full.jsonl"
    assert _infer(tiny_model_dir, inp, full, demo_data_dir, "--batch-size", "1") == 0
    reference = _lines(full)

    # The state a kill leaves: three complete lines and half of the fourth.
    cut = tmp_path / "cut.jsonl"
    kept = [dict(r) for r in reference[:3]]
    kept[1]["completion"] = "KEPT FROM THE FIRST RUN"  # proves the line is not regenerated
    text = "".join(json.dumps(r) + "\n" for r in kept) + json.dumps(reference[3])[:25]
    cut.write_text(text)
    capsys.readouterr()
    assert _infer(tiny_model_dir, inp, cut, demo_data_dir, "--batch-size", "1") == 0
    assert "3 record(s) already in" in capsys.readouterr().err
    resumed = _lines(cut)
    assert [r["id"] for r in resumed] == want_ids
    assert resumed[:3] == kept
    assert resumed[3:] == reference[3:]  # greedy: the same answers as the uninterrupted run
    # A finished output: nothing to do, file untouched.
    before = cut.read_bytes()
    assert _infer(tiny_model_dir, inp, cut, demo_data_dir) == 0
    assert cut.read_bytes() == before


def test_hf_engine_greedy_is_argmax_and_deterministic(tiny_model_dir, demo_data_dir):
    from streamgrpo.commands.infer import read_input_records
    from streamgrpo.engines.base import SamplingParams
    from streamgrpo.evaluator.answering import load_policy, prepare_request

    cfg = load_config("demo", ["data.kinds=null"])
    policy = load_policy(str(tiny_model_dir), cfg)
    records, errors, _ = read_input_records(demo_data_dir / "test.jsonl", cfg.data)
    assert not errors
    reqs = [prepare_request(policy, r, cfg.data) for r in records[:3]]
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=5, seed=None)
    a = policy.engine.generate(reqs, greedy)
    torch.manual_seed(123)
    b = policy.engine.generate(reqs, greedy)
    for ga, gb, req in zip(a, b, reqs):
        assert np.array_equal(ga[0].token_ids, ga[1].token_ids)  # n copies of the one argmax path
        assert np.array_equal(ga[0].token_ids, gb[0].token_ids)
        with torch.no_grad():
            logits = policy.engine.model(**req.inputs).logits[0, -1].float()
        logits[policy.engine.suppress_ids] = -torch.inf
        assert int(ga[0].token_ids[0]) == int(logits.argmax())
        assert ga[0].logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-4)


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, demo_data_dir, tmp_path_factory):
    """The tiny model fine-tuned for a few optimizer steps on demo prompts (answer format), saved as
    the learner saves a checkpoint, with the run's config.yaml next to it."""
    from transformers import AutoModelForImageTextToText

    from streamgrpo.learner.checkpoint.files import save_checkpoint
    from streamgrpo.models.card import model_card
    from streamgrpo.models.loading import load_processor
    from streamgrpo.recipes.demo.warm import warm_format

    root = tmp_path_factory.mktemp("trained")
    work = root / "work-model"
    shutil.copytree(tiny_model_dir, work)
    cfg = load_config("demo", [f"data.train_path={demo_data_dir / 'train.jsonl'}", f"run_dir={root / 'run'}",
                               f"model.name_or_path={tiny_model_dir}",
                               "rewards.functions=[{name: format, weight: 0.3}, {name: accuracy, weight: 0.7}]"])
    losses = warm_format(work, data_cfg=cfg.data, seed=0, steps=14, batch_size=8, pool=8)
    assert losses["loss_last"] < losses["loss_first"]
    model = AutoModelForImageTextToText.from_pretrained(work)
    state = {"step": 14, "version": 14, "groups_trained": 112, "dropped": {"stale": 2}}
    last = {"step": 14, "reward": 0.61, "accuracy": 0.42, "kl": 0.003, "loss": 0.0123,
            "rewards": {"format": 0.97, "accuracy": 0.42}}
    run = root / "run"
    ckpt = save_checkpoint(run / "checkpoints", 14, model=model, processor=load_processor(str(work)),
                           state={"learner": state}, model_card=model_card(cfg, state, last))
    (run / "config.yaml").write_text(cfg.to_yaml())
    return run, ckpt, cfg


def test_checkpoint_model_card_fields(trained_run, tiny_model_dir, demo_data_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _run, ckpt, cfg = trained_run
    card = (ckpt / "README.md").read_text()
    assert f"base_model: {tiny_model_dir}" in card
    assert f"`{demo_data_dir / 'train.jsonl'}` (40 records" in card  # data set path and size
    assert "| `format` | 0.3 |" in card and "| `accuracy` | 0.7 |" in card  # rewards and weights
    assert "`dapo`" in card and "epsilon 0.2" in card  # loss settings
    assert f"max_staleness {cfg.learner.max_staleness}" in card and cfg.learner.max_staleness == 6
    assert "**Steps:** 14 optimizer steps" in card
    assert "| accuracy | 0.4200 |" in card and "| reward/format | 0.9700 |" in card  # final metrics
    assert AutoModelForImageTextToText.from_pretrained(ckpt) is not None  # plain transformers
    assert AutoProcessor.from_pretrained(ckpt) is not None


def _recompute(rows, reward_names, samples):
    """The eval metrics, recomputed by hand from saved output rows (no streamgrpo summary code)."""
    ids = sorted({r["id"] for r in rows})
    out = {"records": len(ids), "completions": len(rows),
           "accuracy": float(np.mean([r["rewards"]["accuracy"] for r in rows])),
           "reward": float(np.mean([r["reward"] for r in rows]))}
    if samples > 1:
        out[f"pass@{samples}"] = float(np.mean([any(r["rewards"]["accuracy"] == 1.0 for r in rows if r["id"] == i)
                                                for i in ids]))
    for n in reward_names:
        out[f"reward/{n}"] = float(np.mean([r["rewards"][n] for r in rows]))
    # no_think format: an <answer>...</answer> block
    out["format_compliance"] = float(np.mean([bool(re.search(r"<answer>.*?</answer>", r["completion"], re.S))
                                              for r in rows]))
    out["completion_tokens"] = float(np.mean([r["completion_tokens"] for r in rows]))
    return out


def test_eval_before_after_table(trained_run, tiny_model_dir, demo_data_dir, tmp_path, capsys):
    run, ckpt, cfg = trained_run
    out = tmp_path / "eval"
    # --model RUN_DIR: its newest checkpoint, with the run's own config.yaml (no --config given)
    assert main(["eval", "--model", str(run), "--baseline", str(tiny_model_dir), "--data",
                 str(demo_data_dir / "test.jsonl"), "--out", str(out), "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "eval.json").read_text())
    assert result["model"]["path"] == str(ckpt) and result["baseline"]["path"] == str(tiny_model_dir)
    assert result["settings"]["temperature"] == 0.0 and result["settings"]["prompt_format"] == "no_think"
    names = ["format", "accuracy"]
    rows_m, rows_b = _lines(out / "outputs-model.jsonl"), _lines(out / "outputs-baseline.jsonl")
    n_colour = sum(json.loads(x)["meta"]["kind"] == "colour" for x in (demo_data_dir / "test.jsonl").read_text().splitlines())
    assert len(rows_m) == len(rows_b) == n_colour > 0  # the run's data.kinds=[colour] filter applies
    rewards = RewardSet(cfg)
    for r in rows_m + rows_b:
        assert r["rewards"] == rewards.score([r["completion"]], r["ground_truth"]).for_completion(0)
    want_m, want_b = _recompute(rows_m, names, 1), _recompute(rows_b, names, 1)
    got_m, got_b, diff = result["model"]["metrics"], result["baseline"]["metrics"], result["difference"]
    for k, v in want_m.items():
        assert got_m[k] == pytest.approx(v) and got_b[k] == pytest.approx(want_b[k]), k
        assert diff[k] == pytest.approx(v - want_b[k]), k
    # the few training steps changed the model: it now writes the answer format, the base never does
    assert got_m["format_compliance"] >= 0.5 and got_b["format_compliance"] == 0.0
    md = (out / "eval.md").read_text()
    assert "| metric | model | baseline | difference |" in md
    fc = diff["format_compliance"]
    assert (f"| format_compliance | {want_m['format_compliance']:.4f} | {want_b['format_compliance']:.4f} | "
            f"{fc:+.4f} |") in md
    for k in ("accuracy", "reward/format", "reward/accuracy", "completion_tokens"):
        assert re.search(rf"^\| {re.escape(k)} \| [-\d.]+ \| [-\d.]+ \| [-+\d.]+ \|$", md, re.M), k
    assert re.search(r"^format_compliance\s+[\d.]+\s+0\.0000\s+\+[\d.]+$", printed, re.M)


def test_eval_samples_pass_at_k(trained_run, demo_data_dir, tmp_path):
    run, ckpt, _cfg = trained_run
    out = tmp_path / "eval_k"
    assert main(["eval", "--model", str(ckpt), "--data", str(demo_data_dir / "test.jsonl"), "--out", str(out),
                 "--samples", "3", "--limit", "2", "--max-new-tokens", "8", "--rewards", "accuracy"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert "baseline" not in result and "difference" not in result
    rows = _lines(out / "outputs-model.jsonl")
    assert len(rows) == 6 and sorted(r["sample"] for r in rows) == [0, 0, 1, 1, 2, 2]
    assert all(set(r["rewards"]) == {"accuracy"} for r in rows)
    want = _recompute(rows, ["accuracy"], 3)
    got = result["model"]["metrics"]
    assert got["pass@3"] == pytest.approx(want["pass@3"]) and got["accuracy"] == pytest.approx(want["accuracy"])
    assert result["settings"]["temperature"] == 1.0  # the rollout temperature of the run's config
    md = (out / "eval.md").read_text()
    assert "| pass@3 |" in md and "mean@3" in md


def test_infer_with_lora_adapter_equals_merged(tiny_model_dir, demo_data_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from streamgrpo.models.loading import load_processor

    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a non-trivial adapter
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    merged = tmp_path / "merged"
    peft_model.merge_and_unload().save_pretrained(merged)
    load_processor(str(tiny_model_dir)).save_pretrained(merged)
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join((demo_data_dir / "test.jsonl").read_text().splitlines()[:3]) + "\n")
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    assert _infer(tiny_model_dir, inp, a, demo_data_dir, "--adapter", str(adapter)) == 0
    assert _infer(merged, inp, b, demo_data_dir) == 0
    assert _infer(tiny_model_dir, inp, c, demo_data_dir) == 0
    ra, rb, rc = _lines(a), _lines(b), _lines(c)
    assert [r["completion"] for r in ra] == [r["completion"] for r in rb]
    assert [r["completion"] for r in ra] != [r["completion"] for r in rc]  # the adapter mattered


def test_eval_shuffle_frames_probe(trained_run, tiny_model_dir, demo_data_dir, tmp_path, capsys):
    """``eval --shuffle-frames``: each model answers every record ordered and shuffled, accuracy per
    kind side by side, answers to videos changed, to images not; the same command twice alike."""
    inp = tmp_path / "probe.jsonl"
    lines = [*(demo_data_dir / "test.jsonl").read_text().splitlines(),
             *(demo_data_dir / "test_image.jsonl").read_text().splitlines()[:2]]
    inp.write_text("\n".join(lines) + "\n")
    kind_of = {json.loads(x)["id"]: json.loads(x)["meta"]["kind"] for x in lines}
    _run, ckpt, _cfg = trained_run  # answers in the format: accuracy is not 0 everywhere

    def run(out):
        assert main(["eval", "--model", str(ckpt), "--baseline", str(tiny_model_dir), "--data", str(inp),
                     "--out", str(out), "--max-new-tokens", "8", "--batch-size", "1", "--rewards", "accuracy",
                     "--set", "data.kinds=null", "--set", f"data.media_root={demo_data_dir}",
                     "--shuffle-frames", "--shuffle-seed", "3"]) == 0
        return capsys.readouterr().out

    out = tmp_path / "probe"
    printed = run(out)
    result = json.loads((out / "eval.json").read_text())
    assert result["settings"]["shuffle_frames"] is True and result["settings"]["shuffle_seed"] == 3
    assert result["settings"]["outputs"]["baseline-shuffled"] == str(out / "outputs-baseline-shuffled.jsonl")
    want_kinds = {"colour", "direction", "numeric", "multi_video", "colour_image"}
    for label in ("model", "baseline"):
        ordered, shuffled = _lines(out / f"outputs-{label}.jsonl"), _lines(out / f"outputs-{label}-shuffled.jsonl")
        assert [r["id"] for r in ordered] == [r["id"] for r in shuffled] == list(kind_of)
        # the metrics per kind, recomputed by hand from the two output files
        for rows, got in ((ordered, result[label]["metrics"]), (shuffled, result[label]["shuffled"])):
            assert set(got["by_kind"]) == want_kinds
            assert got["accuracy"] == pytest.approx(np.mean([r["rewards"]["accuracy"] for r in rows]))
            for kind, v in got["by_kind"].items():
                mine = [r["rewards"]["accuracy"] for r in rows if kind_of[r["id"]] == kind]
                assert v["records"] == len(mine) and v["accuracy"] == pytest.approx(np.mean(mine)), (label, kind)
        m, s, drop = result[label]["metrics"], result[label]["shuffled"], result[label]["shuffle_drop"]
        assert drop["accuracy"] == pytest.approx(m["accuracy"] - s["accuracy"])
        for kind in want_kinds:
            assert drop["by_kind"][kind] == pytest.approx(m["by_kind"][kind]["accuracy"] - s["by_kind"][kind]["accuracy"])
        # image records: the same input both times, the same answer
        by_id = {r["id"]: r["completion"] for r in shuffled}
        assert all(by_id[r["id"]] == r["completion"] for r in ordered if kind_of[r["id"]] == "colour_image")
        assert drop["by_kind"]["colour_image"] == 0.0
        if label == "baseline":  # the random model's answers follow its input: the shuffle reached it
            assert any(by_id[r["id"]] != r["completion"] for r in ordered if kind_of[r["id"]] != "colour_image")
    assert result["model"]["metrics"]["by_kind"]["colour"]["accuracy"] > 0  # numbers worth comparing

    # both columns, for both models, in the printed and the markdown tables: a row per kind and overall
    cols = ["kind", "records"] + [f"{lb} {c}" for lb in ("model", "baseline") for c in ("ordered", "shuffled", "drop")]
    assert re.search(r"^" + r"\s+".join(cols) + "$", printed, re.M)
    md = (out / "eval.md").read_text()
    assert "| " + " | ".join(cols) + " |" in md
    m, b = result["model"], result["baseline"]

    def acc(summary, kind):
        return summary["accuracy"] if kind == "overall" else summary["by_kind"][kind]["accuracy"]

    for kind in [*sorted(want_kinds), "overall"]:
        n = len(lines) if kind == "overall" else m["metrics"]["by_kind"][kind]["records"]
        cells = [kind, str(n)]
        for run_ in (m, b):
            a, sh = acc(run_["metrics"], kind), acc(run_["shuffled"], kind)
            cells += [f"{a:.4f}", f"{sh:.4f}", f"{a - sh:+.4f}"]
        assert "| " + " | ".join(cells) + " |" in md, kind
        assert re.search("^" + r"\s+".join(re.escape(c) for c in cells) + "$", printed, re.M), kind

    # the same command again: the same shuffles, the same answers and numbers
    again = tmp_path / "again"
    run(again)
    for name in ("outputs-model-shuffled.jsonl", "outputs-baseline-shuffled.jsonl"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    second = json.loads((again / "eval.json").read_text())
    for label in ("model", "baseline"):
        assert second[label]["shuffled"] == result[label]["shuffled"]
        assert second[label]["shuffle_drop"] == result[label]["shuffle_drop"]
