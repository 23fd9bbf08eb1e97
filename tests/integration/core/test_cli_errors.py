"""User mistakes through the real CLI (`python -m streamgrpo ...`, issue 18): one line on stderr,
`streamgrpo <command>: <message>`, no traceback, exit 2 for usage/config mistakes and 1 for a
Redis that refuses us. Real redis-servers (a password, a TLS port); learners and generators must
end within seconds, before they load a model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO


def cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "STREAMGRPO_REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "streamgrpo", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_line(res: subprocess.CompletedProcess, code: int, prefix: str) -> str:
    """The single stderr line of a command that ended with ``code``; it starts with ``prefix``."""
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == code, (res.returncode, res.stderr)
    assert len(lines) == 1 and lines[0].startswith(prefix), res.stderr
    return lines[0]


@pytest.fixture
def records(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"  # only has to exist: the commands fail before reading it
    path.write_text('{"id": "r", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}\n')
    return path


def role_args(role: str, tmp_path: Path, records: Path, *sets: str) -> list[str]:
    args = [role, "--config", "demo", "--run-dir", str(tmp_path / "run"), "--set", f"data.train_path={records}"]
    for s in sets:
        args += ["--set", s]
    return args + (["--id", "0"] if role == "generator" else [])


@pytest.mark.parametrize("role", ["learner", "generator"])
def test_wrong_redis_password_ends_learner_and_generator_in_one_line(role, tmp_path, records, redis_factory):
    srv = redis_factory("system", password="right-pw")
    res = cli(*role_args(role, tmp_path, records, f"queue.url=redis://:wrong-pw@127.0.0.1:{srv.port}/0"), cwd=tmp_path)
    line = one_line(res, 1, f"streamgrpo {role}: authentication failed for redis://127.0.0.1:{srv.port}/0")
    assert "queue.url" in line
    assert "wrong-pw" not in res.stderr + res.stdout
    assert not (tmp_path / "runs").exists()  # no model was built (demo: tiny_if_missing) before the check


def test_rediss_without_ca_ends_generator_in_one_line(tmp_path, records, tls_redis):
    url = f"rediss://127.0.0.1:{tls_redis.tls_port}/0"
    res = cli(*role_args("generator", tmp_path, records, f"queue.url={url}"), cwd=tmp_path)
    line = one_line(res, 1, f"streamgrpo generator: TLS handshake with redis at {url} failed")
    assert "certificate verify failed" in line and "ssl_ca_certs=" in line


def test_plain_url_on_tls_port_ends_learner_in_one_line(tmp_path, records, tls_redis):
    res = cli(*role_args("learner", tmp_path, records, f"queue.url=redis://127.0.0.1:{tls_redis.tls_port}/0"),
              cwd=tmp_path)
    assert "rediss://" in one_line(res, 1, "streamgrpo learner: redis at redis://127.0.0.1:")


def test_no_redis_configured_is_a_usage_error(tmp_path, records):
    res = cli(*role_args("learner", tmp_path, records), cwd=tmp_path)
    line = one_line(res, 2, "streamgrpo learner: no Redis configured")
    assert "queue.url" in line


def test_missing_data_file_is_a_usage_error_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    res = cli(*role_args("generator", tmp_path, missing, "demo.make_data=false"), cwd=tmp_path)
    one_line(res, 2, f"streamgrpo generator: data file not found: {missing}")
    assert not missing.parent.exists()


def test_nan_learning_rate_is_one_line_exit_2(tmp_path):
    res = cli("config", "show", "--set", "learner.learning_rate=nan", cwd=tmp_path)
    line = one_line(res, 2, "streamgrpo config show: ")
    assert line.endswith("learner.learning_rate: must be a finite number, got nan"), line
    assert res.stdout == ""


def test_config_show_masks_the_redis_password(tmp_path):
    res = cli("config", "show", "--set", "queue.url=redis://gen:Sup3r-s3cret@redis:6379/0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Sup3r-s3cret" not in res.stdout + res.stderr
    assert "url: redis://gen:***@redis:6379/0" in res.stdout


def _config_only_model(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model's processor with Qwen2.5-VL-72B's layer sizes in config.json and no weights: the learner
    must refuse it from the config alone (its weights and AdamW need over a terabyte)."""
    import json
    import shutil

    out.mkdir()
    for f in Path(tiny_model_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"].update(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                              num_key_value_heads=8, vocab_size=152064)
    cfg["text_config"].pop("layer_types", None)  # one per layer: rebuilt from num_hidden_layers
    cfg["vision_config"]["out_hidden_size"] = 8192
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_learner_refuses_a_model_that_cannot_fit_before_loading_it(tmp_path, records, redis_factory, tiny_model_dir):
    srv = redis_factory("system")
    model = _config_only_model(tiny_model_dir, tmp_path / "qwen-72b-sizes")
    res = cli(*role_args("learner", tmp_path, records, f"queue.url=redis://127.0.0.1:{srv.port}/0",
                         f"model.name_or_path={model}", "demo.tiny_model=false"), cwd=tmp_path)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 2, res.stderr[-3000:]
    line = res.stderr.strip().splitlines()[-1]  # earlier lines are the learner's own log
    assert line.startswith("streamgrpo learner: not enough memory for the learner: "), line
    assert "+ step: " in line and "72.71B parameters" in line and "model.lora" in line  # static parts and the step's


def test_config_memory_reports_the_plan_and_exits_1_when_it_cannot_fit(tmp_path, tiny_model_dir):
    ok = cli("config", "memory", "--config", "demo", "--set", f"model.name_or_path={tiny_model_dir}", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "then what a step adds:" in ok.stdout and "  + step:      " in ok.stdout and "fits (" in ok.stdout
    big = _config_only_model(tiny_model_dir, tmp_path / "qwen-72b-sizes")
    res = cli("config", "memory", "--config", "qwen2_5_vl_7b_video", "--set", f"model.name_or_path={big}",
              "--ranks", "8", "--gpu-gib", "80", cwd=REPO)  # its deepspeed_config is relative to the repo
    assert res.returncode == 1, res.stderr[-2000:]
    assert "deepspeed ZeRO-3, bf16, 8 rank(s)" in res.stdout and "on a GPU of 80 GiB: does not fit" in res.stdout
    gib = float(res.stdout.split("GiB = ")[1].split()[0])  # ZeRO-3 over 8 ranks: 16 + 2 bytes / 8 + ...
    assert 150 < gib < 200


def test_unreadable_deepspeed_config_is_one_line(tmp_path, tiny_model_dir):
    res = cli("config", "memory", "--config", "demo", "--set", f"model.name_or_path={tiny_model_dir}",
              "--set", "learner.backend=deepspeed", "--set", "learner.deepspeed_config=missing.json", cwd=tmp_path)
    line = one_line(res, 2, "streamgrpo config memory: learner.deepspeed_config='missing.json': cannot read it as JSON")
    assert "No such file" in line
