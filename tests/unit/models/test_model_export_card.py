"""The pure parts of ``streamgrpo model export`` (streamgrpo/models/export.py): which files go out, the metrics
line of the checkpoint's step, the evaluator's table, the card's metadata block."""

from __future__ import annotations

import yaml

from streamgrpo.models.export import (
    eval_history,
    export_card,
    is_hub_id,
    metrics_at,
    model_files,
    split_front_matter,
)

CHECKPOINT = ["README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja", "config.json",
              "generation_config.json", "merges.txt", "model-00001-of-00002.safetensors",
              "model-00002-of-00002.safetensors", "model.safetensors.index.json", "optimizer.safetensors",
              "preprocessor_config.json", "rng-rank1.json", "rng-rank1.safetensors", "rng.safetensors",
              "tokenizer.json", "trainer_state.json", "video_preprocessor_config.json", "vocab.json"]
PROCESSOR = ["chat_template.jinja", "merges.txt", "preprocessor_config.json", "tokenizer.json",
             "video_preprocessor_config.json", "vocab.json"]


def test_model_files_leave_the_training_state_out():
    weights = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert model_files(CHECKPOINT, adapter=False) == sorted(weights + PROCESSOR)
    assert model_files(CHECKPOINT, adapter=True, merged=True) == PROCESSOR  # the merge writes weights and config
    assert "adapter_model.safetensors" in model_files(CHECKPOINT, adapter=True)


def test_metrics_of_the_checkpoints_step():
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.0}]
    assert metrics_at(lines, 2) == {"step": 2, "loss": 1.5}  # a resumed run wrote step 2 again: the last
    assert metrics_at(lines, 7) is None


def test_eval_history_up_to_the_checkpoints_version():
    lines = [{"version": 4, "records": 10, "accuracy": 0.5, "by_kind": {"b": {"accuracy": 0.25}}},
             {"version": 0, "records": 10, "accuracy": None, "format_compliance": 0.5},
             {"version": 9, "accuracy": 0.9}, {"no": "version"}]
    rows = eval_history(lines, 4)
    assert rows[0] == ["version", "records", "accuracy", "accuracy (b)", "format", "completion tokens"]
    assert rows[1:] == [["0", "10", "-", "-", "0.500", "-"], ["4", "10", "0.500", "0.250", "-", "-"]]
    assert eval_history([], 4) == [["version", "records", "accuracy", "format", "completion tokens"]]


def test_card_metadata_names_only_a_hub_base_model():
    assert is_hub_id("Qwen/Qwen2.5-VL-7B-Instruct") and not is_hub_id("/models/qwen") and not is_hub_id("./a/b")
    assert not is_hub_id("runs/a/b") and not is_hub_id(None)
    card = export_card(body="# run\n\n## Final metrics\n\n## Use\n\nold", base_model="Qwen/Qwen2.5-VL-7B-Instruct",
                       adapter=True, lora={"r": 8, "lora_alpha": 16}, step=5, eval_md=None, history=[["version"]],
                       config_yaml=None)
    meta, body = split_front_matter(card)
    assert meta == {"base_model": "Qwen/Qwen2.5-VL-7B-Instruct", "library_name": "peft",
                    "pipeline_tag": "image-text-to-text", "tags": ["streamgrpo", "grpo", "video", "qwen-vl", "lora"]}
    assert body.count("## Use") == 1 and "old" not in body and "PeftModel.from_pretrained" in body
    assert "Held-out accuracy" not in body and "Training config" not in body  # no files: no sections
    meta, _ = split_front_matter(export_card(body="# run", base_model="/tmp/local", adapter=False, lora=None, step=None,
                                             eval_md=None, history=[], config_yaml="a: 1\n"))
    assert "base_model" not in meta and meta["library_name"] == "transformers"
    assert yaml.safe_load(card.split("---\n")[1]) == split_front_matter(card)[0]
