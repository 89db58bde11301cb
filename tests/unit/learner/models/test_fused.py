"""Compiled decoder layers (learner.models.fused) without compiling: which layers ``compile_layers``
takes. The compiled layers against eager (slow): tests/integration/test_fused.py."""

import torch

from learner.algo.critic import ValueModel
from learner.models.fused import compile_layers
from testing.models import tiny_policy


def test_a_module_without_decoder_layers_compiles_nothing():
    assert compile_layers(torch.nn.Linear(2, 2)) == 0
    assert compile_layers(ValueModel.from_policy(tiny_policy())) == 2
