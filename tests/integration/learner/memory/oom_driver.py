"""`streamgrpo ...` (the CLI's own main) on a device that holds at most ``--max-rows`` sequences in
one forward: a forward over more raises ``torch.OutOfMemoryError``, as a GPU does. Run directly for
one process, or under torchrun (``--rank R``: only that rank runs out). ``--in-decoder``: it runs out inside
the first decoder layer (after its attention, in a sequence-parallel group: between two exchanges), not before
the policy's forward; ``--backward-once``: besides, the first backward through that layer runs out, once. The
rest of the arguments are the CLI's."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-rows", type=int, required=True)
    ap.add_argument("--rank", type=int, default=None, help="only this rank runs out (default: every rank)")
    ap.add_argument("--in-decoder", action="store_true")
    ap.add_argument("--backward-once", action="store_true")
    args, rest = ap.parse_known_args()
    rank = int(os.environ.get("RANK", "0"))
    if (args.rank is None or args.rank == rank) and args.in_decoder:
        _in_decoder(args.max_rows, args.backward_once)
    elif args.rank is None or args.rank == rank:
        _before_forward(args.max_rows)
    from streamgrpo.cli import main as cli

    return cli(rest)


def _oom(rows: int, max_rows: int) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory (injected: {rows} sequences > {max_rows})")


def _before_forward(max_rows: int) -> None:
    from streamgrpo.learner import trainer

    real = trainer.PolicyLogprobs.forward

    def limited(self, batch, *a, **k):
        if batch.completion_mask.shape[0] > max_rows:
            raise _oom(batch.completion_mask.shape[0], max_rows)
        return real(self, batch, *a, **k)

    trainer.PolicyLogprobs.forward = limited


class _BackwardOnce(torch.autograd.Function):
    raised = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not _BackwardOnce.raised:
            _BackwardOnce.raised = True
            raise torch.OutOfMemoryError("CUDA out of memory (injected: the first backward through a decoder layer)")
        return grad


def _in_decoder(max_rows: int, backward_once: bool) -> None:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    real = qwen.Qwen2_5_VLDecoderLayer.forward

    def limited(self, hidden_states, *a, **k):
        out = real(self, hidden_states, *a, **k)
        if self.self_attn.layer_idx != 0 or not torch.is_grad_enabled():
            return out
        if hidden_states.shape[0] > max_rows:
            raise _oom(hidden_states.shape[0], max_rows)
        return _BackwardOnce.apply(out) if backward_once else out

    qwen.Qwen2_5_VLDecoderLayer.forward = limited


if __name__ == "__main__":
    sys.exit(main())
