"""Each role sees its sections (streamgrpo/config/roles.py): the generator's, the evaluator's and the relay's loops
run on views of the config, and their folders read no other section."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

import streamgrpo
from streamgrpo.config import build_config, load_config
from streamgrpo.config.roles import EvaluatorConfig, GeneratorConfig, RelayConfig, final_version
from streamgrpo.relay.keeper import RelayKeeper

PACKAGE = Path(streamgrpo.__file__).parent
VIEWS = {"generator": GeneratorConfig, "evaluator": EvaluatorConfig, "relay": RelayConfig}


def test_a_view_shares_its_sections_takes_what_it_needs_of_the_learner_and_has_no_other():
    cfg = build_config({}, ["learner.shared_prompt=true", "learner.groups_per_step=6", "learner.max_steps=250",
                            "weights.sync_every=3"])
    gen = GeneratorConfig.of(cfg)
    assert gen.rollout is cfg.rollout and gen.model is cfg.model and gen.run_dir == cfg.run_dir
    assert (gen.custom_mask, gen.sync_groups_per_step) == (True, 6)
    assert GeneratorConfig.of(gen) is gen
    ev = EvaluatorConfig.of(cfg)
    assert (ev.custom_mask, ev.final_version, final_version(cfg)) == (True, 249, 249)
    for view in (gen, ev, RelayConfig.of(cfg)):
        with pytest.raises(AttributeError, match="learner"):
            _ = view.learner
    with pytest.raises(AttributeError, match="queue"):
        _ = RelayConfig.of(cfg).queue
    assert RelayConfig.of(gen).weights is cfg.weights  # a view of a view: the generator starts its host's relay


def _cfg_reads(path: Path) -> set[str]:
    """Attributes read of a name ``cfg`` in a module (``cfg.rollout`` -> rollout)."""
    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg"}


@pytest.mark.parametrize("role", sorted(VIEWS))
def test_a_role_folder_reads_only_its_views_fields(role):
    view = VIEWS[role]
    allowed = set(view.model_fields) | {"model_copy", "model_dump"}
    reads = {p.name: _cfg_reads(p) - allowed for p in sorted((PACKAGE / role).glob("*.py"))}
    assert any(_cfg_reads(p) for p in (PACKAGE / role).glob("*.py"))  # the scan sees the loop's reads
    assert {name: sorted(r) for name, r in reads.items() if r} == {}


def test_the_relay_a_generator_starts_gets_the_relays_sections_only_and_no_queue_url(tmp_path, monkeypatch):
    cfg = build_config({"run_dir": str(tmp_path / "run")},
                       ["queue.url=redis://:secret@redis:6379/0", f"weights.shm_dir={tmp_path / 'shm'}",
                        "weights.relay=true", "weights.relay_metrics_port=9500"])
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda argv, **kw: started.append(argv))
    RelayKeeper(GeneratorConfig.of(cfg), cfg.run_dir, "generator-0").start()
    conf = Path(started[0][started[0].index("--config") + 1])
    text = conf.read_text()
    assert "secret" not in text and set(yaml.safe_load(text)) == {"run_dir", "seed", "weights", "metrics"}
    relay_cfg = load_config(conf)  # a config file the relay loads as a whole config: the rest defaults
    assert relay_cfg.weights == cfg.weights and relay_cfg.queue.url is None
