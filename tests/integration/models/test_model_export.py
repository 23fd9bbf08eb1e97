"""``streamgrpo model export`` on real checkpoints of the tiny Qwen2.5-VL (full weights and LoRA, each after a
learner step on real groups), and ``streamgrpo model push`` against a local server speaking the Hub's upload
API (tests/hub_server.py) up to the HTTP boundary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hub_server import HubServer

from streamgrpo.cli import main

EXPORTED = {"README.md", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
            "processor_config.json", "tokenizer.json", "tokenizer_config.json"}
METRICS = {"step": 1, "version": 1, "loss": 0.25, "kl": 0.0125, "reward": 0.5, "rewards": {"accuracy": 0.5}}
EVAL_MD = "# Evaluation\n\n- **model:** `step-000001`\n\n| metric | model |\n|---|---|\n| accuracy | 0.625 |\n\n" \
          "## Temporal probe: shuffled frames\n\nRaw completions: `outputs-model.jsonl`\n"


def _train_and_save(tiny_model_dir, demo_data_dir, run: Path, lora: bool):
    """A learner after one step on two real groups, checkpointed as the learner loop does (with its card), in
    a run directory holding what a run leaves: config.yaml (a password in queue.url), metrics.jsonl,
    eval.jsonl (versions 0..2; the checkpoint is version 1) and the checkpoint's `streamgrpo eval` result."""
    from conftest import sampled_groups

    from streamgrpo.config import load_config
    from streamgrpo.learner.state import Accepted
    from streamgrpo.learner.trainer import Learner
    from streamgrpo.models.card import model_card

    groups = sampled_groups(tiny_model_dir, Path(demo_data_dir) / "train.jsonl", 4, num_generations=4, max_tokens=6)
    sets = [f"model.name_or_path={tiny_model_dir}", f"run_dir={run}", "learner.groups_per_step=2",
            "learner.learning_rate=5e-2", f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}"]
    cfg = load_config("demo", sets + (["model.lora={r: 4, alpha: 16, dropout: 0.0}"] if lora else []))
    learner = Learner(cfg)
    learner.train_step(Accepted.directly(groups[:2], learner.processor))
    learner.state.step, learner.state.version = 1, 1
    on_disk = cfg.model_copy(deep=True)
    on_disk.queue.url = "redis://:hunter2@redis.example:6379/0"
    (run / "config.yaml").write_text(on_disk.to_yaml())
    (run / "metrics.jsonl").write_text(json.dumps({**METRICS, "step": 0, "loss": 9.0}) + "\n" + json.dumps(METRICS) + "\n")
    (run / "eval.jsonl").write_text("".join(json.dumps(
        {"version": v, "records": 8, "accuracy": 0.25 * (v + 1), "format_compliance": 1.0, "completion_tokens": 5.5,
         "by_kind": {"color": {"records": 8, "accuracy": 0.25 * (v + 1)}}}) + "\n" for v in range(3)))
    ckpt = learner.save(run / "checkpoints", model_card=model_card(cfg, learner.state.to_json(), METRICS))
    (ckpt / "eval").mkdir()
    (ckpt / "eval" / "eval.md").write_text(EVAL_MD)
    return learner, ckpt


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, demo_data_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("export_full_run")
    learner, ckpt = _train_and_save(tiny_model_dir, demo_data_dir, run, lora=False)
    return {"learner": learner, "ckpt": ckpt, "run": run}


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, demo_data_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("export_lora_run")
    learner, ckpt = _train_and_save(tiny_model_dir, demo_data_dir, run, lora=True)
    return {"learner": learner, "ckpt": ckpt, "run": run}


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer("What colour is the square? Answer with one word.", return_tensors="pt").input_ids
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_of_a_full_checkpoint_loads_with_transformers_as_trained(full_run, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    learner, out = full_run["learner"], tmp_path / "export"
    assert main(["model", "export", str(full_run["run"]), "--out", str(out)]) == 0  # a run dir: its newest checkpoint
    assert {p.name for p in out.iterdir()} == EXPORTED  # no optimizer, RNG, trainer state, eval outputs
    model = AutoModelForImageTextToText.from_pretrained(out)
    trained = learner.module.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, trained[name]), name  # the trained weights (vision tower included), not the base's
    processor = AutoProcessor.from_pretrained(out)
    torch.testing.assert_close(_logits(model, processor.tokenizer), _logits(learner.module, processor.tokenizer),
                               rtol=0, atol=0)

    meta, body = yaml.safe_load((out / "README.md").read_text().split("---\n")[1]), (out / "README.md").read_text()
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "image-text-to-text"
    assert "base_model" not in meta  # a local directory is no Hub id
    assert "| loss | 0.2500 |" in body and "9.0000" not in body  # the checkpoint's step, from metrics.jsonl
    assert "## Evaluation (`streamgrpo eval` of this checkpoint)" in body and "| accuracy | 0.625 |" in body
    assert "### Temporal probe" in body and "Raw completions" not in body
    history = body.split("## Held-out accuracy during training")[1].split("\n## ")[0]
    assert "| 0 | 8 | 0.250 | 0.250 | 1.000 | 5.500 |" in history and "| 1 | 8 | 0.500 |" in history
    assert "| 2 |" not in history  # evaluated after the checkpoint's version
    config = yaml.safe_load(body.split("```yaml\n")[1].split("```")[0])
    assert config["learner"]["learning_rate"] == 5e-2 and config["model"]["lora"] is None
    assert "hunter2" not in body and config["queue"]["url"] == "redis://:***@redis.example:6379/0"


def test_export_of_a_lora_checkpoint_merged_and_as_an_adapter(lora_run, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    learner = lora_run["learner"]
    tokenizer = AutoProcessor.from_pretrained(lora_run["ckpt"]).tokenizer
    want = _logits(learner.module, tokenizer)
    assert not torch.allclose(want, _logits(AutoModelForImageTextToText.from_pretrained(tiny_model_dir), tokenizer))

    merged = tmp_path / "merged"
    assert main(["model", "export", str(lora_run["ckpt"]), "--out", str(merged)]) == 0
    assert {p.name for p in merged.iterdir()} == EXPORTED
    model = AutoModelForImageTextToText.from_pretrained(merged)
    assert not any("lora" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(_logits(model, tokenizer), want, rtol=1e-5, atol=1e-5)
    card = (merged / "README.md").read_text()
    assert "the LoRA adapter (r = 4, alpha = 16) merged into" in card and "library_name: transformers" in card

    adapter = tmp_path / "adapter"
    assert main(["model", "export", str(lora_run["ckpt"]), "--out", str(adapter), "--adapter",
                 "--base", "example-org/tiny-qwen2.5-vl"]) == 0
    assert {p.name for p in adapter.iterdir()} == EXPORTED - {"config.json", "generation_config.json",
                                                              "model.safetensors"} | {"adapter_config.json",
                                                                                      "adapter_model.safetensors"}
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "example-org/tiny-qwen2.5-vl"
    meta = yaml.safe_load((adapter / "README.md").read_text().split("---\n")[1])
    assert meta["base_model"] == "example-org/tiny-qwen2.5-vl" and meta["library_name"] == "peft"
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_model_dir), adapter)
    torch.testing.assert_close(_logits(peft_model, tokenizer), want, rtol=1e-5, atol=1e-5)


def test_export_refuses_in_one_line(full_run, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    cases = [([str(full_run["ckpt"]), "--out", str(busy)], "exists and is not empty"),
             ([str(full_run["ckpt"]), "--out", str(tmp_path / "a"), "--adapter"], "--adapter needs a LoRA checkpoint"),
             ([str(tmp_path), "--out", str(tmp_path / "b")], "no config.json or adapter_config.json")]
    for argv, why in cases:
        assert main(["model", "export", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("streamgrpo model export: ") and why in err and "\n" not in err


# ------------------------------------------------------------------------------------------------- push
def _push(folder, repo: str, **env) -> subprocess.CompletedProcess:
    """``streamgrpo model push`` as a user runs it: a process of its own, the Hub and token from the environment."""
    return subprocess.run([sys.executable, "-m", "streamgrpo", "model", "push", str(folder), "--repo", repo],
                          env={**os.environ, "HF_HUB_OFFLINE": "0", **env}, capture_output=True, text=True, timeout=120)


def test_push_uploads_the_export_in_one_commit(full_run, tmp_path):
    out = tmp_path / "export"
    assert main(["model", "export", str(full_run["ckpt"]), "--out", str(out)]) == 0
    with HubServer(token="hf_streamgrpo_test") as hub:
        res = _push(out, "example-org/tiny-grpo", HF_ENDPOINT=hub.url, HF_TOKEN="hf_streamgrpo_test",
                    HF_HOME=str(tmp_path / "hf_home"))
    assert res.returncode == 0, res.stderr
    assert hub.created == [{"name": "tiny-grpo", "organization": "example-org", "visibility": "public"}]
    assert hub.validated == [(out / "README.md").read_text()] and not hub.unknown
    [commit] = hub.commits
    assert commit["repo"] == "example-org/tiny-grpo" and commit["revision"] == "main" and not commit["other"]
    assert commit["header"]["summary"] == "streamgrpo model export (export)"
    assert commit["files"] == {p.name: p.read_bytes() for p in out.iterdir()}  # every file, byte for byte
    assert f"{hub.url}/example-org/tiny-grpo/commit/" in res.stdout


def test_push_failures_are_one_line_and_exit_non_zero(full_run, tmp_path):
    out = tmp_path / "export"
    assert main(["model", "export", str(full_run["ckpt"]), "--out", str(out)]) == 0
    home = str(tmp_path / "hf_home")  # no token file there
    env = {"HF_TOKEN": "hf_wrong", "HF_HOME": home}
    with HubServer(token="hf_streamgrpo_test") as hub:
        cases = [
            (_push(out, "me/m", HF_ENDPOINT=hub.url, **env), 1, "refused the token (HTTP 401)"),
            (_push(out, "me/m", HF_ENDPOINT=hub.url, HF_HOME=home, HF_TOKEN=""), 1, "no Hugging Face token"),
            (_push(out, "me/m", HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="1", **env), 1, "offline mode is on"),
            (_push(full_run["ckpt"], "me/m", HF_ENDPOINT=hub.url, **env), 2, "holds training state"),
        ]
        with HubServer(token="t") as gone:
            url = gone.url  # a port nothing listens on once this server is closed
        cases.append((_push(out, "me/m", HF_ENDPOINT=url, **env), 1, f"cannot reach {url}"))
    assert hub.refused == 1 and not hub.commits and not hub.created  # only the first case reached the server
    for res, code, why in cases:
        lines = res.stderr.strip().splitlines()
        assert res.returncode == code and len(lines) == 1 and why in lines[0], res.stderr
        assert lines[0].startswith("streamgrpo model push: ")


def test_push_does_not_import_torch():
    code = "import sys, streamgrpo.commands.model_push; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
