"""Which attention kernel a role loads the policy with: ``model.attn_implementation`` resolved.

``auto`` (the default) takes the best kernel installed: flash_attention_2 where the flash-attn package
imports and the model goes to an NVIDIA GPU, else sdpa (on ROCm too, where ``torch.version.hip`` is set:
PyTorch's sdpa has its own flash kernels there, and ROCm's flash-attn builds are untested here; ask for
flash_attention_2 by name to use one); ``learner.shared_prompt`` needs a custom attention mask,
which flash-attention 2 cannot take, so with it ``auto`` is sdpa everywhere (every role resolves the
same way from the same config, so the generator and the learner run the same kernel). flash_attention_2
asked for where it cannot run (flash-attn not installed, or no CUDA) falls back to sdpa with one warning
naming the setting, as TRL's users expect, instead of transformers' own error at load time.

:func:`choose` is the pure decision; :func:`resolve` looks at the machine and logs it.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import NamedTuple

log = logging.getLogger(__name__)

FLASH = "flash_attention_2"
SDPA = "sdpa"


class Choice(NamedTuple):
    kernel: str
    """What goes to ``from_pretrained(attn_implementation=...)``."""
    line: str
    """One line saying what was picked and why."""
    fallback: bool
    """The kernel asked for could not be used (a warning, not an info line)."""


def choose(asked: str, *, cuda: bool, flash_attn: bool, custom_mask: bool = False, rocm: bool = False) -> Choice:
    """The kernel for ``model.attn_implementation=asked`` on a machine with/without CUDA on the model's
    device and the flash-attn package; ``custom_mask``: the learner packs prompts (``learner.shared_prompt``);
    ``rocm``: torch is a ROCm build (its ``cuda`` device is an AMD GPU)."""
    if asked == "auto":
        if custom_mask:
            return Choice(SDPA, "model.attn_implementation auto: sdpa (learner.shared_prompt needs a custom "
                          "attention mask)", False)
        if cuda and rocm:
            return Choice(SDPA, "model.attn_implementation auto: sdpa (ROCm)", False)
        if cuda and flash_attn:
            return Choice(FLASH, "model.attn_implementation auto: flash_attention_2 (flash-attn installed, CUDA)",
                          False)
        why = "no CUDA" if not cuda else "flash-attn not installed"
        return Choice(SDPA, f"model.attn_implementation auto: sdpa ({why})", False)
    if asked == FLASH and not flash_attn:
        return Choice(SDPA, "model.attn_implementation=flash_attention_2 but the flash-attn package is not "
                      "installed (make setup-gpu installs it): using sdpa", True)
    if asked == FLASH and not cuda:
        return Choice(SDPA, "model.attn_implementation=flash_attention_2 needs CUDA: using sdpa on this device",
                      True)
    return Choice(asked, f"model.attn_implementation {asked}", False)


def flash_attn_installed() -> bool:
    """Whether the flash-attn package can be found (not imported: importing it initialises CUDA)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def is_rocm() -> bool:
    """Whether torch is a ROCm (HIP) build: ``torch.version.hip`` is set."""
    import torch

    return getattr(torch.version, "hip", None) is not None


_LOGGED: set[str] = set()


def resolve(asked: str, device_type: str, *, custom_mask: bool = False) -> str:
    """:func:`choose` on this machine for a model on ``device_type``; each distinct line is logged once
    per process (a role loads the policy, a reference and a frozen copy: one line, not three)."""
    choice = choose(asked, cuda=device_type == "cuda", flash_attn=flash_attn_installed(), custom_mask=custom_mask,
                    rocm=is_rocm())
    if choice.line not in _LOGGED:
        _LOGGED.add(choice.line)
        (log.warning if choice.fallback else log.info)("%s", choice.line)
    return choice.kernel
