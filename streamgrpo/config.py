"""One pydantic config for every streamgrpo process.

One YAML document with the sections ``model``, ``data``, ``rollout``, ``rewards``, ``loss``,
``learner``, ``queue``, ``weights`` and ``metrics`` (plus ``run_dir`` and ``seed``); every field is
bounded where a bound makes sense and documented by the docstring under it. Unknown keys are errors
naming the key, value and file. ``--set section.key=value`` overrides a value (parsed as YAML, then
validated). Seed-era flat names (``grpo_beta``, ``format_reward_weight`` ...) are mapped to their
section with a one-line notice on stderr. No torch here: the CLI loads configs before importing it.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from streamgrpo.config_aliases import ALIASES, REWARD_WEIGHT_ALIASES
from streamgrpo.config_sections import (  # noqa: F401 - part of this module's API
    DataConfig,
    RolloutConfig,
    TemporalContrastConfig,
    VllmConfig,
    _Section,
)


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key, the value and the source."""


# --------------------------------------------------------------------------------------- model
class LoraConfig(_Section):
    r: int = Field(16, ge=1, le=1024)
    """LoRA rank."""
    alpha: int = Field(32, ge=1, le=4096)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names (suffixes) of the language model that get adapters."""
    quantize_4bit: bool = False
    """QLoRA: load the frozen base in 4-bit NF4 with bitsandbytes (CUDA only)."""


class ModelConfig(_Section):
    name_or_path: str = "Qwen/Qwen2.5-VL-3B-Instruct"
    """Hub id or local directory of the policy (a Qwen2.5-VL or Qwen3-VL checkpoint)."""
    arch: Literal["auto", "qwen2_5_vl", "qwen3_vl"] = "auto"
    """Model family; `auto` reads it from the checkpoint's config.json."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype for the rollout engine and (unless learner.bf16 is false) the learner."""
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"
    """Attention kernel. flash_attention_2 needs CUDA and the flash-attn package."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) to load."""
    tiny_if_missing: bool = False
    """CPU demo: when name_or_path does not exist, build a tiny random model there and teach it the answer format."""
    warm_pixels: Optional[int] = Field(None, ge=28 * 28, le=16384 * 28 * 28)
    """Pixels per frame for that format warm start (its data.min_pixels and max_pixels); null: the data section's. The warm-up only teaches the format, and `demo-motion` warms its 56x56 clips at their own size while training at 112x112 (README)."""
    warm_letters: Literal["uniform", "marginal"] = "uniform"
    """How that format warm start treats the option letter: `uniform` makes every prompt's answer flat over its
    options; `marginal` only makes every option as frequent on average, so a prompt's answer can still depend on
    its video (on the motion demo it sped up learning with labels, not GRPO; README)."""
    tune_mm_llm: bool = True
    """Train the language model (decoder layers, embeddings, lm_head)."""
    tune_mm_mlp: bool = True
    """Train the vision-language merger (projector)."""
    tune_mm_vision: bool = False
    """Train the vision encoder blocks."""
    lora: Optional[LoraConfig] = None
    """LoRA/QLoRA adapters; null trains full weights."""


# ------------------------------------------------------------------------------------- rewards
class RewardSpec(_Section):
    name: str
    """Built-in reward name (format, accuracy, numeric, ...) or `module:function` for a custom one."""
    weight: float = Field(1.0, ge=-1000.0, le=1000.0)
    """Weight in the total reward (total = sum of weight * value)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword parameters passed to the reward factory."""


class RewardsConfig(_Section):
    functions: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="format", weight=0.3), RewardSpec(name="accuracy", weight=0.7)]
    )
    """Reward functions and weights; the message keeps every value and the weighted total."""
    timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """A reward call slower than this scores 0 for its completions and counts an error."""
    debug_log: Optional[str] = None
    """Append one JSON line per completion (prompt id, text, each reward, total, ground truth) here."""

    @model_validator(mode="before")
    @classmethod
    def _accept_list(cls, value: Any) -> Any:
        if isinstance(value, list):
            return {"functions": value}
        return value


# ---------------------------------------------------------------------------------------- loss
class LossConfig(_Section):
    epsilon: float = Field(0.2, ge=0.0, le=10.0)
    """Lower clip: ratios below 1-epsilon stop contributing gradient (for A<0)."""
    epsilon_high: float = Field(0.28, ge=0.0, le=10.0)
    """Upper clip: ratios above 1+epsilon_high stop contributing gradient (for A>0)."""
    beta: float = Field(0.0, ge=0.0, le=100.0)
    """KL (k3) penalty weight against the reference model; 0 loads no reference model."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """Token aggregation: grpo (per-sequence mean), bnpo (batch token mean), dr_grpo (sum / B*L), dapo (global token mean)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by the group's std, the batch std, or not at all."""
    adv_eps: float = Field(1e-4, gt=0.0, le=1.0)
    """Added to the std when scaling advantages."""
    max_staleness: int = Field(4, ge=0, le=1_000_000)
    """Groups whose policy version is more than this many steps behind the learner are dropped."""
    tis_cap: Optional[float] = Field(None, gt=0.0)
    """Truncated importance sampling cap on exp(logp - behaviour logp) (null = off)."""
    is_mask: Optional[Literal["token", "sequence"]] = "token"
    """Masked importance sampling (MIS): drop the objective of tokens (token) or whole completions (sequence, by their geometric-mean ratio) whose exp(logp - behaviour logp) leaves [is_mask_low, is_mask_high]; null = off. Default token: the best final accuracy at lag 8 in the staleness study (benchmarks/bench_staleness.py)."""
    is_mask_low: float = Field(0.5, ge=0.0, lt=1.0)
    """Lower end of the MIS band."""
    is_mask_high: float = Field(2.0, gt=1.0, le=1e6)
    """Upper end of the MIS band."""
    zero_variance_weight: float = Field(0.0, ge=0.0, le=1.0)
    """A group whose rewards are all equal (all wrong, or all right) gets this x (reward - the step's mean reward) / the step's reward std (no division with scale_rewards none; with several learner ranks, each rank's groups of the step) as its advantage instead of zeros: all-wrong answers are pushed down, so a policy that stopped sampling the right one gets a gradient (RL-ZVP's idea); 0 = plain GRPO. Not with drop_zero_variance."""
    drop_zero_variance: bool = False
    """Dynamic sampling (DAPO): drop groups whose G rewards are all equal (no gradient) before the step and take further groups instead (counted as groups_dropped{reason=zero_variance})."""
    fill_timeout_s: float = Field(60.0, gt=0.0, le=86400.0)
    """With drop_zero_variance: how long a step waits for enough informative groups before it trains on what it has (at least one per rank)."""
    ratio_mode: Literal["behaviour", "current", "decoupled"] = "behaviour"
    """Importance ratio of the clipped objective: `behaviour` = exp(logp - behaviour logp) (corrects stale groups); `current` = a naive loss that ignores the behaviour log-probs (staleness benchmark baseline); `decoupled` = decoupled PPO (AReaL): clip around the learner's own policy at the step, times the behaviour weight exp(logp - behaviour logp) (truncated at tis_cap when set)."""
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0)
    """Entropy bonus (verl's ``entropy_coeff``): subtracts this x each completion token's policy entropy (full vocabulary, at the sampling temperature), aggregated like the loss; 0 = off."""

    @model_validator(mode="after")
    def _zero_variance_choice(self):
        if self.drop_zero_variance and self.zero_variance_weight > 0:
            raise ValueError("loss.drop_zero_variance drops the groups loss.zero_variance_weight would train on: set one of them")
        return self


# ------------------------------------------------------------------------------------- learner
class LearnerConfig(_Section):
    backend: Literal["torch", "deepspeed"] = "torch"
    """Plain torch (one process) or DeepSpeed ZeRO (one or many ranks, launched by torchrun/deepspeed)."""
    deepspeed_config: Optional[str] = None
    """DeepSpeed JSON config (ZeRO stage etc.; see deploy/deepspeed/); null = built-in ZeRO-2. learner.bf16 and max_grad_norm override its bf16/gradient_clipping."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of a single-process learner."""
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend of DeepSpeed ranks: auto = NCCL (rank r on GPU LOCAL_RANK) when CUDA is visible and this host has a GPU per learner rank, else gloo with every rank on the CPU; nccl insists (an error when the GPUs do not go round); gloo keeps the ranks on their GPUs when they go round."""
    groups_per_step: int = Field(8, ge=1, le=65536)
    """Groups (prompts) consumed per optimizer step, summed over ranks."""
    micro_batch_tokens: Optional[int] = Field(None, ge=16)
    """Split a step's groups into micro-batches of at most this many decoder tokens (gradient accumulation; with shared_prompt a group's prompt counts once)."""
    learning_rate: float = Field(1e-6, gt=0.0, le=1.0)
    """Peak AdamW learning rate."""
    vision_lr: Optional[float] = Field(None, gt=0.0, le=1.0)
    """Peak learning rate of the vision tower (``model.visual.*`` without the merger); null = learning_rate. Like qwen-vl-finetune's ``vision_tower_lr``."""
    merger_lr: Optional[float] = Field(None, gt=0.0, le=1.0)
    """Peak learning rate of the vision-language merger (``model.visual.merger``); null = learning_rate. Like qwen-vl-finetune's ``mm_projector_lr``."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""
    adam_beta2: float = Field(0.99, ge=0.0, lt=1.0)
    """AdamW beta2."""
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0)
    """AdamW epsilon (TRL's ``adam_epsilon``)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule after warm-up (cosine/linear decay to 0 at max_steps)."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping norm."""
    max_update_kl: Optional[float] = Field(None, gt=0.0, le=100.0)
    """Bound on how far one optimizer step may move the policy: after each step the learner measures the change on the step's own completions (mean per-token KL, old to new) and halves the step until it is at most this (a backtracking line search; up to max_update_halvings times, then the step is undone). Adam moves every weight by about the learning rate whatever the gradient norm, so max_grad_norm does not bound a step. Costs one forward pass per try; torch backend only; null = off."""
    max_update_halvings: int = Field(4, ge=0, le=30)
    """With max_update_kl: halvings before a step is undone."""
    max_steps: int = Field(1000, ge=1)
    """Optimizer steps to train; `streamgrpo up` stops everything after this many."""
    get_timeout_s: float = Field(5.0, gt=0.0, le=3600.0)
    """How long one queue read waits for groups before counting idle time and retrying."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    checkpoint_every: int = Field(1, ge=1, le=1000)
    """With gradient_checkpointing: recompute only every n-th layer (vision blocks and decoder layers, counted in order; transformers' every_n_layers); the others keep their activations. 1 = every layer; 2 recomputes half of them: less recomputation for more memory."""
    checkpoint_offload: bool = False
    """With gradient_checkpointing on a GPU: hold the inputs saved for each recomputed layer in pinned host memory instead of on the GPU (transformers' offload); frees layers x tokens x hidden of GPU memory for two copies per layer and step."""
    shared_prompt: bool = False
    """Put each group's prompt in the forward once, its completions after it behind a block attention mask (each sees the prompt and itself), instead of once per completion: the decoder processes P + sum(C) tokens per group instead of G*P + sum(C). Same log-probs (to float rounding); needs model.attn_implementation sdpa or eager."""
    bf16: bool = False
    """bfloat16 training: autocast for the torch backend (float32 master weights for what trains, bf16 storage for what does not: a LoRA base, a frozen tower), DeepSpeed's bf16 mode for the deepspeed backend; false keeps float32."""
    save_steps: int = Field(100, ge=1)
    """Write a checkpoint every this many steps (and on SIGTERM)."""
    save_total_limit: Optional[int] = Field(3, ge=1)
    """Keep at most this many checkpoints (oldest deleted first)."""
    resume: bool = False
    """Continue from the newest checkpoint in the run directory."""
    fresh: bool = False
    """Start at step 0 although the run directory has checkpoints: they, metrics.jsonl and the learner's audit log are moved to <run_dir>/previous/<time>/ first. Without resume or fresh, a learner refuses to start over existing checkpoints."""
    replica_check_every: int = Field(0, ge=0)
    """Several ranks (ZeRO-0/1/2): every this many steps, compare a checksum of the weights across ranks and stop with an error if they differ (0 = off)."""
    peak_tflops: Optional[float] = Field(None, gt=0.0, le=1e6)
    """Peak dense TFLOP/s of one learner device at the training precision, for MFU (streamgrpo_learner_mfu, `mfu` in metrics.jsonl); null looks it up by the CUDA device's name (H100, H200, A100); on a CPU or an unlisted GPU MFU is then not reported."""


# --------------------------------------------------------------------------------------- queue
class QueueConfig(_Section):
    url: Optional[str] = None
    """Redis URL (redis://user:pass@host:port/db, rediss:// for TLS); null starts an embedded server."""
    namespace: str = Field("streamgrpo", min_length=1, max_length=128)
    """Key prefix: groups go to <namespace>:groups, dead letters to <namespace>:dead."""
    max_pending: int = Field(64, ge=1, le=1_000_000)
    """Producers block while the stream holds more than this many unread or unacked groups."""
    claim_idle_s: float = Field(120.0, gt=0.0)
    """Entries pending this long on another consumer are claimed (it is presumed dead)."""
    max_message_mib: float = Field(256.0, gt=0.0, le=512.0)
    """Messages larger than this are refused by producers and dead-lettered by consumers (Redis caps a value at 512 MiB)."""
    dedupe_ttl_s: int = Field(7 * 24 * 3600, ge=60)
    """How long trained group ids are remembered in Redis for de-duplication."""
    max_outage_s: Optional[float] = Field(None, gt=0.0)
    """Give up with an error after Redis has been unreachable this long; null retries (with backoff) forever."""
    max_failures: int = Field(3, ge=1, le=1000)
    """A group whose training raised this many times (counted in Redis, across learner restarts) is dead-lettered with the last error."""


# ------------------------------------------------------------------------------------- weights
class WeightsConfig(_Section):
    bind_host: str = "127.0.0.1"
    """Interface the learner binds the weight sockets to (0.0.0.0 to reach other machines; use CURVE keys then)."""
    connect_host: str = "127.0.0.1"
    """Host generators connect to for weights (the learner's address)."""
    pub_port: int = Field(5555, ge=0, le=65535)
    """PUB port for new versions (0 = pick a free one; `up` passes it on)."""
    snapshot_port: int = Field(5556, ge=0, le=65535)
    """ROUTER port serving the latest complete version to late joiners."""
    chunk_mib: float = Field(8.0, gt=0.0, le=1024.0)
    """Chunk size of one multipart weight message."""
    sync_every: int = Field(1, ge=1)
    """Publish weights every this many optimizer steps."""
    curve_keys_dir: Optional[str] = None
    """Directory made by `streamgrpo keys`: enables CURVE encryption and client authorisation."""
    sndhwm: int = Field(64, ge=1)
    """Minimum PUB high-water mark in messages; raised automatically to hold two versions (a subscriber that falls further behind repairs through the snapshot endpoint)."""
    transport: Literal["tcp", "ipc", "shm"] = "tcp"
    """How generators reach the weights: tcp (any host); ipc (unix sockets in <run_dir>/ipc: generators on the learner's host; the learner listens on TCP as well); shm (as ipc, but each version's bytes are read from the learner's shared-memory file in shm_dir instead of being sent: no socket copy at all)."""
    shm_dir: str = "/dev/shm"
    """transport=shm: the directory (a tmpfs) where the learner keeps its version files, which the generators on its host map."""
    send_frozen: bool = False
    """Also send frozen parameters with every version (they never change, and generators load them from the same checkpoint; LoRA mode sends adapters only either way)."""
    host_buffers: int = Field(3, ge=2, le=16)
    """Pinned host buffers of the learner's CUDA export (one version each, pinned once at the first publish): the latest version, the one going out, one spare."""
    io_threads: int = Field(1, ge=1, le=64)
    """ZeroMQ I/O threads of the learner's weight sockets (more help when many subscribers pull at once on a many-core host)."""
    warn_every_s: float = Field(30.0, gt=0.0)
    """Generator: while it has never received weights, and whenever the learner refuses its connection (CURVE key not authorised, wrong server key, CURVE on one side only), log a WARNING with the reason this often (checked between batches; counted in streamgrpo_errors_total{kind="weights_missing"|"weights_refused"})."""
    max_wait_s: Optional[float] = Field(600.0, ge=0.0)
    """Generator: give up (one-line error, exit code 3) when no weights have arrived this many seconds after its model and engine are ready; meanwhile it keeps generating with its initial weights (v0). 0 or null: wait forever. Once a version has arrived it never gives up."""


# ------------------------------------------------------------------------------------- metrics
class WandbConfig(_Section):
    project: str = "streamgrpo"
    """wandb project."""
    run_name: Optional[str] = None
    """wandb run name (default: the run directory's name)."""
    mode: Literal["online", "offline", "disabled"] = "offline"
    """offline writes a local run directory that `wandb sync` can upload later."""


class MetricsConfig(_Section):
    host: str = "127.0.0.1"
    """Interface of the /metrics and /healthz HTTP server: this machine only by default; 0.0.0.0 lets a Prometheus on another host or container scrape it (docker-compose.yml and deploy/k8s set that)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of /metrics (0 = pick a free one and log it)."""
    log_every: int = Field(1, ge=1)
    """Print a progress line every this many steps."""
    sample_every: int = Field(50, ge=1)
    """Log a table of sample completions every this many steps."""
    wandb: Optional[WandbConfig] = None
    """wandb logging (null = off)."""


# ---------------------------------------------------------------------------------------- root
class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    run_dir: str = "runs/latest"
    """Run directory: logs, metrics.jsonl, checkpoints, summary and plots."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed for sampling, shuffling and initialisation."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @field_validator("run_dir")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _checkpointing_knobs(self) -> Config:
        lc = self.learner
        if (lc.checkpoint_every > 1 or lc.checkpoint_offload) and not lc.gradient_checkpointing:
            knob = "checkpoint_every" if lc.checkpoint_every > 1 else "checkpoint_offload"
            raise ValueError(f"learner.{knob} applies to recomputed layers: set learner.gradient_checkpointing to "
                             "true, or leave it out")
        return self

    @model_validator(mode="after")
    def _shared_prompt_attention(self) -> Config:
        if self.learner.shared_prompt and self.model.attn_implementation == "flash_attention_2":
            raise ValueError("learner.shared_prompt needs a custom attention mask: set model.attn_implementation "
                             "to sdpa or eager, or learner.shared_prompt to false")
        return self

    def advice(self) -> list[str]:
        """Settings that are valid but work against each other: one line each, for a startup warning."""
        held = self.learner.save_steps * self.learner.groups_per_step
        if held <= 10_000:
            return []
        return [f"learner.save_steps x groups_per_step = {held}: Redis keeps that many trained groups' messages until "
                "the checkpoint that commits them (exactly-once training); a smaller save_steps bounds it"]

    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        """The config as plain data; ``redact`` masks secrets (:func:`streamgrpo.config_redact.redact_secrets`)."""
        tree = self.model_dump(mode="json")
        if redact:
            from streamgrpo.config_redact import redact_secrets

            tree = redact_secrets(tree)
        return tree

    def to_yaml(self, redact: bool = False) -> str:
        return yaml.safe_dump(self.to_dict(redact), sort_keys=False)


SECTIONS = ("model", "data", "rollout", "rewards", "loss", "learner", "queue", "weights", "metrics")

def _notice(msg: str) -> None:
    print(f"streamgrpo config: {msg}", file=sys.stderr)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])!r} is not a section")
        node = child
    node[parts[-1]] = value


def _apply_aliases(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """Move seed-era top-level names to their sections, with a one-line notice each."""
    tree = dict(tree)
    reward_weights: dict[str, Any] = {}
    batch_completions = None
    for name in list(tree):
        if name in ALIASES:
            target = ALIASES[name]
            value = tree.pop(name)
            if name == "deepspeed":
                _set_dotted(tree, "learner.backend", "deepspeed")
            _notice(f"{source}: seed-era key {name!r} mapped to {target!r}")
            _set_dotted(tree, target, value)
        elif name in REWARD_WEIGHT_ALIASES:
            reward_weights[REWARD_WEIGHT_ALIASES[name]] = tree.pop(name)
            _notice(f"{source}: seed-era key {name!r} mapped to the weight of reward {REWARD_WEIGHT_ALIASES[name]!r}")
        elif name == "per_device_train_batch_size":
            batch_completions = tree.pop(name)
    if reward_weights:
        rewards = tree.setdefault("rewards", {})
        if isinstance(rewards, list):
            rewards = tree["rewards"] = {"functions": rewards}
        functions = rewards.get("functions")
        if functions is None:
            functions = rewards["functions"] = [
                {"name": s.name, "weight": s.weight, "params": dict(s.params)} for s in RewardsConfig().functions
            ]
        for fname, weight in reward_weights.items():
            for spec in functions:
                if isinstance(spec, dict) and spec.get("name") == fname:
                    spec["weight"] = weight
                    break
            else:
                functions.append({"name": fname, "weight": weight})
    if batch_completions is not None:
        g = tree.get("rollout", {}).get("num_generations", RolloutConfig().num_generations)
        try:
            groups = max(1, math.ceil(int(batch_completions) / int(g)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: per_device_train_batch_size={batch_completions!r} is not an integer") from exc
        _notice(f"{source}: per_device_train_batch_size={batch_completions} completions mapped to learner.groups_per_step={groups}")
        _set_dotted(tree, "learner.groups_per_step", groups)
    return tree


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value is parsed as YAML (``1`` -> int, ``true`` -> bool)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _format_validation_error(exc: ValidationError, tree: Mapping[str, Any], source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc) or "<root>"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key {key!r} (value {value!r})")
        elif err["type"] == "finite_number":  # NaN/inf: not "should be <= 1", which would mislead
            got = value if isinstance(value, str) else repr(value)
            lines.append(f"{source}: {key}: must be a finite number, got {got}")
        else:
            lines.append(f"{source}: {key} = {value!r}: {err['msg']}")
    return "\n".join(lines)


def find_config(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped config (``demo`` -> streamgrpo/configs/demo.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = resources.files("streamgrpo") / "configs" / f"{Path(str(name_or_path)).stem}.yaml"
    if str(name_or_path).endswith((".yaml", ".yml")) and not shipped.is_file():
        raise ConfigError(f"config file {str(name_or_path)!r} not found")
    if shipped.is_file():
        return Path(str(shipped))
    raise ConfigError(
        f"config {str(name_or_path)!r} is neither a file nor a shipped config (shipped: {', '.join(shipped_configs())})"
    )


def shipped_configs() -> list[str]:
    folder = resources.files("streamgrpo") / "configs"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def build_config(tree: Mapping[str, Any] | None = None, overrides: Iterable[str] = (), source: str = "<dict>") -> Config:
    """Validate a raw tree plus ``--set`` overrides into a Config (errors name key, value, source)."""
    tree = copy.deepcopy(dict(tree or {}))
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    tree = _apply_aliases(tree, source)
    for item in overrides:
        key, value = parse_override(item)
        flat = {key: value} if key in ALIASES or key in REWARD_WEIGHT_ALIASES or key == "per_device_train_batch_size" else None
        if flat is not None:
            merged = _apply_aliases(flat, f"--set {item}")
            _deep_merge(tree, merged)
        else:
            _set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        overridden = ", ".join(f"--set {o}" for o in overrides)
        where = source + (f" (with {overridden})" if overridden else "")
        raise ConfigError(_format_validation_error(exc, tree, where)) from None


def _deep_merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def load_config(name_or_path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load a YAML config (a path or a shipped name) and apply ``--set`` overrides."""
    overrides = list(overrides)
    if name_or_path is None:
        return build_config({}, overrides, source="<defaults>")
    path = find_config(name_or_path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(tree).__name__}")
    return build_config(_expand_env(tree), overrides, source=str(path))


def _expand_env(node: Any) -> Any:
    """Expand ``${VAR}`` in string values (compose/k8s pass secrets such as REDIS_PASSWORD this way)."""
    if isinstance(node, dict):
        return {k: _expand_env(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_env(v) for v in node]
    if isinstance(node, str) and "$" in node:
        return os.path.expandvars(node)
    return node
