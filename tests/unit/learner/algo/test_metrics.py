"""The masked reductions every learner shares (learner.algo.metrics), by hand."""

import math

import pytest
import torch

from learner.algo.metrics import masked_mean, masked_mse


def test_masked_mean_by_hand_ignores_what_the_mask_leaves_out():
    """(1 + 2 + 4 + 6) / 4 = 3.25; the NaN and inf outside the mask reach neither the mean nor
    the gradient, which is 1/4 on each of the four tokens."""
    x = torch.tensor([[1.0, 2.0, math.nan], [4.0, math.inf, 6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = masked_mean(x, mask)
    assert out.item() == 3.25
    out.backward()
    assert x.grad.tolist() == [[0.25, 0.25, 0.0], [0.25, 0.0, 0.25]]


def test_masked_mean_of_an_empty_mask_is_zero_and_keeps_the_dtype():
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    out = masked_mean(x, torch.zeros(2, 3, dtype=torch.bool))
    assert out.item() == 0.0 and out.dtype == torch.float64 and out.requires_grad


def test_masked_mse_by_hand():
    """Values (0.5, 1.0, 9.0) against targets (1, 0, 0), the last masked:
    ((0.5 − 1)² + (1 − 0)²) / 2 = (0.25 + 1) / 2 = 0.625; a NaN value at a masked position
    gets gradient 0, not NaN."""
    v = torch.tensor([[0.5, 1.0, math.nan]], requires_grad=True)
    loss = masked_mse(v, torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx(0.625)
    loss.backward()
    # ∂/∂v = 2(v − t)/2 = v − t on the kept tokens: −0.5 and 1.0.
    assert v.grad.tolist() == [[-0.5, 1.0, 0.0]]
