"""``streamgrpo model export``: a checkpoint in the layout of a model repository on the Hugging Face Hub.

The output directory holds what ``from_pretrained`` and the Hub read, and nothing of the training
state (optimizer, RNG, ``trainer_state.json``, DeepSpeed's files, ``eval/`` outputs):

* the weights as safetensors with ``config.json`` / ``generation_config.json`` -- copied as the learner
  saved them (``save_pretrained``), or, for a LoRA checkpoint, the adapter merged into its base model
  (default) or kept as a peft adapter (``adapter_config.json`` + ``adapter_model.safetensors``);
* the processor and tokenizer files of the checkpoint;
* ``README.md``, the model card: the Hub's metadata block (base model, library, pipeline, tags), the
  learner's card of the run (:func:`streamgrpo.models.card.model_card`: data, rewards, loss, steps and the
  metrics of the checkpoint's step from ``<run>/metrics.jsonl``), the evaluation of this checkpoint by
  ``streamgrpo eval`` (``<checkpoint>/eval/eval.md``), the held-out accuracy over training from the
  evaluator (``<run>/eval.jsonl``, up to the checkpoint's version), and the run's whole config
  (``<run>/config.yaml``, secrets masked).

The run's files are found beside the checkpoint (``<run>/checkpoints/step-N``); each part of the card
that has no file is left out. :func:`model_files`, :func:`metrics_at`, :func:`eval_history` and
:func:`export_card` are pure; :func:`export_checkpoint` reads and writes.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from streamgrpo.config import ConfigError, load_config
from streamgrpo.config.redact import redact_secrets
from streamgrpo.models.card import model_card
from streamgrpo.models.lora import load_merged
from streamgrpo.runtime.jsonl import read_rows

log = logging.getLogger(__name__)

MODEL_FILES = ("*.safetensors", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
"""What a model directory's files look like: weights, configs, tokenizer and processor files."""
TRAINING_STATE = ("optimizer.safetensors", "rng.safetensors", "rng-rank*", "trainer_state.json", "README.md")
"""Files of a checkpoint that are not the model (the card is written anew)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
WEIGHT_FILES = ("model.safetensors", "model-*.safetensors", "model.safetensors.index.json")


class ExportError(ValueError):
    """A checkpoint that cannot be exported as asked, or an output directory in the way (one line)."""


# ------------------------------------------------------------------------------------------ pure
def model_files(names: Iterable[str], *, adapter: bool, merged: bool = False) -> list[str]:
    """The files of a checkpoint directory (top-level ``names``) that an export copies: a full-weight or
    adapter checkpoint's model files; ``merged``: the processor and tokenizer files only (the merge writes
    the weights and config)."""
    def any_of(name: str, patterns: Iterable[str]) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    keep = []
    for name in sorted(names):
        if not any_of(name, MODEL_FILES) or any_of(name, TRAINING_STATE):
            continue
        if merged and (any_of(name, ADAPTER_FILES) or any_of(name, WEIGHT_FILES)
                       or name in ("config.json", "generation_config.json")):
            continue
        if not adapter and any_of(name, ADAPTER_FILES):
            continue
        keep.append(name)
    return keep


def metrics_at(lines: Iterable[Mapping[str, Any]], step: int) -> dict[str, Any] | None:
    """The ``metrics.jsonl`` line of optimizer step ``step`` (the last one written for it: a resumed run may
    have written a step twice), else None."""
    found = None
    for line in lines:
        if line.get("step") == step:
            found = dict(line)
    return found


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def eval_history(lines: Iterable[Mapping[str, Any]], version: int | None) -> list[list[str]]:
    """Table rows (header first) of the evaluator's ``eval.jsonl`` lines up to weight version ``version``
    (None: all): version, records, accuracy, each question kind's accuracy, format compliance, completion
    length. Only the header when no line qualifies."""
    rows = [ln for ln in lines if isinstance(ln.get("version"), int) and (version is None or ln["version"] <= version)]
    kinds = sorted({k for ln in rows for k in (ln.get("by_kind") or {})})
    table = [["version", "records", "accuracy", *[f"accuracy ({k})" for k in kinds], "format", "completion tokens"]]
    for ln in sorted(rows, key=lambda ln: ln["version"]):
        by_kind = ln.get("by_kind") or {}
        table.append([str(ln["version"]), _num(ln.get("records")), _num(ln.get("accuracy")),
                      *[_num((by_kind.get(k) or {}).get("accuracy")) for k in kinds],
                      _num(ln.get("format_compliance")), _num(ln.get("completion_tokens"))])
    return table


def split_front_matter(text: str) -> tuple[dict[str, Any], str]:
    """A model card's YAML metadata block and the rest (``({}, text)`` without one)."""
    if text.startswith("---\n"):
        end = text.find("\n---", 4)
        if end != -1:
            meta = yaml.safe_load(text[4:end]) or {}
            return (meta if isinstance(meta, dict) else {}), text[end + 4:].lstrip("\n")
    return {}, text


def is_hub_id(name: str | None) -> bool:
    """Whether ``name`` reads as a Hub repository id (``org/name``), not a local directory."""
    return bool(name) and not Path(name).expanduser().exists() and name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def _eval_section(eval_md: str) -> str:
    """``streamgrpo eval``'s ``eval.md`` under the card's headings: its title dropped, its headings one level
    down, the line naming the raw output files (not exported) left out."""
    out = []
    for line in eval_md.strip().splitlines():
        if line.startswith("# "):
            continue
        if line.startswith("Raw completions:"):
            continue
        out.append("#" + line if line.startswith("##") else line)
    return "\n".join(out).strip()


def export_card(*, body: str, base_model: str | None, adapter: bool, lora: Mapping[str, Any] | None, step: int | None,
                eval_md: str | None, history: list[list[str]], config_yaml: str | None) -> str:
    """The exported model's ``README.md``: the Hub's metadata block, ``body`` (the run's card without its own
    metadata and "Use" section), the evaluation, the accuracy over training, how it was exported and how to
    load it, the run's config."""
    meta: dict[str, Any] = {}
    if base_model and is_hub_id(base_model):
        meta["base_model"] = base_model
    meta["library_name"] = "peft" if adapter else "transformers"
    meta["pipeline_tag"] = "image-text-to-text"
    meta["tags"] = ["streamgrpo", "grpo", "video", "qwen-vl"] + (["lora"] if lora else [])
    text = body.split("\n## Use\n")[0].rstrip()
    parts = ["---\n" + yaml.safe_dump(meta, sort_keys=False) + "---", text]
    if eval_md:
        parts.append("## Evaluation (`streamgrpo eval` of this checkpoint)\n\n" + _eval_section(eval_md))
    if len(history) > 1:
        parts.append("## Held-out accuracy during training (`streamgrpo evaluator`)\n\n" + _markdown_table(history))
    at = f"step {step}" if step is not None else "a checkpoint"
    if lora and adapter:
        how = (f"A LoRA adapter (r = {lora.get('r')}, alpha = {lora.get('lora_alpha')}) on `{base_model}`, exported "
               f"from {at} with `streamgrpo model export --adapter`.")
        use = ("```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForImageTextToText, AutoProcessor\n"
               f"base = AutoModelForImageTextToText.from_pretrained(\"{base_model}\")\n"
               "model = PeftModel.from_pretrained(base, \"path/or/repo-id\")\n"
               "processor = AutoProcessor.from_pretrained(\"path/or/repo-id\")\n```")
    else:
        how = (f"Exported from {at} with `streamgrpo model export`"
               + (f": the LoRA adapter (r = {lora.get('r')}, alpha = {lora.get('lora_alpha')}) merged into `{base_model}`; "
                  "no peft needed." if lora else ": the weights as trained."))
        use = ("```python\nfrom transformers import AutoModelForImageTextToText, AutoProcessor\n"
               "model = AutoModelForImageTextToText.from_pretrained(\"path/or/repo-id\")\n"
               "processor = AutoProcessor.from_pretrained(\"path/or/repo-id\")\n```\n"
               "or `streamgrpo infer --model path/or/repo-id --video clip.mp4 --prompt \"...\"`.")
    parts.append(f"## Export\n\n{how}\n\n## Use\n\n{use}")
    if config_yaml:
        parts.append("## Training config\n\nThe run's whole config (`streamgrpo config show` of it; secrets masked):\n\n"
                     f"```yaml\n{config_yaml.rstrip()}\n```")
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------ the run's files
@dataclass(frozen=True)
class RunFiles:
    """What an export reads besides the checkpoint's own files (None: not there)."""

    checkpoint: Path
    config: Path | None
    metrics: Path | None
    eval_history: Path | None
    eval_md: Path | None

    @classmethod
    def of(cls, checkpoint: str | Path, config: str | Path | None = None) -> RunFiles:
        """The files of the run that wrote ``checkpoint`` (``<run>/checkpoints/step-N``); ``config``: the run's
        config file when its run directory has none (a learner started without ``streamgrpo up``)."""
        ckpt = Path(checkpoint)
        run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None

        def there(p: Path | None) -> Path | None:
            return p if p is not None and p.is_file() else None

        return cls(ckpt, Path(config) if config else there(run / "config.yaml" if run else None),
                   there(run / "metrics.jsonl" if run else None), there(run / "eval.jsonl" if run else None),
                   there(ckpt / "eval" / "eval.md"))


def _run_config(path: Path | None) -> tuple[Any, str | None]:
    """(the run's Config or None, its YAML with secrets masked or None)."""
    if path is None:
        return None, None
    try:
        cfg = load_config(str(path))
    except ConfigError as exc:  # an older run's config: shown as written (masked), no card from it
        log.warning("%s does not load as this release's config (%s): the card shows it as written", path, exc)
        return None, yaml.safe_dump(redact_secrets(yaml.safe_load(path.read_text()) or {}), sort_keys=False)
    return cfg, cfg.to_yaml(redact=True)


def _card_body(files: RunFiles, cfg, trainer_state: dict[str, Any]) -> str:
    """The run's card: made from its config (the learner's own card, with the metrics of the checkpoint's
    step), else the checkpoint's card when the learner wrote one, else a title."""
    step = trainer_state.get("step")
    if cfg is not None:
        state = {"step": step or 0, **(trainer_state.get("learner") or {})}
        return split_front_matter(model_card(cfg, state, metrics_at(read_rows(files.metrics)[0], step)))[1]
    readme = files.checkpoint / "README.md"
    if readme.is_file() and "streamgrpo" in readme.read_text():
        return split_front_matter(readme.read_text())[1]
    return f"# {files.checkpoint.name}: GRPO-trained with streamgrpo\n\n- **Steps:** {step if step is not None else '?'}"


# ----------------------------------------------------------------------------------------- export
def export_checkpoint(checkpoint: str | Path, out: str | Path, *, adapter: bool = False, base: str | None = None,
                      config: str | Path | None = None) -> Path:
    """Write ``checkpoint`` (a learner checkpoint or any ``save_pretrained`` directory) to ``out`` in the Hub's
    layout (module docstring). A LoRA checkpoint is merged into its base model (``base``, default the adapter's
    ``base_model_name_or_path``) unless ``adapter``, which keeps the adapter (``base`` then replaces the base
    model it names: a Hub id users can load). Returns ``out``."""
    ckpt, out = Path(checkpoint), Path(out)
    is_lora = (ckpt / "adapter_config.json").is_file()
    if not is_lora and not (ckpt / "config.json").is_file():
        raise ExportError(f"{ckpt}: no config.json or adapter_config.json (not a checkpoint or model directory)")
    if adapter and not is_lora:
        raise ExportError(f"{ckpt}: --adapter needs a LoRA checkpoint (adapter_config.json); this one has full weights")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty")
    files = RunFiles.of(ckpt, config)
    trainer_state = json.loads((ckpt / "trainer_state.json").read_text()) if (ckpt / "trainer_state.json").is_file() else {}
    cfg, config_yaml = _run_config(files.config)
    lora = json.loads((ckpt / "adapter_config.json").read_text()) if is_lora else None
    base_model = base or (lora or {}).get("base_model_name_or_path") or (cfg.model.name_or_path if cfg else None)
    if is_lora and not base_model:
        raise ExportError(f"{ckpt / 'adapter_config.json'}: no base_model_name_or_path; pass --base")

    tmp = out.with_name(out.name + ".tmp")  # written here, renamed when complete: no half export at ``out``
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    merged = is_lora and not adapter
    if merged:
        load_merged(ckpt, base_model).save_pretrained(tmp, safe_serialization=True)
    for name in model_files((p.name for p in ckpt.iterdir() if p.is_file()), adapter=is_lora, merged=merged):
        shutil.copy2(ckpt / name, tmp / name)
    if is_lora and adapter and base:
        (tmp / "adapter_config.json").write_text(json.dumps({**lora, "base_model_name_or_path": base}, indent=2) + "\n")
    elif is_lora and adapter and not is_hub_id(base_model):
        log.warning("adapter_config.json names a local base model (%s): pass --base ORG/NAME so that users of the "
                    "exported adapter can load it", base_model)
    step = trainer_state.get("step")
    version = (trainer_state.get("learner") or {}).get("version", step)
    (tmp / "README.md").write_text(export_card(
        body=_card_body(files, cfg, trainer_state), base_model=base_model, adapter=adapter, lora=lora, step=step,
        eval_md=files.eval_md.read_text() if files.eval_md else None,
        history=eval_history(read_rows(files.eval_history)[0], version), config_yaml=config_yaml))
    if out.exists():
        out.rmdir()  # empty (checked above)
    tmp.rename(out)
    log.info("exported %s -> %s", ckpt, out)
    return out
