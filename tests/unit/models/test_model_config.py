"""The policy's config.json for the plans made before a model loads (issue 49): a local directory, the
Hugging Face cache (a real cache layout in a temporary folder), or one request to the Hub (a real HTTP
server on loopback that answers 503: retried by the Hub client alone, asked once here). Every way to
have none is one line naming the file and the ``streamgrpo model tiny --config-only`` command."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub.constants
import pytest

from streamgrpo.config import ConfigError
from streamgrpo.models.model_config import (
    ModelConfigUnavailable,
    config_json,
    load_model_config,
    tiny_command,
    unavailable_message,
)
from streamgrpo.models.tiny import write_config

QWEN_3B = "Qwen/Qwen2.5-VL-3B-Instruct"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_the_stand_in_command_has_the_models_published_size():
    assert tiny_command(QWEN_3B) == "streamgrpo model tiny --size 3b --config-only --out DIR"
    assert tiny_command("Qwen/Qwen2.5-VL-7B-Instruct") == "streamgrpo model tiny --size 7b --config-only --out DIR"
    assert tiny_command("Qwen/Qwen3-VL-8B-Instruct") == \
        "streamgrpo model tiny --arch qwen3_vl --size 8b --config-only --out DIR"
    assert tiny_command("someone/other-model") == "streamgrpo model tiny --size 3b|7b|8b --config-only --out DIR"
    line = unavailable_message(QWEN_3B, "offline")
    assert "\n" not in line and "config.json" in line and "model.name_or_path='Qwen/Qwen2.5-VL-3B-Instruct'" in line


def test_a_local_directory_gives_its_config_and_one_without_it_is_one_line(tmp_path, empty_cache):
    write_config(tmp_path / "m", "qwen2_5_vl", "3b")
    assert config_json(str(tmp_path / "m")) == tmp_path / "m" / "config.json"
    assert load_model_config(str(tmp_path / "m")).model_type == "qwen2_5_vl"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigUnavailable, match="no config.json in that directory"):
        config_json(str(tmp_path / "empty"))
    with pytest.raises(ModelConfigUnavailable, match="no such directory"):
        config_json(str(tmp_path / "missing"))


def test_offline_with_a_hub_name_not_in_the_cache_names_the_file_it_needs(empty_cache):
    with pytest.raises(ModelConfigUnavailable) as exc:
        load_model_config(QWEN_3B)
    line = str(exc.value)
    assert isinstance(exc.value, ConfigError) and "\n" not in line  # a config mistake: one line, exit 2
    assert "HF_HUB_OFFLINE is set and the Hugging Face cache does not hold its config.json" in line
    assert "`streamgrpo model tiny --size 3b --config-only --out DIR`" in line


def test_offline_a_hub_name_in_the_cache_is_read_from_it(empty_cache):
    commit = "a" * 40
    repo = empty_cache / "models--Qwen--Qwen2.5-VL-3B-Instruct"
    write_config(repo / "snapshots" / commit, "qwen2_5_vl", "3b")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert config_json(QWEN_3B) == repo / "snapshots" / commit / "config.json"
    assert load_model_config(QWEN_3B).model_type == "qwen2_5_vl"


def test_online_the_hub_is_asked_once_and_its_failure_is_one_line(empty_cache, monkeypatch, caplog):
    asked = []

    class Unavailable(BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - http.server's name
            asked.append(self.path)
            self.send_response(503)  # a status the Hub client retries five times by itself
            self.end_headers()

        do_GET = do_HEAD  # noqa: N815

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        endpoint = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        with pytest.raises(ModelConfigUnavailable, match="the Hub did not give its config.json") as exc:
            config_json(QWEN_3B)
    finally:
        server.shutdown()
        server.server_close()
    asked = [p for p in asked if "agent-harnesses" not in p]  # the Hub client's own best-effort lookup
    assert asked == ["/Qwen/Qwen2.5-VL-3B-Instruct/resolve/main/config.json"]  # once, not retried
    assert "\n" not in str(exc.value) and "streamgrpo model tiny --size 3b --config-only" in str(exc.value)
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]
