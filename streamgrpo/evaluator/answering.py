"""Answering records with a loaded model: what ``streamgrpo infer``, ``streamgrpo eval`` and the
evaluator process share (model loading, request preparation, the batched generation loop, output rows,
the temporal probe's frame shuffling)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamgrpo.config import Config, ConfigError
from streamgrpo.config.roles import EvaluatorConfig
from streamgrpo.data.prompts import build_prompt_text, processor_inputs, vision_factors
from streamgrpo.data.records import DataError
from streamgrpo.data.shuffle import shuffle_visuals
from streamgrpo.data.video import load_visuals
from streamgrpo.engines.base import PromptRequest
from streamgrpo.engines.hf import HFEngine
from streamgrpo.engines.vllm import VLLMEngine, VLLMNotInstalled, install_hint
from streamgrpo.metrics import ERRORS
from streamgrpo.models.loading import load_model, load_processor, resolve_device
from streamgrpo.rewards import extract_answer


@dataclass
class Policy:
    """A loaded model behind an engine, with its processor and vision factors."""

    engine: Any
    processor: Any
    factor: int
    temporal_patch: int
    name: str
    calls: int = 0
    """Engine generate calls made by :func:`run_batches` (each one batch of prompts)."""

    def close(self) -> None:
        import gc

        import torch

        if self.engine is not None and hasattr(self.engine, "close"):  # vLLM: its engine core and GPU share
            self.engine.close()
        self.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


ENGINE_OPTION = {"eval": "eval.engine", "infer": "--engine"}  # what chooses the engine, per role


def engine_choice(engine: str, adapter: str | None, option: str = "eval.engine") -> str:
    """``hf`` or ``vllm`` (``eval.engine``, or ``infer --engine``: ``option``; pure): vLLM answers with a plain
    or merged model only."""
    eq = " " if option.startswith("--") else "="
    if engine not in ("hf", "vllm"):
        raise ConfigError(f"{option}{eq}{engine!r}: expected hf or vllm")
    if engine == "vllm" and adapter:
        raise ConfigError(f"{option}{eq}vllm answers with a merged model, not --adapter {adapter!r}: "
                          f"`streamgrpo model merge --adapter DIR --out MERGED` first, or {option}{eq}hf")
    return engine


def vllm_policy(model: str, cfg: Config, records: Sequence | None = None, role: str = "eval") -> Policy:
    """``model`` behind a :class:`~streamgrpo.engines.vllm.VLLMEngine` (``rollout.vllm`` settings; the
    multimodal limits from ``records``, else from ``data.train_path``). ``role`` (eval, infer) names its
    start-error line and log file, and the setting the install hint names."""

    processor = load_processor(model, cfg.model.revision if model == cfg.model.name_or_path else None)
    vcfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": model, "lora": None})})
    counts = None if records is None else [(len(r.videos), len(r.images)) for r in records]
    try:
        engine = VLLMEngine.from_config(vcfg, processor, name=role, counts=counts)
    except VLLMNotInstalled as exc:  # its hint names rollout.engine: name what chose vLLM here
        raise ConfigError(f"{install_hint(ENGINE_OPTION[role])} (import error: {exc.__cause__})") from None
    factor, temporal = vision_factors(processor)
    return Policy(engine, processor, factor, temporal, model)


def load_policy(model: str, cfg: Config | EvaluatorConfig, adapter: str | None = None, *, engine: str = "hf",
                records: Sequence | None = None, role: str = "eval", custom_mask: bool = False) -> Policy:
    """Load ``model`` (checkpoint dir, merged model, base model or hub id), optionally with a LoRA
    ``adapter`` merged in, behind an :class:`~streamgrpo.engines.hf.HFEngine` -- or with
    ``engine="vllm"`` (``eval.engine``, ``infer --engine``: ``role``) behind vLLM (:func:`vllm_policy`;
    ``records``: what it will answer).

    dtype: ``model.dtype`` when the config sets it, else float32 on CPU (bf16 matmuls are slow
    there) and the default bfloat16 on CUDA. ``custom_mask``: ``learner.shared_prompt`` (the attention loads as
    the learner's does).
    """

    looks_local = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if looks_local and not Path(model).expanduser().is_dir():
        raise ConfigError(f"model directory {model!r} not found")
    if engine_choice(engine, adapter, ENGINE_OPTION[role]) == "vllm":
        return vllm_policy(model, cfg, records, role)
    device = resolve_device(cfg.rollout.device)
    model_cfg = cfg.model.model_copy(update={"name_or_path": model, "lora": None})
    dtype = model_cfg.dtype if ("dtype" in cfg.model.model_fields_set or device.type != "cpu") else "float32"
    try:
        net = load_model(model_cfg, device, dtype=dtype, custom_mask=custom_mask)
        proc_src = adapter if adapter and _has_processor(adapter) else model
        processor = load_processor(proc_src, model_cfg.revision if proc_src == model else None)
    except OSError as exc:
        raise ConfigError(f"cannot load model {model!r}: {exc}") from None
    if adapter:
        from peft import PeftModel

        if not Path(adapter, "adapter_config.json").is_file():
            raise ConfigError(f"--adapter {adapter!r}: no adapter_config.json there")
        net = PeftModel.from_pretrained(net, adapter).merge_and_unload()
        net.eval()
        net.requires_grad_(False)
    factor, temporal = vision_factors(processor)
    name = model + (f" + {adapter}" if adapter else "")
    engine = HFEngine(net, processor, device=device, vision_cache_mib=cfg.rollout.vision_cache_mib)
    return Policy(engine, processor, factor, temporal, name)


def _has_processor(path: str) -> bool:
    return any(Path(path, f).is_file() for f in ("preprocessor_config.json", "processor_config.json"))



def record_rng(seed: int, record_id: str):
    """The temporal probe's generator for one record: seeded by ``seed`` and a SHA-256 of the record
    id (not Python's salted ``hash``), so a rerun shuffles every record alike whatever the batching."""
    import hashlib

    import numpy as np

    if seed < 0:
        raise ConfigError(f"--shuffle-seed must be >= 0, got {seed}")
    digest = int.from_bytes(hashlib.sha256(str(record_id).encode("utf-8")).digest()[:16], "little")
    return np.random.default_rng([int(seed), digest])


def probe_visuals(visuals: list, seed: int, record_id: str) -> list:
    """One record's visuals for ``eval --shuffle-frames``: each video's sampled frames in a random
    (never identity) order, images untouched, frame labels in their order
    (:func:`~streamgrpo.data.shuffle.shuffle_visuals`): only the pictures move."""

    return shuffle_visuals(visuals, record_rng(seed, record_id))


def prepare_request(policy: Policy, record, data_cfg, shuffle_seed: int | None = None):
    """Frames, chat prompt and processor inputs of one record; any failure is a DataError.

    With ``shuffle_seed`` the sampled frames of each video are shuffled (:func:`probe_visuals`)
    before the processor sees them."""

    visuals = load_visuals(record, data_cfg, policy.factor, policy.temporal_patch)
    if shuffle_seed is not None:
        visuals = probe_visuals(visuals, shuffle_seed, record.id)
    text = build_prompt_text(policy.processor, record, data_cfg)
    try:
        inputs = processor_inputs(policy.processor, text, visuals)
    except ValueError as exc:
        raise DataError(record.id, record.source, f"processor rejected the prompt: {exc}") from None
    return PromptRequest(text, visuals, inputs, record.id)


def result_rows(record, group, rewards, data_cfg, *, has_truth: bool, with_sample: bool = False) -> list[dict]:
    """Output lines of one record: one per sampled completion (``sample`` index when asked)."""

    texts = [c.text for c in group]
    scored = None
    if has_truth and rewards is not None:
        scored = rewards.score(texts, record.answer, prompt_id=record.id,
                               fields={"question": record.question, "kind": record.kind})
    rows = []
    for j, c in enumerate(group):
        row: dict[str, Any] = {"id": record.id}
        if with_sample:
            row["sample"] = j
        row.update(prompt=record.question, completion=c.text, answer=extract_answer(c.text, data_cfg.answer_tag),
                   finish_reason=c.finish_reason, completion_tokens=int(len(c.token_ids)))
        if has_truth:
            row["ground_truth"] = record.answer
        if scored is not None:
            row["rewards"] = {k: float(v) for k, v in scored.for_completion(j).items()}
            row["reward"] = float(scored.totals[j])
        rows.append(row)
    return rows


def run_batches(policy: Policy, records: Sequence, data_cfg, sampling, *, batch_size: int,
                emit: Callable[[Any, list], None], on_error: Callable[[Exception], None], desc: str = "infer",
                shuffle_seed: int | None = None) -> int:
    """Generate for ``records`` in batches of ``batch_size`` prompts, with a progress bar (frames
    shuffled per record with ``shuffle_seed``: see :func:`prepare_request`).

    ``emit(record, completions)`` is called per record in input order after each batch;
    ``on_error(DataError)`` for a record that cannot be prepared (it is skipped). Returns the
    number of records done.
    """
    from tqdm import tqdm


    done = 0
    bar = tqdm(total=len(records), desc=desc, unit="rec", file=sys.stderr, dynamic_ncols=True)
    pending: list[tuple[Any, Any]] = []

    def flush() -> None:
        nonlocal done
        if not pending:
            return
        outs = policy.engine.generate([req for _, req in pending], sampling)
        policy.calls += 1
        for (rec, _), group in zip(pending, outs):
            emit(rec, group)
        done += len(pending)
        bar.update(len(pending))
        pending.clear()

    try:
        for rec in records:
            try:
                pending.append((rec, prepare_request(policy, rec, data_cfg, shuffle_seed)))
            except DataError as exc:
                bar.update(1)
                on_error(exc)
                continue
            if len(pending) >= batch_size:
                flush()
        flush()
    finally:
        bar.close()
    return done


def report_bad(exc: Exception) -> None:
    """One line naming the record and the path, and the error counter (kind=data)."""
    from tqdm import tqdm


    ERRORS.labels(kind="data").inc()
    tqdm.write(f"skipped {exc}", file=sys.stderr)


