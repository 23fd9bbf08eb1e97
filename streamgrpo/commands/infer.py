"""``streamgrpo infer``: answers from a trained (or any) Qwen-VL model, one prompt or a batch.

Single: ``--video V`` / ``--image I`` (repeatable, in that order unless the prompt places
``<video>``/``<image>`` itself) and ``--prompt P``; the completion is printed (and appended to
``--output`` when given). Batch: ``--input`` records (the data format of the training set; the gpt
turn is optional here) -> ``--output`` JSONL, one line per record::

    {"id", "prompt", "completion", "answer", "finish_reason", "completion_tokens",
     "ground_truth", "rewards": {fn: value}, "reward"}        # last three only with a ground truth

``answer`` is the ``<answer>`` content of the completion (``null`` without one). A batch run is
resumable: ids already in the output are skipped, and a line cut short by a kill is dropped and
redone. A record that cannot be used (bad JSON, missing or unreadable media) is reported in one line
naming its id and path, counted in ``streamgrpo_errors_total{kind="data"}`` and skipped.

``--engine vllm`` answers with vLLM (:class:`~streamgrpo.engines.vllm.VLLMEngine`, ``rollout.vllm``
settings) instead of the HF engine: ``--batch-size`` prompts (default :data:`BATCH_SIZE`) go to it in
one generate call, which it schedules itself; prompts, frames and answer extraction are the same.

Config resolution and record reading here are shared with :mod:`streamgrpo.commands.evaluate`; model
loading and the batched generation loop with the evaluator too (:mod:`streamgrpo.evaluator.answering`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from streamgrpo.config import Config, ConfigError, load_config
from streamgrpo.data.records import (
    DataError,
    DataFileNotFound,
    Record,
    _iter_json,
    _source_kind,
    parse_record,
    read_records,
)
from streamgrpo.engines.base import SamplingParams
from streamgrpo.evaluator.answering import (
    ENGINE_OPTION,
    engine_choice,
    load_policy,
    report_bad,
    result_rows,
    run_batches,
)
from streamgrpo.learner.checkpoint.files import latest_checkpoint
from streamgrpo.rewards import RewardSet

log = logging.getLogger("streamgrpo.infer")

_NO_TRUTH = "\x00streamgrpo-no-ground-truth\x00"  # stands in for a missing gpt turn while parsing
BATCH_SIZE = {"hf": 8, "vllm": 64}
"""Default ``--batch-size`` per engine: prompts per generate call. vLLM batches continuously inside a
call, so it gets more at once; the prepared requests (decoded frames) of one call are held in memory,
and a killed run redoes at most one call's records."""


# ---------------------------------------------------------------------------------------- config
def checkpoint_of(model: str) -> str:
    """A run directory (``runs/demo``) means its newest checkpoint; anything else is returned as is."""

    if model.startswith("~"):
        model = os.path.expanduser(model)
    p = Path(model)
    if p.is_dir() and not (p / "config.json").is_file():
        latest = latest_checkpoint(p / "checkpoints")
        if latest is not None:
            log.info("%s is a run directory: using its newest checkpoint %s", model, latest)
            return str(latest)
    return model


def run_config_of(model: str) -> Path | None:
    """The ``config.yaml`` of the run that wrote checkpoint ``model`` (``<run>/checkpoints/step-N``)."""
    p = Path(model)
    cand = p.parent.parent / "config.yaml"
    return cand if p.is_dir() and p.parent.name == "checkpoints" and cand.is_file() else None


def resolve_config(config: str | None, overrides: Sequence[str], model: str, prompt_format: str | None) -> Config:
    """``--config`` (or, without one, the config of the run that wrote ``model``, else the defaults),
    ``--set`` overrides, then ``--format``. The data section gives frame sampling and prompt format."""
    source = config
    if source is None:
        found = run_config_of(model)
        if found is not None:
            log.info("using the data/reward settings of %s (pass --config to choose others)", found)
            source = str(found)
    cfg = load_config(source, overrides)
    if prompt_format:
        cfg.data.prompt_format = prompt_format
    return cfg


# --------------------------------------------------------------------------------------- records
def read_input_records(path: str | os.PathLike, data_cfg) -> tuple[list, list, set[str]]:
    """Records of ``path`` for inference: (good records, DataErrors, ids without ground truth).

    Unlike training data a record may lack its gpt turn (nothing to score then). ``data.kinds``
    filters as in training; duplicate ids are errors.
    """

    path = Path(os.path.expanduser(str(path)))
    if not path.exists():
        raise DataFileNotFound(path, "input file")
    if _source_kind(path, data_cfg) == "hf":
        records, errors = read_records(path, data_cfg)
        return records, errors, set()
    media_root = data_cfg.media_root or path.parent
    records, errors, no_truth, seen = [], [], set(), set()
    for i, (where, raw) in enumerate(_iter_json(path)):
        if isinstance(raw, DataError):
            errors.append(raw)
            continue
        kw = dict(media_root=media_root, answer_tag=data_cfg.answer_tag, where=where, default_id=f"{path.stem}-{i}")
        try:
            try:
                rec = parse_record(raw, **kw)
            except DataError as exc:
                if exc.kind != "no_answer" or not isinstance(raw, dict):
                    raise
                rec = parse_record(_with_placeholder_truth(raw), **kw)
                rec.answer = rec.solution = ""
                no_truth.add(rec.id)
        except DataError as exc:
            errors.append(exc)
            continue
        if rec.id in seen:
            errors.append(DataError(rec.id, where, "duplicate record id"))
            continue
        seen.add(rec.id)
        if data_cfg.kinds is None or rec.kind in data_cfg.kinds:
            records.append(rec)
    return records, errors, no_truth


def _with_placeholder_truth(raw: dict) -> dict:
    raw = dict(raw)
    key = "conversations" if "conversations" in raw else "messages"
    if isinstance(raw.get(key), list):
        turns = [t for t in raw[key] if not (isinstance(t, dict) and str(t.get("from", t.get("role", ""))).lower()
                                             in ("gpt", "assistant", "bot", "model"))]
        raw[key] = [*turns, {"from": "gpt", "value": _NO_TRUTH}]
    elif "problem" in raw:
        raw["solution"] = _NO_TRUTH
    return raw


def single_record(prompt: str, videos: Sequence[str], images: Sequence[str], rid: str = "single"):
    """A :class:`Record` from ``--prompt`` and ``--video``/``--image`` (placeholders prepended unless
    the prompt has them, videos first)."""

    n_vid, n_img = prompt.count("<video>"), prompt.count("<image>")
    if n_vid == 0 and n_img == 0:
        prompt = "<video>\n" * len(videos) + "<image>\n" * len(images) + prompt
    elif (n_vid, n_img) != (len(videos), len(images)):
        raise DataError(rid, None, f"prompt has {n_vid} <video> and {n_img} <image> placeholders but "
                        f"{len(videos)} --video and {len(images)} --image were given", kind="placeholder_mismatch")
    return Record(id=rid, question=prompt, answer="", solution="",
                  videos=[str(Path(v).expanduser().absolute()) for v in videos],
                  images=[str(Path(i).expanduser().absolute()) for i in images], source="command line")


# ------------------------------------------------------------------------------------ resumption
def completed_ids(path: str | os.PathLike, per_id: int = 1) -> set[str]:
    """Ids with ``per_id`` complete lines in an existing output file.

    A line cut short by a kill, and the lines of an id with fewer than ``per_id`` rows, are removed
    from the file (rewritten atomically) so a resumed run appends cleanly.
    """
    p = Path(path)
    if not p.is_file():
        return set()
    rows, dropped = [], 0
    with p.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if isinstance(row, dict) and "id" in row and line.endswith("\n"):
                rows.append(line)
            else:
                dropped += 1
    counts: dict[str, int] = {}
    ids = []
    for line in rows:
        rid = str(json.loads(line)["id"])
        ids.append(rid)
        counts[rid] = counts.get(rid, 0) + 1
    done = {rid for rid, n in counts.items() if n >= per_id}
    keep = [line for line, rid in zip(rows, ids) if rid in done]
    if dropped or len(keep) != len(rows):
        log.info("%s: dropping %d incomplete line(s) before resuming", p, dropped + len(rows) - len(keep))
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        tmp.write_text("".join(keep), encoding="utf-8")
        os.replace(tmp, p)
    return done


class LineSink:
    """Appends JSON lines, flushed and fsynced per record group (a kill loses at most one batch)."""

    def __init__(self, path: str | os.PathLike, mode: str = "a"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open(mode, encoding="utf-8")

    def write(self, rows: Iterable[dict]) -> None:
        self._fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


# ------------------------------------------------------------------------------------------- CLI
def sampling_from_args(args, cfg: Config, n: int = 1):

    max_tokens = args.max_new_tokens if args.max_new_tokens is not None else cfg.rollout.max_completion_length
    if max_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {max_tokens}")
    temperature = float(args.temperature)
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    return SamplingParams(n=n, temperature=temperature, top_p=float(getattr(args, "top_p", 1.0)),
                          top_k=int(getattr(args, "top_k", 0)), max_tokens=int(max_tokens),
                          stop=tuple(cfg.rollout.stop), seed=cfg.seed)


def run_infer(args) -> int:
    """``streamgrpo infer``: single prompt or resumable batch; returns the exit code."""

    batch = _check_infer_args(args)
    model = checkpoint_of(args.model)
    cfg = resolve_config(args.config, args.overrides, model, args.format)
    sampling = sampling_from_args(args, cfg)

    if batch:
        todo, no_truth, errors = _batch_todo(args, cfg)
    else:
        try:
            todo, no_truth, errors = [single_record(args.prompt, args.video, args.image)], {"single"}, []
        except DataError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if not todo:
        print(f"nothing to do: every record of {args.input} is in {args.output}", file=sys.stderr)
        return 0
    return _answer_todo(args, model, cfg, sampling, todo, no_truth, len(errors), batch)


def _check_infer_args(args) -> bool:
    """Reject contradictory ``infer`` arguments; returns whether this is a batch run (``--input``)."""
    batch = args.input is not None
    if batch and (args.prompt or args.video or args.image):
        raise ConfigError("use either --input (batch) or --prompt with --video/--image (single), not both")
    if not batch and not args.prompt:
        raise ConfigError("give --prompt (with --video/--image) for one answer, or --input and --output for a batch")
    if batch and not args.output:
        raise ConfigError("batch mode needs --output (the results JSONL; re-running continues it)")
    engine = engine_choice(args.engine, args.adapter, ENGINE_OPTION["infer"])
    if args.batch_size is None:
        args.batch_size = BATCH_SIZE[engine]
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    return batch


def _batch_todo(args, cfg: Config) -> tuple[list, set, list]:
    """The ``--input`` records not yet in ``--output`` (a re-run continues), the ids without a
    ground truth and the records that could not be read (reported)."""
    records, errors, no_truth = read_input_records(args.input, cfg.data)
    for err in errors:
        report_bad(err)
    done = completed_ids(args.output)
    todo = [r for r in records if r.id not in done]
    if done:
        print(f"resuming: {len(done)} record(s) already in {args.output}, {len(todo)} to go", file=sys.stderr)
    return todo, no_truth, errors


def _answer_todo(args, model: str, cfg: Config, sampling, todo: list, no_truth: set, unread: int,
                 batch: bool) -> int:
    """Answer ``todo`` in batches, each record's rows appended to ``--output`` (and the single answer
    printed); returns the exit code."""

    engine = args.engine
    policy = load_policy(model, cfg, args.adapter, engine=engine, records=todo, role="infer",
                         custom_mask=cfg.learner.shared_prompt)
    rewards = RewardSet(cfg) if len(no_truth) < len(todo) else None
    sink = LineSink(args.output) if args.output else None
    bad: list[Exception] = []
    written = 0

    def emit(record, group) -> None:
        nonlocal written
        rows = result_rows(record, group, rewards, cfg.data, has_truth=record.id not in no_truth)
        if sink is not None:
            sink.write(rows)
        written += 1
        if not batch:
            print(rows[0]["completion"])
            if rows[0]["answer"] is not None:
                print(f"answer: {rows[0]['answer']}", file=sys.stderr)

    def on_error(exc: Exception) -> None:
        bad.append(exc)
        report_bad(exc)

    try:
        run_batches(policy, todo, cfg.data, sampling, batch_size=args.batch_size, emit=emit, on_error=on_error)
    except KeyboardInterrupt:
        if batch:
            print(f"\ninterrupted after {written} record(s); run the same command again to continue",
                  file=sys.stderr)
        return 130
    finally:
        if sink is not None:
            sink.close()
        policy.close()
    if batch:
        print(f"{written} record(s) written to {args.output} in {policy.calls} {engine} generate call(s); "
              f"{unread + len(bad)} skipped", file=sys.stderr)
    elif bad:
        return 1
    return 0
