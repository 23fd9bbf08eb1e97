"""Config: round trip, shipped configs, named errors, --set coercion, seed-era aliases."""

from __future__ import annotations

import pytest
import yaml

from streamgrpo.config import (
    ALIASES,
    Config,
    ConfigError,
    build_config,
    find_config,
    load_config,
    parse_override,
    shipped_configs,
)


def test_defaults_round_trip_through_yaml(tmp_path):
    cfg = build_config({"loss": {"beta": 0.04}, "rollout": {"num_generations": 4}})
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg
    assert again.loss.beta == 0.04 and again.rollout.num_generations == 4


@pytest.mark.parametrize("name", shipped_configs())
def test_every_shipped_config_parses(name, capsys):
    cfg = load_config(name)
    assert isinstance(cfg, Config)
    assert find_config(name).as_posix().endswith(f"/{name}.yaml")
    assert "streamgrpo config:" not in capsys.readouterr().err  # no moved or mapped key: shipped in today's words


def test_shipped_configs_include_demo_and_gpu_run():
    assert {"demo", "qwen2_5_vl_7b_video"} <= set(shipped_configs())


def test_every_yaml_in_the_repo_configs_folder_is_shipped_and_parses():
    from importlib import resources

    folder = resources.files("streamgrpo") / "configs"
    files = [p.name for p in folder.iterdir() if p.name.endswith((".yaml", ".yml"))]
    assert files, "no shipped configs found"
    for f in files:
        load_config(str(folder / f))


def test_unknown_key_names_key_value_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"loss": {"nope": 1}}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "loss.nope" in msg and "1" in msg and str(path) in msg


def test_unknown_override_names_key():
    with pytest.raises(ConfigError, match=r"loss\.nope"):
        load_config("demo", ["loss.nope=1"])


def test_out_of_bound_value_is_named():
    with pytest.raises(ConfigError) as err:
        build_config({"loss": {"epsilon": -0.5}}, source="x.yaml")
    assert "loss.epsilon" in str(err.value) and "-0.5" in str(err.value) and "x.yaml" in str(err.value)
    with pytest.raises(ConfigError, match="rollout.num_generations"):
        build_config({}, ["rollout.num_generations=1"])


def test_dist_backend_is_one_of_three_with_a_one_line_error():
    assert build_config({}).learner.dist_backend == "auto"
    assert build_config({}, ["learner.dist_backend=gloo"]).learner.dist_backend == "gloo"
    with pytest.raises(ConfigError) as err:
        build_config({}, ["learner.dist_backend=mpi"], source="x.yaml")
    msg = str(err.value)
    assert "\n" not in msg and "learner.dist_backend" in msg and "'mpi'" in msg and "'nccl'" in msg, msg


def test_warm_letters_is_uniform_or_marginal():
    assert build_config({}).demo.warm_letters == "uniform"
    assert load_config("demo-motion").demo.warm_pixels == 3136 < load_config("demo-motion").data.min_pixels
    with pytest.raises(ConfigError) as err:
        build_config({}, ["demo.warm_letters=flat"])
    assert "\n" not in str(err.value) and "demo.warm_letters" in str(err.value) and "'marginal'" in str(err.value)


def test_the_demo_knobs_moved_to_the_demo_section_and_old_keys_still_load(tmp_path, capsys):
    from streamgrpo.config.loading import ALL_MOVED as MOVED

    old = {"model": {"tiny_if_missing": True, "warm_pixels": 3136, "warm_letters": "marginal"},
           "data": {"make_demo_if_missing": True, "demo_size": 40, "demo_motion": "reverse"},
           "rollout": {"weight_apply_delay": 2}}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    cfg = load_config(path)
    assert (cfg.demo.tiny_model, cfg.demo.warm_pixels, cfg.demo.warm_letters) == (True, 3136, "marginal")
    assert (cfg.demo.make_data, cfg.demo.size, cfg.demo.motion, cfg.demo.weight_apply_delay) == (True, 40, "reverse", 2)
    notices = capsys.readouterr().err.strip().splitlines()
    demo_moves = [k for k, v in MOVED.items() if v.startswith("demo.")]
    assert len(notices) == len(demo_moves) == 7 and all("moved to 'demo." in n and str(path) in n for n in notices)
    assert build_config({}, ["data.demo_size=12"]).demo.size == 12
    assert "'data.demo_size' moved to 'demo.size'" in capsys.readouterr().err
    for core in ("model", "data", "rollout"):  # the core sections no longer hold them
        assert not {k.split(".")[1] for k in MOVED if k.startswith(core + ".")} & set(getattr(cfg, core).model_fields)


def test_max_staleness_is_the_learners_an_old_loss_key_still_loads_and_sync_implies_zero(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"loss": {"max_staleness": 3, "beta": 0.1}}))
    cfg = load_config(path)
    assert cfg.learner.max_staleness == 3 and cfg.loss.beta == 0.1 and "max_staleness" not in cfg.loss.model_fields
    assert "'loss.max_staleness' moved to 'learner.max_staleness'" in capsys.readouterr().err
    assert build_config({}, ["loss.max_staleness=5"]).learner.max_staleness == 5  # --set too
    assert build_config({}, ["max_staleness=7"]).learner.max_staleness == 7  # the seed-era flat name
    assert build_config({}, ["rollout.sync=true", "learner.max_staleness=5"]).learner.max_staleness == 0


def test_warm_pixels_overrides_only_the_warm_starts_data_section():
    from streamgrpo.recipes.demo.assets import warm_data_config

    plain = build_config({"data": {"min_pixels": 12544, "max_pixels": 12544}})
    assert plain.demo.warm_pixels is None and warm_data_config(plain) is plain.data
    cfg = build_config({"data": {"min_pixels": 12544, "max_pixels": 12544}}, ["demo.warm_pixels=3136"])
    warm = warm_data_config(cfg)
    assert (warm.min_pixels, warm.max_pixels) == (3136, 3136)
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == (12544, 12544)  # training keeps its resolution
    assert warm.kinds == cfg.data.kinds and warm.max_frames == cfg.data.max_frames
    with pytest.raises(ConfigError, match="demo.warm_pixels"):
        build_config({}, ["demo.warm_pixels=10"])


def test_a_mapping_given_to_a_scalar_key_still_names_the_key():
    """A section's own check prints its message alone (it names its keys); a type error whose input is a mapping
    (a key given a nested block by mistake) still names the key it is about."""
    with pytest.raises(ConfigError) as err:
        build_config({"learner": {"save_steps": {"a": 1}}}, source="x.yaml")
    assert "learner.save_steps" in str(err.value) and "valid integer" in str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:
        build_config({"learner": {"compile": True, "backend": "deepspeed", "deepspeed_config": "zero3"}},
                     source="x.yaml")
    assert str(err.value).startswith("x.yaml: learner.compile with DeepSpeed ZeRO-3"), str(err.value)


def test_compile_refuses_lora_dropout_in_recomputed_layers_in_one_line():
    """On an H100 (torch 2.11, 2026-11-27) inductor failed to partition a compiled 7B LoRA layer whose dropout is
    recomputed; with dropout 0 it compiled and ran at 42% MFU. The config says so before anything loads."""
    sets = ["learner.compile=true", "learner.gradient_checkpointing=true", "model.lora={r: 8, alpha: 16}"]
    with pytest.raises(ConfigError) as err:
        build_config({}, sets)
    msg = str(err.value)
    assert "\n" not in msg and "model.lora.dropout 0.05" in msg and "set model.lora.dropout to 0" in msg, msg
    assert build_config({}, [*sets, "model.lora.dropout=0"]).learner.compile
    assert build_config({}, [*sets, "learner.gradient_checkpointing=false"]).model.lora.dropout == 0.05
    assert build_config({}, ["model.lora={r: 8, alpha: 16}"]).model.lora.dropout == 0.05  # eager keeps its dropout
    # a CPU learner's inductor and aot_eager (no generated code) compiled it: not refused
    assert build_config({}, [*sets, "learner.device=cpu"]).model.lora.dropout == 0.05
    assert build_config({}, [*sets, "learner.compile_backend=aot_eager"]).model.lora.dropout == 0.05


def test_shared_prompt_refuses_flash_attention_in_one_line():
    assert build_config({}).learner.shared_prompt is False
    with pytest.raises(ConfigError) as err:
        build_config({"model": {"attn_implementation": "flash_attention_2"}, "learner": {"shared_prompt": True}})
    assert "\n" not in str(err.value) and "learner.shared_prompt" in str(err.value) and "sdpa" in str(err.value)
    assert build_config({}, ["learner.shared_prompt=true"]).learner.shared_prompt


def test_a_relays_metrics_port_is_never_a_generators():
    """The relay serves its own port (default 0: a free one), never metrics.port + a local index."""
    assert build_config({}).weights.relay_metrics_port == 0
    with pytest.raises(ConfigError) as err:
        build_config({}, ["metrics.port=9100", "rollout.num_generators=4", "weights.relay_metrics_port=9103"])
    assert "\n" not in str(err.value) and "weights.relay_metrics_port 9103 is a generator's metrics port" in str(err.value)
    assert build_config({}, ["metrics.port=9100", "rollout.num_generators=4",
                             "weights.relay_metrics_port=9200"]).weights.relay_metrics_port == 9200


@pytest.mark.parametrize("knob", ["checkpoint_every=2", "checkpoint_offload=true", "checkpoint_matmuls=true"])
def test_checkpointing_knobs_need_gradient_checkpointing(knob):
    with pytest.raises(ConfigError) as err:
        build_config({}, [f"learner.{knob}"])
    assert "\n" not in str(err.value) and f"learner.{knob.split('=')[0]}" in str(err.value)
    assert "learner.gradient_checkpointing" in str(err.value)
    cfg = build_config({}, ["learner.gradient_checkpointing=true", f"learner.{knob}"])
    lc = cfg.learner
    assert (lc.checkpoint_every, lc.checkpoint_offload, lc.checkpoint_matmuls) != (1, False, False)


def test_cross_field_bounds():
    with pytest.raises(ConfigError, match="min_frames"):
        build_config({"data": {"min_frames": 10, "max_frames": 4}})


def test_zero_variance_weight_and_drop_zero_variance_exclude_each_other():
    with pytest.raises(ConfigError, match="drop_zero_variance drops the groups loss.zero_variance_weight"):
        build_config({"loss": {"zero_variance_weight": 0.5, "drop_zero_variance": True}})
    assert build_config({"loss": {"zero_variance_weight": 0.5}}).loss.zero_variance_weight == 0.5


def test_set_coerces_types():
    cfg = build_config({}, ["loss.beta=0.04", "learner.bf16=true", "rollout.stop=[a, b]", "queue.url=null",
                            "model.name_or_path=/tmp/m", "rollout.num_generations=16"])
    assert cfg.loss.beta == pytest.approx(0.04)
    assert cfg.learner.bf16 is True
    assert cfg.rollout.stop == ["a", "b"]
    assert cfg.queue.url is None
    assert cfg.model.name_or_path == "/tmp/m"
    assert cfg.rollout.num_generations == 16 and isinstance(cfg.rollout.num_generations, int)


def test_set_wrong_type_is_named():
    with pytest.raises(ConfigError, match="rollout.num_generations"):
        build_config({}, ["rollout.num_generations=many"])


def test_parse_override_requires_equals():
    with pytest.raises(ConfigError):
        parse_override("loss.beta")
    assert parse_override("a.b=1") == ("a.b", 1)


def test_seed_era_aliases_are_mapped_with_notice(capsys):
    cfg = build_config({
        "grpo_beta": 0.04, "grpo_sample_size": 4, "generation_temperature": 0.7, "generation_top_p": 0.9,
        "tune_mm_vision": True, "epsilon_high": 0.3, "format_reward_weight": 0.2, "accuracy_reward_weight": 0.8,
        "learning_rate": 2e-5, "per_device_train_batch_size": 8,
    })
    assert cfg.loss.beta == 0.04 and cfg.rollout.num_generations == 4
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.top_p == 0.9
    assert cfg.model.tune_mm_vision is True and cfg.loss.epsilon_high == 0.3
    weights = {s.name: s.weight for s in cfg.rewards.functions}
    assert weights == {"format": 0.2, "accuracy": 0.8}
    assert cfg.learner.learning_rate == 2e-5
    assert cfg.learner.groups_per_step == 2  # 8 completions / G=4
    err = capsys.readouterr().err
    assert "grpo_beta" in err and "loss.beta" in err


def test_seed_alias_in_set_and_lora_alias():
    cfg = build_config({}, ["grpo_beta=0.1", "lora_r=8"])
    assert cfg.loss.beta == 0.1
    assert cfg.model.lora is not None and cfg.model.lora.r == 8


def test_every_alias_target_exists():
    for alias, target in ALIASES.items():
        node = Config()
        parts = target.split(".")
        for p in parts[:-1]:
            node = getattr(node, p) if getattr(node, p) is not None else None
            if node is None:
                break
        else:
            assert parts[-1] in type(node).model_fields, f"{alias} -> {target}"


def test_rewards_section_accepts_a_plain_list():
    cfg = build_config({"rewards": [{"name": "numeric", "weight": 1.0, "params": {"scale": 20}}]})
    assert cfg.rewards.functions[0].name == "numeric" and cfg.rewards.functions[0].params == {"scale": 20}


def test_env_vars_expand_in_strings(tmp_path, monkeypatch):
    monkeypatch.setenv("SG_TEST_PW", "s3cret")
    path = tmp_path / "c.yaml"
    path.write_text("queue:\n  url: redis://:${SG_TEST_PW}@localhost:6379/0\n")
    assert load_config(path).queue.url == "redis://:s3cret@localhost:6379/0"


def test_missing_config_file_is_clear():
    with pytest.raises(ConfigError, match="not found|neither"):
        load_config("/nonexistent/x.yaml")


def test_every_field_is_documented():
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            ann = field.annotation
            sub = getattr(ann, "model_fields", None)
            if sub is not None and prefix == "":
                walk(ann, f"{name}.")
                continue
            assert field.description, f"{prefix}{name} has no docstring"

    walk(Config)


def test_advice_flags_a_run_whose_uncommitted_groups_need_many_gib_of_redis():
    """Trained groups stay in Redis until the checkpoint that commits them: the bytes that holds are
    estimated, and flagged above 8 GiB (the 7B video config with inline frames: ~31 GiB)."""
    assert load_config("demo").advice() == []
    assert load_config("qwen2_5_vl_7b_video").advice() == []  # by reference (the default): ~0.4 GiB
    (line,) = load_config("qwen2_5_vl_7b_video", ["rollout.media=inline"]).advice()
    # DeepSpeed ranks with asynchronous checkpoints (the default): (2 x 50 + 2) x 64 + 256 groups
    assert "6784 groups" in line and "GiB" in line and "rollout.media: reference" in line
    # the demo trains on the torch backend with asynchronous checkpoints: a window held twice as long
    (line,) = load_config("demo", ["learner.save_steps=200000", "learner.groups_per_step=8"]).advice()
    assert "3200024 groups" in line and "2 x save_steps (async_checkpoint)" in line
    (line,) = load_config("demo", ["learner.save_steps=200000", "learner.groups_per_step=8",
                                   "learner.async_checkpoint=false"]).advice()
    assert "1600024 groups" in line and "save_steps" in line


def test_weights_wait_bounds_default_and_switch_off():
    cfg = load_config("demo")
    assert cfg.weights.warn_every_s == 30.0 and cfg.weights.max_wait_s == 600.0
    assert load_config("demo", ["weights.max_wait_s=0"]).weights.max_wait_s == 0.0  # 0: wait forever
    assert load_config("demo", ["weights.max_wait_s=null"]).weights.max_wait_s is None  # so does null
    with pytest.raises(ConfigError, match=r"weights\.max_wait_s"):
        load_config("demo", ["weights.max_wait_s=-1"])
    with pytest.raises(ConfigError, match=r"weights\.warn_every_s"):
        load_config("demo", ["weights.warn_every_s=0"])


# ------------------------------------------------------------------------------ NaN / inf (issue 18)
def _float_fields(model_cls, prefix: str = "", seen=None):
    """(dotted path, model class, field name) of every float or Optional[float] field, recursively."""
    import typing

    seen = set() if seen is None else seen
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)] or [ann]
        for a in args:
            inner = [x for x in typing.get_args(a)] or [a]  # list[RewardSpec] -> RewardSpec
            for t in inner:
                if t is float:
                    yield f"{prefix}{name}", model_cls, name
                elif isinstance(t, type) and hasattr(t, "model_fields") and t not in seen:
                    seen.add(t)
                    yield from _float_fields(t, f"{prefix}{name}.", seen)


def test_every_float_field_rejects_nan_and_inf():
    from pydantic import ValidationError

    fields = list(_float_fields(Config))
    assert len(fields) >= 20 and "learner.learning_rate" in {p for p, _, _ in fields}
    required = {"name": "format"}  # RewardSpec.name
    for path, cls, name in fields:
        for bad in (float("nan"), float("inf"), float("-inf"), "nan"):
            extra = {k: v for k, v in required.items() if k in cls.model_fields and k != name}
            with pytest.raises(ValidationError) as err:
                cls.model_validate({**extra, name: bad})
            assert err.value.errors()[0]["type"] == "finite_number", (path, bad, err.value.errors())


@pytest.mark.parametrize("override, message", [
    ("learner.learning_rate=nan", "learner.learning_rate: must be a finite number, got nan"),
    ("loss.beta=.inf", "loss.beta: must be a finite number, got inf"),
    ("rollout.temperature=-.inf", "rollout.temperature: must be a finite number, got -inf"),
    ("queue.max_outage_s=NaN", "queue.max_outage_s: must be a finite number, got NaN"),
    ("loss.tis_cap=inf", "loss.tis_cap: must be a finite number, got inf"),
    ("weights.chunk_mib=.nan", "weights.chunk_mib: must be a finite number, got nan"),
])
def test_nan_and_inf_overrides_say_finite_number(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("demo", [override])
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and lines[0].endswith(message), lines
    assert "less than" not in lines[0] and "greater than" not in lines[0]


def test_nan_in_a_file_and_in_a_list_item(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rewards:\n  functions:\n    - {name: format, weight: .nan}\nlearner:\n  max_grad_norm: .inf\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "rewards.functions.0.weight: must be a finite number, got nan" in msg and str(path) in msg
    assert "learner.max_grad_norm: must be a finite number, got inf" in msg


# ------------------------------------------------------------------------------ secrets, metrics host
def test_redacted_config_masks_passwords_but_shows_they_are_set():
    from streamgrpo.transport.queue.resp import safe_url

    cfg = build_config({"queue": {"url": "redis://gen:pa55-w0rd@redis:6379/0"},
                        "rewards": [{"name": "judge:score", "params": {"api_key": "sk-123", "model": "m", "max_tokens": 5,
                                                                         "endpoint": "https://u:tok3n@judge/v1"}}]})
    text = cfg.to_yaml(redact=True)
    for secret in ("pa55-w0rd", "sk-123", "tok3n"):
        assert secret not in text
    tree = yaml.safe_load(text)
    assert tree["queue"]["url"] == "redis://gen:***@redis:6379/0"
    assert tree["rewards"]["functions"][0]["params"] == {"api_key": "***", "model": "m", "max_tokens": 5,
                                                          "endpoint": "https://u:***@judge/v1"}
    assert cfg.queue.url == "redis://gen:pa55-w0rd@redis:6379/0" and "pa55-w0rd" in cfg.to_yaml()  # only the view
    assert safe_url("redis://:pw@h:1/0", mask="***") == "redis://:***@h:1/0"
    assert safe_url("unix:///s.sock?password=pw", mask="***") == "unix:///s.sock?password=***"
    assert safe_url("redis://h:1/0", mask="***") == "redis://h:1/0"


def test_metrics_listen_on_loopback_by_default():
    from streamgrpo.metrics import serve

    assert Config().metrics.host == "127.0.0.1"
    server = serve(port=0)
    try:
        assert server._httpd.server_address[0] == "127.0.0.1"
    finally:
        server.close()


def test_config_show_masks_an_ssl_password_in_the_queue_url():
    cfg = build_config({"queue": {"url": "rediss://h:6380/0?ssl_ca_certs=/ca.pem&ssl_password=hunter2"}})
    shown = cfg.to_yaml(redact=True)
    assert "hunter2" not in shown and "ssl_password=***" in shown and "ssl_ca_certs=/ca.pem" in shown


def test_a_local_file_named_like_a_shipped_deepspeed_config_is_read_at_learner_start(tmp_path, monkeypatch):
    """``resolve()`` prefers a file of that name in the working directory over the shipped one, so the config
    check must not judge compile by the shipped file's stage (a stage-2 ``./zero3.json`` is not ZeRO-3)."""
    from streamgrpo.config.deepspeed_files import shipped_zero_stage

    assert (shipped_zero_stage(None), shipped_zero_stage("zero2"), shipped_zero_stage("zero3")) == (2, 2, 3)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zero3.json").write_text('{"zero_optimization": {"stage": 2}}')
    assert shipped_zero_stage("zero3.json") is None  # its stage is read when the learner starts
    assert build_config({}, ["learner.backend=deepspeed", "learner.deepspeed_config=zero3.json",
                             "learner.compile=true"]).learner.compile
