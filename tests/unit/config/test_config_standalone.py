"""Configs that stand alone: shipped DeepSpeed files by short name, paths beside the config file, a shipped
config loaded and planned from another directory, and `streamgrpo config init` output that loads."""

from __future__ import annotations

import json

import pytest
import yaml

from streamgrpo.cli import main
from streamgrpo.config import ConfigError, build_config, load_config, shipped_configs
from streamgrpo.config.deepspeed_files import resolve, shipped_names
from streamgrpo.config.starter import field_doc, starter_text
from tests.paths import REPO


@pytest.fixture(scope="module")
def qwen_7b_config(tmp_path_factory):
    """config.json of Qwen2.5-VL-7B at its published layer sizes (no weights)."""
    from streamgrpo.models.tiny import write_config

    return write_config(tmp_path_factory.mktemp("qwen-7b-sizes"), "qwen2_5_vl", "7b")


def _stage(cfg) -> int:
    from streamgrpo.learner.deepspeed_setup import deepspeed_config

    return int(deepspeed_config(cfg)["zero_optimization"]["stage"])


def test_shipped_deepspeed_files_by_short_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped_names() == ["zero1", "zero2", "zero2_offload", "zero3"]
    for name, stage in (("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero2_offload", 2), ("zero3.json", 3),
                        ("deploy/deepspeed/zero3.json", 3)):  # the old repo path still finds the shipped file
        cfg = build_config({"learner": {"backend": "deepspeed", "deepspeed_config": name}})
        assert _stage(cfg) == stage, name
    assert resolve("zero2_offload").parent.name == "deepspeed"
    cfg = build_config({"learner": {"backend": "deepspeed", "deepspeed_config": "zero9"}})
    with pytest.raises(ConfigError, match="learner.deepspeed_config='zero9'.*shipped: zero1, zero2, zero2_offload, zero3"):
        _stage(cfg)


def test_a_relative_deepspeed_path_is_read_beside_the_config_file(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    (folder / "ds").mkdir(parents=True)
    (folder / "ds" / "mine.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    (folder / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))  # beside it: wins
    (folder / "my.yaml").write_text("learner: {backend: deepspeed, deepspeed_config: ds/mine.json}\n")
    (folder / "shadow.yaml").write_text("learner: {backend: deepspeed, deepspeed_config: zero3.json}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(folder / "my.yaml")
    assert cfg.learner.deepspeed_config == str((folder / "ds" / "mine.json").resolve())
    assert _stage(cfg) == 1
    assert _stage(load_config(folder / "shadow.yaml")) == 1
    # --set names a path from the working directory, as any command-line path
    (elsewhere / "cwd.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert _stage(load_config(folder / "my.yaml", ["learner.deepspeed_config=cwd.json"])) == 2


def test_a_shipped_config_loads_and_plans_from_another_directory(qwen_7b_config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing of the repository here
    cfg = load_config("qwen2_5_vl_7b_1node")
    assert cfg.learner.deepspeed_config == "zero3" and _stage(cfg) == 3
    args = ["config", "memory", "--config", "qwen2_5_vl_7b_1node", "--set", f"model.name_or_path={qwen_7b_config}",
            "--gpu-gib", "80"]
    assert main(args) == 0
    assert "deepspeed ZeRO-3, bf16, 4 rank(s)" in capsys.readouterr().out
    assert main(["up", "--config", "qwen2_5_vl_7b_1node", "--set", f"model.name_or_path={qwen_7b_config}",
                 "--plan"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0: learner rank 0" in out and "GPU 7: generator-3" in out
    # the Video-R1 recipe's configs, by their recipe names, the same way
    assert main(["up", "--config", "video_r1/qwen2_5_vl_7b_1node", "--set", f"model.name_or_path={qwen_7b_config}",
                 "--plan"]) == 0
    assert "GPU 7: generator-3" in capsys.readouterr().out
    assert _stage(load_config("video_r1/qwen2_5_vl_3b_1node")) == 2


def test_config_init_writes_a_commented_config_that_loads_as_the_shipped_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "init", "--from", "qwen2_5_vl_7b_1node", "my.yaml"]) == 0
    assert "my.yaml: started from 'qwen2_5_vl_7b_1node'" in capsys.readouterr().out
    text = (tmp_path / "my.yaml").read_text()
    assert text.startswith("# Started from the shipped config 'qwen2_5_vl_7b_1node' by `streamgrpo config init`")
    assert "  gpu_memory_utilization: 0.85  # Fraction of GPU memory vLLM may take" in text
    assert load_config("my.yaml").model_dump() == load_config("qwen2_5_vl_7b_1node").model_dump()
    # an existing file is kept: one line, exit 2
    assert main(["config", "init", "--from", "demo", "my.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "streamgrpo config init: my.yaml already exists (--force overwrites it)"
    assert main(["config", "init", "--from", "no_such_config", "other.yaml"]) == 2
    assert not (tmp_path / "other.yaml").exists()


def test_config_init_header_names_the_config_it_came_from(tmp_path, monkeypatch, capsys):
    # two shipped configs end in qwen2_5_vl_7b_1node: the header names the one asked for, which loads as it
    monkeypatch.chdir(tmp_path)
    assert main(["config", "init", "--from", "video_r1/qwen2_5_vl_7b_1node", "my.yaml"]) == 0
    first = (tmp_path / "my.yaml").read_text().splitlines()[0]
    assert first.startswith("# Started from the shipped config 'video_r1/qwen2_5_vl_7b_1node' ")
    assert load_config("my.yaml").model_dump() == load_config("video_r1/qwen2_5_vl_7b_1node").model_dump()


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_config_makes_a_starter_that_loads_the_same(name, tmp_path):
    from streamgrpo.config import find_config

    src = find_config(name).read_text()
    out = tmp_path / f"{name.replace('/', '_')}.yaml"
    out.write_text(starter_text(src, name))
    assert yaml.safe_load(out.read_text()) == yaml.safe_load(src)  # comments only


def test_field_doc_is_the_first_sentence_of_a_key_and_none_for_unknown_keys():
    assert field_doc("rollout.vllm.gpu_memory_utilization") == "Fraction of GPU memory vLLM may take"
    assert field_doc("rollout.no_such_key") is None
    assert field_doc("rewards.functions.weight").startswith("Weight in the total reward")
    assert len(field_doc("learner.bf16")) <= 100


def test_the_repo_no_longer_needs_deploy_deepspeed():
    root = REPO
    for path in (root / "streamgrpo" / "configs").glob("*.yaml"):
        assert "deploy/deepspeed" not in path.read_text(), path
