"""CLI: lazy imports, every command has --help, not-built commands exit 2, config errors name the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamgrpo.cli import build_parser, main

COMMANDS = [
    ["up"], ["learner"], ["generator"], ["infer"], ["eval"], ["report"], ["data", "check"], ["data", "demo"],
    ["model", "tiny"], ["model", "merge"], ["model", "export"], ["model", "push"], ["config", "show"], ["config", "init"], ["keys"],
]


def test_importing_cli_leaves_torch_out():
    code = "import sys, streamgrpo.cli, streamgrpo.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_every_command_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--help"])
    assert exc.value.code == 0
    assert "usage: streamgrpo" in capsys.readouterr().out


def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom streamgrpo.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_config_error_names_key_and_exits_2(capsys):
    rc = main(["learner", "--config", "demo", "--set", "loss.nope=1"])
    assert rc == 2
    assert "loss.nope" in capsys.readouterr().err


def test_config_show_prints_resolved_yaml(capsys):
    assert main(["config", "show", "--config", "demo", "--set", "loss.beta=0.5"]) == 0
    import yaml

    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["loss"]["beta"] == 0.5 and tree["model"]["tune_mm_vision"] is True


def test_parser_knows_design_flags():
    p = build_parser()
    args = p.parse_args(["up", "--generators", "3", "--sync", "--run-dir", "r"])
    assert args.generators == 3 and args.sync and args.run_dir == "r"
    args = p.parse_args(["generator", "--config", "demo", "--id", "2"])
    assert args.id == 2
    args = p.parse_args(["model", "tiny", "--out", "x", "--arch", "qwen3_vl"])
    assert args.arch == "qwen3_vl"


def test_up_sync_is_rollout_sync_loaded_with_the_config_whose_check_implies_staleness_zero(monkeypatch):
    from streamgrpo.commands import up

    seen = []
    monkeypatch.setattr(up, "run_up", lambda cfg, **kw: seen.append(cfg) or 0)  # the command's wiring only
    assert up.main(build_parser().parse_args(["up", "--sync", "--set", "learner.max_staleness=4"])) == 0
    assert seen[0].rollout.sync is True and seen[0].learner.max_staleness == 0
    up.main(build_parser().parse_args(["up", "--set", "learner.max_staleness=4"]))
    assert seen[1].rollout.sync is False and seen[1].learner.max_staleness == 4


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "streamgrpo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "learner" in out.stdout


def test_config_mistakes_are_one_line_named_by_command_exit_2(capsys):
    assert main(["config", "show", "--set", "learner.learning_rate=nan"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("streamgrpo config show: ") and captured.out == ""
    assert line.endswith("learner.learning_rate: must be a finite number, got nan")


def test_generator_id_outside_num_generators_is_a_usage_error(capsys):
    assert main(["generator", "--config", "demo", "--set", "rollout.num_generators=2", "--id", "2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "streamgrpo generator: --id 2 is outside 0..1 (rollout.num_generators)"


def test_config_show_masks_secrets(capsys):
    rc = main(["config", "show", "--set", "queue.url=rediss://:hunter2@redis:6380/0?ssl_ca_certs=/ca.pem",
               "--set", "rewards.functions=[{name: 'judge:score', params: {token: abc-secret}}]"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "abc-secret" not in out
    assert "url: rediss://:***@redis:6380/0?ssl_ca_certs=/ca.pem" in out and "token: '***'" in out


def test_check_before_loading_leaves_a_down_redis_to_the_queue(tmp_path, caplog):
    """Nothing listens: not a mistake (Redis may start later), so the check returns at once, silently,
    and the process goes on to load its model; its queue waits for Redis."""
    from streamgrpo.commands.checks import check_before_loading
    from streamgrpo.config import load_config
    from streamgrpo.transport.queue.server import free_port

    cfg = load_config("demo", [f"queue.url=redis://127.0.0.1:{free_port()}/0", f"run_dir={tmp_path}"])
    assert check_before_loading(cfg, "learner") is None
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]


def test_eval_shuffle_frames_flags(capsys):
    p = build_parser()
    args = p.parse_args(["eval", "--model", "m", "--data", "d.jsonl"])
    assert args.shuffle_frames is False and args.shuffle_seed is None  # off by default; seed 0 when on
    args = p.parse_args(["eval", "--model", "m", "--data", "d.jsonl", "--shuffle-frames", "--shuffle-seed", "5"])
    assert args.shuffle_frames is True and args.shuffle_seed == 5
    # mistakes end with exit 2 before any model or data is loaded
    assert main(["eval", "--model", "no/such/model", "--data", "none.jsonl", "--shuffle-seed", "3"]) == 2
    assert "--shuffle-seed needs --shuffle-frames" in capsys.readouterr().err
    assert main(["eval", "--model", "no/such/model", "--data", "none.jsonl", "--shuffle-frames",
                 "--shuffle-seed", "-1"]) == 2
    assert "--shuffle-seed must be >= 0" in capsys.readouterr().err


def test_an_unusable_shared_memory_directory_is_a_usage_error():
    from streamgrpo.cli import USAGE_EXIT, _user_error
    from streamgrpo.transport.weights.shm import ShmUnavailable

    assert _user_error(ShmUnavailable("weights.shm_dir '/nowhere' is not a directory")) == USAGE_EXIT
    assert _user_error(RuntimeError("a bug")) is None  # anything else keeps its traceback


def test_config_help_lists_every_shipped_config(capsys):
    from streamgrpo.config import shipped_configs

    with pytest.raises(SystemExit):
        main(["config", "show", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps the help text (at a name's hyphen too)
    assert set(shipped_configs()) >= {"demo", "qwen2_5_vl_7b_1node", "qwen3_vl_8b_1node"}
    assert f"({','.join(shipped_configs())})" in text


@pytest.fixture(scope="module")
def qwen_7b_config(tmp_path_factory):
    """config.json of Qwen2.5-VL-7B at its published layer sizes (no weights)."""
    from streamgrpo.models.tiny import write_config

    return write_config(tmp_path_factory.mktemp("qwen-7b-sizes"), "qwen2_5_vl", "7b")


def test_config_memory_takes_the_ranks_from_the_config_unless_told(qwen_7b_config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the config's deepspeed_config is a shipped name: any directory works
    args = ["config", "memory", "--config", "qwen2_5_vl_7b_1node", "--set", f"model.name_or_path={qwen_7b_config}",
            "--gpu-gib", "80"]
    assert main(args) == 0  # launch.learner_ranks: 4
    out = capsys.readouterr().out
    assert "deepspeed ZeRO-3, bf16, 4 rank(s)" in out and "on a GPU of 80 GiB: fits" in out
    assert main([*args, "--ranks", "1"]) == 1  # one rank holds it all
    assert "1 rank(s)" in capsys.readouterr().out
    assert main([*args, "--ranks", "0"]) == 2
    assert capsys.readouterr().err.strip() == "streamgrpo config memory: --ranks 0: at least one learner rank"


def test_config_memory_plans_several_ranks_on_deepspeed_as_up_runs_them(tiny_model_dir, capsys):
    assert main(["config", "memory", "--config", "demo", "--set", f"model.name_or_path={tiny_model_dir}",
                 "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 learner ranks: planned with learner.backend=deepspeed")
    assert "deepspeed ZeRO-2" in out and "2 rank(s)" in out


def test_config_memory_offline_with_a_hub_name_not_cached_is_one_line(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["config", "memory", "--config", "qwen2_5_vl_7b_1node"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("streamgrpo config memory: no model config for "
                           "model.name_or_path='Qwen/Qwen2.5-VL-7B-Instruct': HF_HUB_OFFLINE is set")
    assert "`streamgrpo model tiny --size 7b --config-only --out DIR`" in line and captured.out == ""


def test_a_generators_fixed_metrics_port_is_offset_by_its_local_index():
    """metrics.port P: --local-index g serves P + g (default 0); 0 stays a free port."""

    from streamgrpo.cli import build_parser
    from streamgrpo.commands.generator import set_port
    from streamgrpo.config import ConfigError, load_config

    assert build_parser().parse_args(["generator", "--id", "1"]).local_index == 0
    ports = []
    for port, local in ((9100, 3), (9100, 0), (0, 5)):
        cfg = load_config("demo", [f"metrics.port={port}"])
        set_port(cfg, local)
        ports.append(cfg.metrics.port)
    assert ports == [9103, 9100, 0]
    with pytest.raises(ConfigError, match="past 65535"):
        set_port(load_config("demo", ["metrics.port=65535"]), 1)


def test_every_user_error_names_an_exception_class_of_its_module():
    """cli.USER_ERRORS names classes by string: a renamed class would silently become a traceback."""
    import importlib

    from streamgrpo.cli import USER_ERRORS, _user_error

    for module, names, code in USER_ERRORS:
        mod = importlib.import_module(module)
        for name in names:
            cls = getattr(mod, name)
            assert isinstance(cls, type) and issubclass(cls, BaseException), (module, name)
            assert _user_error(cls.__new__(cls)) == code, (module, name)
    assert _user_error(RuntimeError("not a user's mistake")) is None
