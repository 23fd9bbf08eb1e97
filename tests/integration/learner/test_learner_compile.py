"""``learner.compile`` (issue 52 item 5): each decoder layer compiled with torch.compile trains as the eager
learner does. Real Learners on the tiny models and demo groups they sampled; dynamo's own counters say what
was compiled. The suite compiles with ``aot_eager`` (dynamo and AOTAutograd: the same graph capture,
activation-checkpoint handling and dynamic shapes as inductor, without a C++ build per graph, ~40 s more on
this CPU per model); one test runs inductor itself (its fused kernels: float rounding, hence the
tolerances) on CUDA, and on the CPU with STREAMGRPO_INDUCTOR_TESTS=1 (a cold C++ build: 1-2 minutes)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.op_counts import profiled
from streamgrpo.config import ConfigError
from streamgrpo.models.compile import RECOMPILE_LIMIT, compiled_graphs, decoder_layers, is_compiled
from streamgrpo.models.selective_checkpoint import checkpoints_inside_forward
from tests.integration.learner.test_learner_core import _accept, _cfg, _learner, _step_grads

SETS = ("model.tune_mm_vision=false", "learner.gradient_checkpointing=true", "loss.beta=0.04")
LORA = "model.lora={r: 4, alpha: 8, dropout: 0.0}"
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


@pytest.fixture(scope="module")
def groups_by_arch(tiny_model_dir, tiny_qwen3_dir, demo_data_dir):
    from conftest import sampled_groups as sample_groups  # sampled once per session

    def sample(model_dir):  # four groups of 6-token completions, four of 3: a second step of another length
        data = Path(demo_data_dir) / "train.jsonl"
        return [*sample_groups(model_dir, data, 4, num_generations=4, max_tokens=6),
                *sample_groups(model_dir, data, 4, num_generations=4, max_tokens=3)]
    return {"qwen2_5_vl": (tiny_model_dir, sample(tiny_model_dir)), "qwen3_vl": (tiny_qwen3_dir, sample(tiny_qwen3_dir))}


def _seq_lengths(learner):
    """The decoder's sequence length of every forward (a hook on the language model, which is not compiled)."""
    from streamgrpo.models.batching import unwrap_model

    seen: list[int] = []

    lm = unwrap_model(learner.module).model.language_model
    lm.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(int(kwargs["inputs_embeds"].shape[1])),
                                 with_kwargs=True)
    return seen


def _two_steps(eager, compiled, groups, *, lp_atol, grad_atol, probe=True):
    """Both learners: log-probs before (``probe``), then two steps on groups of different lengths; compares every
    result."""
    first, second = _accept(groups[:4], eager), _accept(groups[4:8], eager)
    if probe:
        np.testing.assert_allclose(np.concatenate(compiled.own_logprobs(first)),
                                   np.concatenate(eager.own_logprobs(first)), atol=lp_atol, rtol=0)
    lengths = _seq_lengths(compiled)
    graphs, matmuls = [], []
    for batch in (first, second):
        with profiled() as p_e:
            out_e, g_e = _step_grads(eager, batch)
        with profiled() as p_c:
            out_c, g_c = _step_grads(compiled, batch)
        graphs.append(compiled_graphs())
        matmuls.append([sum(n for k, n in p["by_name"].items() if k in MATMULS) for p in (p_e, p_c)])
        assert out_c.loss == pytest.approx(out_e.loss, abs=lp_atol)
        assert out_c.grad_norm == pytest.approx(out_e.grad_norm, rel=1e-4)
        assert g_c.keys() == g_e.keys() and g_e
        for n, g in g_e.items():
            torch.testing.assert_close(g_c[n], g, rtol=1e-4, atol=grad_atol, msg=n)
    # the compiled layers still recompute under activation checkpointing (the second step: the first also
    # compiled): not recomputing would drop one forward's matmuls, a matmul per Linear of every layer; the
    # compiled recompute leaves out only what the backward does not read (a layer's last projection)
    linears = sum(isinstance(m, torch.nn.Linear) for layer in decoder_layers(compiled.module) for m in layer.modules())
    assert matmuls[1][0] - linears / 2 < matmuls[1][1] <= matmuls[1][0], (matmuls, linears)
    for (n, p), (m, q) in zip(eager.module.named_parameters(), compiled.module.named_parameters(), strict=True):
        assert n == m
        torch.testing.assert_close(q, p, rtol=1e-4, atol=grad_atol, msg=n)
    return lengths, graphs


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_compiled_decoder_layers_train_like_eager_and_do_not_recompile_for_another_length(groups_by_arch, arch,
                                                                                          tmp_path):
    model_dir, groups = groups_by_arch[arch]
    full = arch == "qwen2_5_vl"  # the other: no reference, no probe (one graph to capture: the suite's time)
    sets = SETS if full else (*SETS[:2], "loss.beta=0")
    eager = _learner(_cfg(model_dir, tmp_path / "a", *sets))
    compiled = _learner(_cfg(model_dir, tmp_path / "b", *sets, "learner.compile=true",
                             "learner.compile_backend=aot_eager"))
    assert (compiled.ref is not None) == full
    assert all(is_compiled(m) for m in decoder_layers(compiled.module) +
               (decoder_layers(compiled.ref) if full else []))
    assert not any(is_compiled(m) for m in decoder_layers(eager.module))
    assert compiled.module.state_dict().keys() == eager.module.state_dict().keys()
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT  # room for every kind of forward of all layers
    before = compiled_graphs()
    lengths, graphs = _two_steps(eager, compiled, groups, lp_atol=1e-6, grad_atol=1e-7, probe=full)
    # the second step's sequences have another length, and nothing was compiled for it
    assert len(set(lengths)) > 1, lengths
    assert graphs[1] == graphs[0]
    # what compiled, each graph reused by every layer: the policy's layer with gradients, under no_grad (the
    # log-prob probe) and the reference's (no_grad, eval mode)
    assert 1 <= graphs[0] - before <= 3
    saved = compiled.save(tmp_path / "ckpt")
    from streamgrpo.models.files import read_model_tensors

    names = set(read_model_tensors(saved))
    assert names and not any("_orig_mod" in n for n in names)
    assert names == set(read_model_tensors(eager.save(tmp_path / "ckpt_eager")))


def test_compiled_lora_learner_trains_like_eager_with_its_reference(groups_by_arch, tmp_path):
    model_dir, groups = groups_by_arch["qwen2_5_vl"]
    eager = _learner(_cfg(model_dir, tmp_path / "a", *SETS, LORA))
    compiled = _learner(_cfg(model_dir, tmp_path / "b", *SETS, LORA, "learner.compile=true",
                             "learner.compile_backend=aot_eager"))
    assert compiled.ref is None and all(is_compiled(m) for m in decoder_layers(compiled.module))
    _, graphs = _two_steps(eager, compiled, groups, lp_atol=1e-6, grad_atol=1e-7, probe=False)
    assert graphs[1] == graphs[0]
    assert [k for k in compiled.module.state_dict() if "lora_" in k] == \
        [k for k in eager.module.state_dict() if "lora_" in k]


INDUCTOR_ON_CPU = os.environ.get("STREAMGRPO_INDUCTOR_TESTS") == "1"


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not INDUCTOR_ON_CPU, reason="inductor's C++ build of the layer takes "
                                                 "1-2 min on a 2-core CPU: STREAMGRPO_INDUCTOR_TESTS=1 runs it")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("selective", [False, True], ids=["plain", "checkpoint_matmuls"])
def test_inductor_compiled_layers_match_eager_within_float_rounding(groups_by_arch, tmp_path, device, selective):
    """Inductor's kernels against the eager learner; with ``learner.checkpoint_matmuls`` too (selective
    checkpointing: the partitioner keeps the matmul and attention outputs, inductor recomputes the rest)."""
    model_dir, groups = groups_by_arch["qwen2_5_vl"]
    sets = ("model.tune_mm_vision=false", "learner.gradient_checkpointing=true", "loss.beta=0",  # one graph
            f"learner.device={device}")
    eager = _learner(_cfg(model_dir, tmp_path / "a", *sets))
    compiled = _learner(_cfg(model_dir, tmp_path / "b", *sets, "learner.compile=true",
                             *(["learner.checkpoint_matmuls=true"] if selective else [])))
    assert compiled.cfg.learner.compile_backend == "inductor"
    batch = _accept(groups[:4], eager)
    out_e, g_e = _step_grads(eager, batch)
    out_c, g_c = _step_grads(compiled, batch)
    assert out_c.loss == pytest.approx(out_e.loss, abs=1e-5)
    assert out_c.grad_norm == pytest.approx(out_e.grad_norm, rel=1e-4)
    for n, g in g_e.items():
        torch.testing.assert_close(g_c[n], g, rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("sets", [("learner.backend=deepspeed", "learner.deepspeed_config=zero3"),
                                  ("learner.gradient_checkpointing=true", "learner.checkpoint_offload=true")],
                         ids=["deepspeed_zero3", "offload"])
def test_compile_where_it_is_not_supported_is_refused_at_config_load_in_one_line(tiny_model_dir, tmp_path, sets):
    """ZeRO-3 here; compiled ZeRO-2 ranks against eager ones: test_learner_compile_ranks.py."""
    with pytest.raises(ConfigError, match="learner.compile") as e:
        _cfg(tiny_model_dir, tmp_path, "learner.compile=true", *sets)
    assert "\n" not in str(e.value) and "{" not in str(e.value)


class _MatmulCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """The matmuls an eager step runs (torch.profiler records an op that selective checkpointing answers from its
    cache too; a dispatch mode outside the checkpoint's own sees only what runs)."""

    def __init__(self):
        super().__init__()
        self.by_name = {}

    def __getitem__(self, key):
        return self.by_name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten::{func.overloadpacket.__name__}"
        self.by_name[name] = self.by_name.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpoint_matmuls_keeps_the_matmul_outputs_instead_of_recomputing_them(groups_by_arch, tmp_path, backend):
    """``learner.checkpoint_matmuls`` (selective checkpointing): the same loss and gradients as plain checkpointing,
    eagerly and compiled (each against plain checkpointing run the same way), and the backward's recompute runs none of the layers' matmuls."""
    model_dir, groups = groups_by_arch["qwen2_5_vl"]
    sets = ("model.tune_mm_vision=false", "learner.gradient_checkpointing=true", "loss.beta=0")
    compiled = ("learner.compile=true", f"learner.compile_backend={backend}") if backend != "eager" else ()
    if compiled and not checkpoints_inside_forward():  # transformers 5.17: the checkpoint runs around the compiled layer
        with pytest.raises(ConfigError, match="learner.checkpoint_matmuls with learner.compile") as e:
            _learner(_cfg(model_dir, tmp_path / "b", *sets, "learner.checkpoint_matmuls=true", *compiled))
        assert "\n" not in str(e.value)
        return
    plain = _learner(_cfg(model_dir, tmp_path / "a", *sets, *compiled))
    selective = _learner(_cfg(model_dir, tmp_path / "b", *sets, "learner.checkpoint_matmuls=true", *compiled))
    batch = _accept(groups[:4], plain)
    counts = []
    for learner in (plain, selective):
        _step_grads(learner, batch)  # a first step (it compiles); the second is counted
        with _MatmulCounter() if backend == "eager" else profiled() as p:
            out, grads = _step_grads(learner, batch)
        counts.append((out, grads, sum(n for k, n in p["by_name"].items() if k in MATMULS)))
    (out_p, g_p, mm_p), (out_s, g_s, mm_s) = counts
    assert out_s.loss == pytest.approx(out_p.loss, abs=1e-6)
    assert out_s.grad_norm == pytest.approx(out_p.grad_norm, rel=1e-4)
    assert g_s.keys() == g_p.keys() and g_p
    for n, g in g_p.items():
        torch.testing.assert_close(g_s[n], g, rtol=1e-4, atol=1e-7, msg=n)
    # plain checkpointing's recompute stops after the last output the backward reads (a layer's last projection,
    # down, is not run again): it runs every other Linear of each layer again, which the selective one does not
    layers = decoder_layers(plain.module)
    linears = sum(isinstance(m, torch.nn.Linear) for layer in layers for m in layer.modules())
    assert mm_p - mm_s == linears - len(layers), (mm_p, mm_s, linears)
