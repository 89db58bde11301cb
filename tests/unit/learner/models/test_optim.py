"""The learners' AdamW (learner.models.optim.make_adamw): per-parameter learning-rate scales."""

from __future__ import annotations

import pytest
import torch

from learner.models.optim import make_adamw


def params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2)) for _ in range(n)]


def test_scales_make_one_group_per_scale_in_order_of_first_appearance():
    ps = params(4)
    opt = make_adamw(ps, 0.01, 0.0, 0.5, lr_scales=[1.0, 16.0, 1.0, 16.0])
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.01), pytest.approx(0.16)]
    assert [g["params"] for g in opt.param_groups] == [[ps[0], ps[2]], [ps[1], ps[3]]]
    assert all(g["betas"] == (0.5, 0.999) for g in opt.param_groups)


def test_without_scales_one_group_at_the_rate():
    ps = params(3)
    opt = make_adamw(ps, 0.01, 0.0)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == ps
    assert opt.param_groups[0]["lr"] == 0.01


def test_a_scale_per_parameter_or_a_named_error():
    with pytest.raises(ValueError, match="2 learning-rate scales for 3 parameters"):
        make_adamw(params(3), 0.01, 0.0, lr_scales=[1.0, 2.0])


def test_the_first_step_moves_each_group_by_its_rate():
    """Adam's first update is lr · g/(|g| + ε): 0.01 and 0.16 for a gradient of 1."""
    ps = params(2)
    opt = make_adamw(ps, 0.01, 0.0, lr_scales=[1.0, 16.0])
    for p in ps:
        p.grad = torch.ones(2)
    opt.step()
    assert ps[0].detach().tolist() == pytest.approx([-0.01, -0.01])
    assert ps[1].detach().tolist() == pytest.approx([-0.16, -0.16])
