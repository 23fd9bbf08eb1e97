"""Where `streamgrpo up` puts learner ranks and generators (pure planning) and how it starts them."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamgrpo.commands.placement import (
    PlacementError,
    format_gpus,
    generator_gib,
    parse_gpus,
    plan_placement,
)
from streamgrpo.config import build_config, load_config
from tests.paths import REPO


def test_gpus_specs_parse_and_print_back():
    assert parse_gpus("0-7") == tuple(range(8))
    assert parse_gpus("0,1,4-5") == (0, 1, 4, 5)
    assert parse_gpus("cpu") == () and parse_gpus("") == () and parse_gpus(None) is None
    assert format_gpus((0, 1, 2, 5)) == "0-2,5" and format_gpus(()) == "cpu"
    for bad, why in (("a-b", "expected device numbers"), ("3-1", "runs backwards"), ("0,0", "listed twice")):
        with pytest.raises(PlacementError, match=why) as err:
            parse_gpus(bad)
        assert "\n" not in str(err.value)


def test_cpu_puts_everything_on_the_cpu_whatever_the_counts():
    plan = plan_placement(devices=(), learner_ranks=2, generators=3)
    assert plan.learner.devices == () and plan.learner.ranks == 2
    assert [g.devices for g in plan.generators] == [(), (), ()]
    assert plan.lines()[0] == "placement: 2 learner rank(s), 3 generator(s) on the CPU"


@pytest.mark.parametrize("n, ranks, gens, learner, generators", [
    (1, 1, 0, (0,), []),
    (2, 1, 1, (0,), [(1,)]),
    (4, 2, 2, (0, 1), [(2,), (3,)]),
    (8, 4, 4, (0, 1, 2, 3), [(4,), (5,), (6,), (7,)]),
    (8, 6, 2, (0, 1, 2, 3, 4, 5), [(6,), (7,)]),
])
def test_learner_takes_the_first_devices_and_each_generator_one_of_the_rest(n, ranks, gens, learner, generators):
    plan = plan_placement(devices=tuple(range(n)), learner_ranks=ranks, generators=gens)
    assert plan.learner.devices == learner
    assert [g.devices for g in plan.generators] == generators
    used = [d for p in plan.processes for d in p.devices]
    assert len(used) == len(set(used))  # no device twice without sharing asked for


def test_generators_share_a_device_when_asked():
    plan = plan_placement(devices=tuple(range(8)), learner_ranks=4, generators=8, generators_per_gpu=2)
    assert [g.devices for g in plan.generators] == [(4,), (4,), (5,), (5,), (6,), (6,), (7,), (7,)]


def test_colocated_generators_use_spare_devices_first_then_the_learners():
    plan = plan_placement(devices=tuple(range(4)), learner_ranks=3, generators=3, colocate=True)
    assert plan.learner.devices == (0, 1, 2)
    assert [g.devices for g in plan.generators] == [(3,), (0,), (1,)]
    assert any("colocated" in n for n in plan.notes)
    one = plan_placement(devices=(0,), learner_ranks=1, generators=1, colocate=True, learner_gib=20.0,
                         generator_gib=30.0, device_gib=80.0)
    assert one.generators[0].devices == (0,)
    assert "  GPU 0: learner (20.0 GiB), generator-0 (30.0 GiB)  = 50.0 GiB" in one.lines()


def test_every_refusal_is_one_line_naming_what_to_change():
    cases = [
        (dict(devices=(0, 1), learner_ranks=4, generators=0), "4 learner ranks need a GPU each and --gpus names 2"),
        (dict(devices=(0, 1, 2, 3), learner_ranks=4, generators=1), "--colocate"),
        (dict(devices=(0, 1, 2, 3), learner_ranks=2, generators=3), "need 3 GPU(s) besides the learner's 2"),
        (dict(devices=(0, 1), learner_ranks=1, generators=3, generators_per_gpu=2), "need 2 GPU(s)"),
        (dict(devices=(0,), learner_ranks=1, generators=1, colocate=True, learner_gib=60.0, generator_gib=30.0,
              device_gib=80.0), "GPU 0 would hold 90.0 GiB (learner 60.0 + generator-0 30.0) of its 80 GiB"),
        (dict(devices=(0, 1), learner_ranks=1, generators=2, generators_per_gpu=2, generator_gib=50.0,
              device_gib=80.0), "lower launch.generators_per_gpu"),
        (dict(devices=(0,), learner_ranks=0, generators=0), "at least one learner rank"),
    ]
    for kw, words in cases:
        with pytest.raises(PlacementError) as err:
            plan_placement(**kw)
        assert words in str(err.value) and "\n" not in str(err.value), (kw, str(err.value))


def test_a_generators_memory_is_vllms_share_or_the_hf_engines_weights():
    assert generator_gib("vllm", params=None, dtype_bytes=2, gpu_memory_utilization=0.4, device_gib=80.0) == 32.0
    assert generator_gib("hf", params=3 * 2**30, dtype_bytes=2, gpu_memory_utilization=0.9, device_gib=80.0) == 6.0
    assert generator_gib("vllm", params=None, dtype_bytes=2, gpu_memory_utilization=0.4, device_gib=None) is None


@pytest.mark.parametrize("name", ["qwen2_5_vl_3b_1node", "qwen2_5_vl_7b_1node", "qwen3_vl_8b_1node"])
def test_each_shipped_one_node_config_places_on_8_gpus(name):
    cfg = load_config(name)
    lc = cfg.launch
    plan = plan_placement(devices=tuple(range(8)), learner_ranks=lc.learner_ranks, generators=cfg.rollout.num_generators,
                          generators_per_gpu=lc.generators_per_gpu, colocate=lc.colocate)
    assert plan.learner.ranks + len({g.devices for g in plan.generators}) <= 8
    assert lc.gpus == "0-7"


# ------------------------------------------------------------------------------ how up starts them
def _specs(*sets, ranks=1, gens=2, devices=()):
    from streamgrpo.commands.up_children import child_specs

    cfg = build_config({}, list(sets))
    plan = plan_placement(devices=devices, learner_ranks=ranks, generators=gens)
    return child_specs(cfg, plan, Path("/run/config.yaml"), python="py")


def test_several_learner_ranks_run_under_torchrun_and_one_rank_without():
    one, *_ = _specs()
    assert one.argv == ["py", "-m", "streamgrpo", "learner", "--config", "/run/config.yaml"]
    two, *_ = _specs(ranks=2)
    assert two.argv[:6] == ["py", "-m", "streamgrpo.learner.ranks", "--standalone", "--nproc-per-node", "2"]
    assert two.argv[6:] == ["-m", "streamgrpo", "learner", "--config", "/run/config.yaml"]


def test_no_two_processes_of_one_up_share_a_metrics_port():
    specs = _specs("metrics.port=9100", ranks=4, gens=4, devices=tuple(range(8)))
    learner_ports = [9100 + r for r in range(4)]  # rank r serves metrics.port + r
    ports = learner_ports + [s.metrics_port for s in specs[1:]]
    assert len(ports) == len(set(ports)) == 8
    assert [s.metrics_port for s in specs[1:]] == [9104, 9105, 9106, 9107]
    assert all(f"metrics.port={s.metrics_port}" in s.argv for s in specs[1:])
    free = _specs("metrics.port=0", ranks=2, gens=2)
    assert all(s.metrics_port == 0 for s in free) and not any("--set" in s.argv for s in free)  # each picks a free one


def test_each_process_sees_only_its_own_devices():
    specs = _specs(ranks=2, gens=2, devices=(0, 1, 2, 3))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2", "3"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in _specs(ranks=1, gens=1)] == ["", ""]  # CPU: no GPU seen
    from streamgrpo.commands.up_children import child_specs

    cfg = build_config({})
    plan = plan_placement(devices=(0, 1), learner_ranks=1, generators=1)
    named = child_specs(cfg, plan, Path("c.yaml"), python="py", visible_ids=["4", "6"])  # up saw GPUs 4 and 6 only
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in named] == ["4", "6"]


@pytest.fixture(scope="module")
def real_configs(tmp_path_factory):
    """config.json of Qwen2.5-VL-3B/7B and Qwen3-VL-8B at their published layer sizes (no weights)."""
    from streamgrpo.models.tiny import write_config

    root = tmp_path_factory.mktemp("real")
    return {name: write_config(root / name, arch, size) for name, arch, size in
            [("qwen2_5_vl_3b_1node", "qwen2_5_vl", "3b"), ("qwen2_5_vl_7b_1node", "qwen2_5_vl", "7b"),
             ("qwen3_vl_8b_1node", "qwen3_vl", "8b")]}


@pytest.mark.parametrize("name", ["qwen2_5_vl_3b_1node", "qwen2_5_vl_7b_1node", "qwen3_vl_8b_1node"])
def test_each_one_node_config_fits_its_learner_and_its_plan_on_8_gpus_of_80_gib(name, real_configs):
    from streamgrpo.learner.memory.plan import GiB, plan_for, report

    cfg = load_config(name, [f"model.name_or_path={real_configs[name]}"])
    counts, place, mem = plan_for(cfg, cfg.launch.learner_ranks)
    lines, fits = report(counts, place, mem, 80 * GiB)
    assert fits, lines
    gib = generator_gib(cfg.rollout.engine, params=counts.total, dtype_bytes=2,
                        gpu_memory_utilization=cfg.rollout.vllm.gpu_memory_utilization, device_gib=80.0)
    plan = plan_placement(devices=tuple(range(8)), learner_ranks=cfg.launch.learner_ranks,
                          generators=cfg.rollout.num_generators, learner_gib=mem.device_bytes / GiB,
                          generator_gib=gib, device_gib=80.0)
    assert all(len(parts) == 1 for parts in plan.load().values())  # one process per GPU: 4 learner ranks, 4 vLLM
    assert f"{name}" in (REPO / "streamgrpo" / "configs" / f"{name}.yaml").read_text()


def test_children_are_offline_only_for_a_local_model(tmp_path, monkeypatch):
    from streamgrpo.commands.up import _child_env

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = _child_env(build_config({}, ["model.name_or_path=Qwen/Qwen2.5-VL-7B-Instruct"]))
    assert "HF_HUB_OFFLINE" not in hub  # a Hub id must be able to download
    local = _child_env(build_config({}, [f"model.name_or_path={tmp_path}"]))
    assert local["HF_HUB_OFFLINE"] == "1" and local["OMP_NUM_THREADS"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the user's choice is kept
    assert _child_env(build_config({}, ["model.name_or_path=Qwen/Qwen2.5-VL-7B-Instruct"]))["HF_HUB_OFFLINE"] == "1"


def test_up_plan_prints_the_placement_and_starts_nothing(tmp_path, capsys, monkeypatch):
    from streamgrpo.commands.up import run_up

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    cfg = build_config({}, [f"run_dir={tmp_path / 'run'}", "rollout.num_generators=2"])
    assert run_up(cfg, learner_ranks=2, gpus="cpu", plan_only=True) == 0
    out = capsys.readouterr().out
    assert "placement: 2 learner rank(s), 2 generator(s) on the CPU" in out and "learner: cpu (2 ranks)" in out
    assert not (tmp_path / "run").exists()  # nothing made, nothing started
    with pytest.raises(PlacementError, match="4 learner ranks need a GPU each and --gpus names 2"):
        run_up(build_config({}, [f"run_dir={tmp_path / 'run'}"]), learner_ranks=4, gpus="0,1", plan_only=True)
    with pytest.raises(PlacementError, match="expected device numbers"):
        run_up(build_config({}, [f"run_dir={tmp_path / 'run'}"]), gpus="x", plan_only=True)


def test_one_sequence_parallel_group_keeps_the_torch_backend_in_up_and_config_memory(tmp_path, capsys, monkeypatch,
                                                                                    tiny_model_dir):
    from streamgrpo.cli import main
    from streamgrpo.commands.up import run_up
    from streamgrpo.config import ConfigError
    from streamgrpo.config.launch import backend_for_ranks

    assert [backend_for_ranks("torch", r, sp) for r, sp in ((1, 1), (2, 2), (4, 2), (2, 1))] == \
        ["torch", "torch", "deepspeed", "deepspeed"]
    assert backend_for_ranks("deepspeed", 2, 2) == "deepspeed"
    with pytest.raises(ConfigError, match="learner.sequence_parallel=2 needs a multiple of 2 ranks"):
        backend_for_ranks("torch", 3, 2)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sp = build_config({}, [f"run_dir={tmp_path / 'run'}", "learner.sequence_parallel=2"])
    assert run_up(sp, learner_ranks=2, gpus="cpu", plan_only=True) == 0 and sp.learner.backend == "torch"
    assert "learner.backend set to deepspeed" not in capsys.readouterr().out
    wide = build_config({}, [f"run_dir={tmp_path / 'run'}", "learner.sequence_parallel=2"])
    assert run_up(wide, learner_ranks=4, gpus="cpu", plan_only=True) == 0 and wide.learner.backend == "deepspeed"
    memory = ["config", "memory", "--config", "demo", "--set", "learner.sequence_parallel=2", "--set",
              f"model.name_or_path={tiny_model_dir}", "--gpu-gib", "80"]
    assert main([*memory, "--ranks", "2"]) == 0
    assert "planned with learner.backend=deepspeed" not in capsys.readouterr().out
    assert main([*memory, "--ranks", "3"]) == 2
    assert "needs a multiple of 2 ranks" in capsys.readouterr().err


def test_up_plan_offline_with_a_hub_name_says_which_file_the_memory_figures_need(tmp_path, capsys, caplog,
                                                                                   monkeypatch, real_configs):
    """No GPU here: ``--gpus 0-7 --gpu-gib 80`` plans an 8-GPU node; the model config is all it reads."""
    import logging

    import huggingface_hub.constants

    from streamgrpo.commands.up import run_up

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.WARNING):
        assert run_up(load_config("qwen2_5_vl_3b_1node", [f"run_dir={tmp_path / 'run'}"]), gpus="0-7", gpu_gib=80.0,
                      plan_only=True) == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith("placement: no memory figures: no model config for "
                              "model.name_or_path='Qwen/Qwen2.5-VL-3B-Instruct': HF_HUB_OFFLINE is set")
    assert "`streamgrpo model tiny --size 3b --config-only --out DIR`" in warning and "\n" not in warning
    assert "GPU 0: learner rank 0\n" in capsys.readouterr().out  # the plan, without the learner's figure
    local = [f"run_dir={tmp_path / 'run'}", f"model.name_or_path={real_configs['qwen2_5_vl_3b_1node']}"]
    assert run_up(load_config("qwen2_5_vl_3b_1node", local), gpus="0-7", gpu_gib=80.0, plan_only=True) == 0
    assert "GPU 0: learner rank 0 (41.1 GiB)" in capsys.readouterr().out  # the directory the line asks for (25.6 static + 15.5 step)


def test_the_evaluator_takes_a_spare_gpu_else_shares_the_last_generators():
    spare = plan_placement(devices=tuple(range(4)), learner_ranks=2, generators=1, evaluator=True)
    assert spare.evaluator.devices == (3,) and not spare.notes
    full = plan_placement(devices=tuple(range(4)), learner_ranks=2, generators=2, evaluator=True)
    assert full.evaluator.devices == (3,) and "the evaluator shares GPU 3" in full.notes[0]
    assert [n for n, _ in full.load()[3]] == ["generator-1", "evaluator"]
    alone = plan_placement(devices=(0,), learner_ranks=1, generators=0, evaluator=True)
    assert alone.evaluator.devices == (0,)  # no generator on a device: beside the learner
    cpu = plan_placement(devices=(), learner_ranks=1, generators=2, evaluator=True)
    assert cpu.evaluator.devices == () and cpu.lines()[0].endswith("2 generator(s), the evaluator on the CPU")
    assert plan_placement(devices=(0, 1), learner_ranks=1, generators=1).evaluator is None


def test_an_evaluator_that_does_not_fit_beside_a_vllm_generator_is_refused_in_one_line():
    with pytest.raises(PlacementError, match=r"GPU 1 would hold 78\.0 GiB .*eval\.enabled=false") as err:
        plan_placement(devices=(0, 1), learner_ranks=1, generators=1, evaluator=True, learner_gib=30.0,
                       generator_gib=72.0, evaluator_gib=6.0, device_gib=75.0)
    assert "\n" not in str(err.value)


def test_up_starts_the_evaluator_with_its_own_device_and_port():
    from streamgrpo.commands.up_children import child_specs

    cfg = build_config({}, ["metrics.port=9100"])
    plan = plan_placement(devices=tuple(range(4)), learner_ranks=2, generators=1, evaluator=True)
    specs = child_specs(cfg, plan, Path("/run/config.yaml"), python="py")
    ev = specs[-1]
    assert ev.name == "evaluator" and ev.argv[:6] == ["py", "-m", "streamgrpo", "evaluator", "--config",
                                                      "/run/config.yaml"]
    assert ev.env["CUDA_VISIBLE_DEVICES"] == "3" and ev.metrics_port == 9103 and "metrics.port=9103" in ev.argv


def test_eval_enabled_without_held_out_records_is_refused():
    from streamgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="eval.enabled needs held-out records: set data.eval_path"):
        build_config({}, ["eval.enabled=true"])
    assert load_config("demo").eval.enabled and load_config("demo-motion").eval.shuffle_frames


def test_the_evaluator_takes_every_nth_version_and_the_runs_last():
    from streamgrpo.config.roles import final_version
    from streamgrpo.evaluator.loop import due

    assert due(3, None, 25) and not due(20, 3, 25) and due(28, 3, 25)
    assert due(250, 225, 25, final=250) and due(241, 225, 25, final=241) and not due(241, 241, 25, final=241)
    assert final_version(build_config({}, ["learner.max_steps=250", "weights.sync_every=1"])) == 250
    assert final_version(build_config({}, ["learner.max_steps=250", "weights.sync_every=3"])) == 249


def test_a_refusal_where_vllm_generators_overflow_names_gpu_memory_utilization():
    # colocated: the learner's 30 GiB fit alone, vLLM's 0.85 of 80 GiB on top do not
    with pytest.raises(PlacementError) as err:
        plan_placement(devices=(0,), learner_ranks=1, generators=1, colocate=True, learner_gib=30.0,
                       generator_gib=68.0, device_gib=80.0, vllm_utilization=0.85)
    msg = str(err.value)
    assert msg.startswith("GPU 0 would hold 98.0 GiB (learner 30.0 + generator-0 68.0) of its 80 GiB: lower "
                          "rollout.vllm.gpu_memory_utilization (now 0.85; at most 0.62 leaves room for the rest")
    assert "\n" not in msg
    # two vLLM generators a GPU at 0.85 each: at most 0.50 each
    with pytest.raises(PlacementError, match=r"gpu_memory_utilization \(now 0\.85; at most 0\.50 .*"
                                             r"lower launch\.generators_per_gpu"):
        plan_placement(devices=(0, 1), learner_ranks=1, generators=2, generators_per_gpu=2, generator_gib=68.0,
                       device_gib=80.0, vllm_utilization=0.85)
    # the learner alone overflows: no generator advice
    with pytest.raises(PlacementError) as err:
        plan_placement(devices=(0,), learner_ranks=1, generators=1, colocate=True, learner_gib=90.0,
                       generator_gib=10.0, device_gib=80.0, vllm_utilization=0.1)
    assert "gpu_memory_utilization" not in str(err.value) and "shrink the learner's plan" in str(err.value)
    # HF generators that overflow: their batch
    with pytest.raises(PlacementError, match=r"the generators \(hf engine\) need less: fewer rollout.prompts_per_batch"):
        plan_placement(devices=(0,), learner_ranks=1, generators=1, colocate=True, learner_gib=30.0,
                       generator_gib=60.0, device_gib=80.0)


def test_up_plans_vllm_generators_with_their_share_and_names_it_when_they_overflow(tiny_model_dir):
    from streamgrpo.commands.up import placement_for

    cfg = build_config({}, [f"model.name_or_path={tiny_model_dir}", "rollout.engine=vllm", "launch.gpus=0,1",
                            "launch.learner_ranks=1", "rollout.num_generators=2", "launch.generators_per_gpu=2",
                            "rollout.vllm.gpu_memory_utilization=0.6", "eval.enabled=false"])
    with pytest.raises(PlacementError, match=r"GPU 1 would hold 96\.0 GiB \(generator-0 48\.0 \+ generator-1 48\.0\) "
                                             r"of its 80 GiB: lower rollout\.vllm\.gpu_memory_utilization \(now 0\.6; "
                                             r"at most 0\.50"):
        placement_for(cfg, gpu_gib=80.0)
    cfg.rollout.vllm.gpu_memory_utilization = 0.45
    assert "GPU 1: generator-0 (36.0 GiB), generator-1 (36.0 GiB)" in "\n".join(placement_for(cfg, gpu_gib=80.0).lines())
