"""The format warm start's two soft targets for the option letter (pure functions of log-probs)."""

from __future__ import annotations

import math

import pytest
import torch

from streamgrpo.recipes.demo.warm import marginal_letter_loss, uniform_letter_loss

V = 10  # a toy vocabulary: tokens 0-9, the options are tokens 2, 3 (and 4)


def _logp(rows_BV: list[list[float]]) -> torch.Tensor:
    """Rows of probabilities (each summing to 1) as log-probs."""
    p = torch.tensor(rows_BV, dtype=torch.float64)
    assert torch.allclose(p.sum(-1), torch.ones(len(rows_BV), dtype=torch.float64))
    return p.clamp_min(1e-300).log()


def _row(**mass: float) -> list[float]:
    """A probability row: keyword tN=p puts p on token N, the rest spread over the non-option tokens 5-9."""
    row = [0.0] * V
    for key, p in mass.items():
        row[int(key[1:])] = p
    rest = 1.0 - sum(row)
    for t in range(5, V):
        row[t] = rest / 5
    return row


TWO = torch.tensor([2, 3])


def test_both_are_zero_only_in_their_own_optimum():
    flat = _logp([_row(t2=0.5, t3=0.5), _row(t2=0.5, t3=0.5)])
    # every row flat over its options: the optimum of both (uniform's minimum is log 2, not 0)
    assert uniform_letter_loss(flat, [TWO, TWO]).item() == pytest.approx(math.log(2))
    assert marginal_letter_loss(flat, [TWO, TWO]).item() == pytest.approx(0.0, abs=1e-12)
    # rows with opposite preferences that balance out: marginal is still at its optimum, uniform is not
    apart = _logp([_row(t2=0.9, t3=0.1), _row(t2=0.1, t3=0.9)])
    assert marginal_letter_loss(apart, [TWO, TWO]).item() == pytest.approx(0.0, abs=1e-12)
    assert uniform_letter_loss(apart, [TWO, TWO]).item() == pytest.approx(-(math.log(0.9) + math.log(0.1)) / 2)
    assert uniform_letter_loss(apart, [TWO, TWO]).item() > math.log(2) + 0.5


def test_marginal_charges_mass_off_the_options_and_a_shared_preference():
    # half the mass off the options: -log 0.5 per row
    off = _logp([_row(t2=0.25, t3=0.25), _row(t2=0.25, t3=0.25)])
    assert marginal_letter_loss(off, [TWO, TWO]).item() == pytest.approx(math.log(2))
    # every row prefers token 2 (0.9 / 0.1): KL(flat || (0.9, 0.1)) = -log 2 - (log 0.9 + log 0.1) / 2
    same = _logp([_row(t2=0.9, t3=0.1), _row(t2=0.9, t3=0.1)])
    want = -math.log(2) - (math.log(0.9) + math.log(0.1)) / 2
    assert marginal_letter_loss(same, [TWO, TWO]).item() == pytest.approx(want)


def test_marginal_balances_each_option_set_on_its_own():
    three = torch.tensor([2, 3, 4])
    # rows 0 and 1 (two options) balance each other; row 2 (three options) is flat on its own
    logp = _logp([_row(t2=0.9, t3=0.1), _row(t2=0.1, t3=0.9), _row(t2=1 / 3, t3=1 / 3, t4=1 / 3)])
    assert marginal_letter_loss(logp, [TWO, TWO, three]).item() == pytest.approx(0.0, abs=1e-12)
    # two-option rows sharing a preference are charged their set's KL; the flat three-option row
    # adds nothing, and the loss is the mean over the two sets
    lop = _logp([_row(t2=0.9, t3=0.1), _row(t2=0.9, t3=0.1), _row(t2=1 / 3, t3=1 / 3, t4=1 / 3)])
    kl = -math.log(2) - (math.log(0.9) + math.log(0.1)) / 2
    assert marginal_letter_loss(lop, [TWO, TWO, three]).item() == pytest.approx(kl / 2)


def test_marginal_gradient_does_not_flatten_balanced_rows():
    """The property the motion demo needs: at a balanced optimum there is no pull towards flat rows."""
    logits = torch.tensor([[3.0, 0.0] + [-30.0] * 8, [0.0, 3.0] + [-30.0] * 8], dtype=torch.float64,
                          requires_grad=True)
    opts = [torch.tensor([0, 1]), torch.tensor([0, 1])]
    marginal_letter_loss(torch.log_softmax(logits, -1), opts).backward()
    assert logits.grad.abs().max().item() < 1e-9
    logits.grad = None
    uniform_letter_loss(torch.log_softmax(logits, -1), opts).backward()
    g = logits.grad
    assert g[0, 0] > 0.1 and g[0, 1] < -0.1  # uniform pushes row 0's preferred option down, the other up
