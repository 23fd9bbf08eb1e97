"""The ``launch`` section: how ``streamgrpo up`` places its processes on one node's devices
(:mod:`streamgrpo.commands.placement`); the ``up`` flags ``--gpus``, ``--learner-ranks``,
``--generators-per-gpu`` and ``--colocate`` override it. Processes started one by one
(``streamgrpo learner`` / ``generator``, compose, k8s) are placed by their launcher instead."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from streamgrpo.sections import ConfigError, Section


class LaunchConfig(Section):
    gpus: Optional[str] = Field(None, pattern=r"^\s*(cpu|none|\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*)?\s*$")
    """The GPUs `streamgrpo up` places its processes on: `0-7`, `0,1,4-5`, or `cpu`; null: every visible CUDA device (none: the CPU)."""
    learner_ranks: int = Field(1, ge=1, le=1024)
    """Learner ranks: more than one runs the learner under torchrun (python -m streamgrpo.learner.ranks: torchrun, its stop or a failed rank in one line), one GPU each (NCCL), or gloo ranks on the CPU; they need learner.backend=deepspeed, which `up` then sets."""
    generators_per_gpu: int = Field(1, ge=1, le=64)
    """Generators that share one GPU (each takes its share of the memory: set rollout.vllm.gpu_memory_utilization to match)."""
    agreement_check: bool = True
    """Before `up` trains: sample one group with the generator's engine and recompute it along the learner's path (streamgrpo check agreement); refuse to start in one line when they disagree beyond learner.agreement_max_kl. false skips it."""
    colocate: bool = False
    """Put generators on the learner's GPUs too (after any spare ones), when the memory plan allows it."""

    @field_validator("gpus", mode="before")
    @classmethod
    def _one_device_is_a_number(cls, v):
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


def backend_for_ranks(backend: str, ranks: int, sequence_parallel: int) -> str:
    """The learner backend ``ranks`` learner ranks run on (``up`` and ``config memory`` alike): one rank, or one
    sequence-parallel group of ``learner.sequence_parallel`` ranks, keeps ``backend``; more ranks replicate the
    model and need DeepSpeed. ``ranks`` that are not a multiple of ``sequence_parallel`` are a ConfigError."""
    if ranks % sequence_parallel:
        raise ConfigError(f"{ranks} learner ranks: learner.sequence_parallel={sequence_parallel} needs a multiple of "
                          f"{sequence_parallel} ranks")
    return "deepspeed" if backend == "torch" and ranks > sequence_parallel else backend
