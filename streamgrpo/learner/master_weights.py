"""``learner.master_weights``: bfloat16 parameters in the model, float32 master weights in the optimizer.

Under bf16 autocast with float32 parameters (``learner.bf16`` alone) every forward casts every weight it
multiplies to bf16, again in every activation-checkpointing recompute: at the 3B shape those casts are a
tenth of the step's GPU time. The mixed-precision optimizer of DeepSpeed's bf16 mode and Megatron keeps
the model in bf16 (nothing to cast) and the float32 copy where precision matters, in the optimizer:

* :class:`MasterAdamW` is torch's AdamW over float32 *master* copies of the model's trained bf16
  parameters (the same parameter groups and learning rates);
* each bf16 gradient, once the backward has accumulated it, is added into its master's float32
  gradient and dropped (a post-accumulate-grad hook), so micro-batches sum in float32;
* :meth:`MasterAdamW.step` steps the masters and copies them, rounded, into the model;
* the masters travel in the optimizer's ``state_dict`` (``master`` in each parameter's state), so a
  checkpoint resumes them exactly.

Clipping, the finite-gradient checks and ``learner.max_update_kl`` work on :meth:`MasterAdamW.masters`
(the tensors the optimizer steps); :meth:`MasterAdamW.push` copies them into the model after a change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["MasterAdamW"]


class MasterAdamW(torch.optim.AdamW):
    """AdamW on float32 copies of ``param_groups``' (bf16) parameters; see the module docstring."""

    def __init__(self, param_groups: list[dict[str, Any]], **kwargs: Any):
        self.model_params: list[Tensor] = []
        master_groups = []
        for g in param_groups:
            masters = []
            for p in g["params"]:
                m = p.detach().to(torch.float32, copy=True)
                m.requires_grad_(True)
                self.model_params.append(p)
                masters.append(m)
            master_groups.append({**g, "params": masters})
        super().__init__(master_groups, **kwargs)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate(m))
                       for p, m in zip(self.model_params, self.masters(), strict=True)]

    def masters(self) -> list[Tensor]:
        """The float32 master weights, in the order of :attr:`model_params`."""
        return [m for g in self.param_groups for m in g["params"]]

    @staticmethod
    def _accumulate(master: Tensor):
        def hook(p: Tensor) -> None:
            g = p.grad
            if g is None:
                return
            if master.grad is None:
                master.grad = g.to(torch.float32, copy=True)
            else:
                master.grad.add_(g)
            p.grad = None
        return hook

    @torch.no_grad()
    def push(self) -> None:
        """Copy the master weights into the model's parameters (rounded to their dtype)."""
        for p, m in zip(self.model_params, self.masters(), strict=True):
            p.copy_(m)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        self.push()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        state = sd["state"]
        for i, m in enumerate(self.masters()):  # the ids of state_dict() number the parameters in this order
            state.setdefault(i, {})["master"] = m.detach().clone()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = {k: dict(v) for k, v in state_dict["state"].items()}  # the caller's dict stays as it is
        saved = {int(k): v.pop("master") for k, v in state.items() if "master" in v}
        super().load_state_dict({**state_dict, "state": {k: v for k, v in state.items() if v}})
        with torch.no_grad():
            for i, m in enumerate(self.masters()):
                if i in saved:
                    m.copy_(saved[i])
        self.push()


def trained_tensors(optimizer: torch.optim.Optimizer, fallback: Iterable[Tensor]) -> list[Tensor]:
    """The tensors an optimizer step changes: the masters of a :class:`MasterAdamW`, else ``fallback``."""
    return optimizer.masters() if isinstance(optimizer, MasterAdamW) else list(fallback)
