"""The row split of a sharded learner step and the per-rank fault arming (issue 38); the
sharded step itself runs in tests/integration/test_sharded_step.py (it needs torchrun)."""

from __future__ import annotations

import pytest
import torch

from learner import faults
from learner.placement import Placement, full_tensor


def rows_of(rank: int, world: int, n: int) -> list[int]:
    return Placement(torch.device("cpu"), rank, world).local_rows(n).tolist()


def test_rows_are_split_in_contiguous_shares_the_first_ranks_taking_the_remainder():
    # 5 rows over 2 ranks: divmod(5, 2) = (2, 1), so rank 0 takes 2 + 1 = 3 rows, rank 1 takes 2.
    assert rows_of(0, 2, 5) == [0, 1, 2] and rows_of(1, 2, 5) == [3, 4]
    # 8 over 3: (2, 2): 3, 3, 2.
    assert [rows_of(r, 3, 8) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # Fewer rows than ranks (a MIS minibatch): rank 1 has none and evaluates a stand-in row.
    assert rows_of(0, 2, 1) == [0] and rows_of(1, 2, 1) == []
    # One process: every row.
    assert rows_of(0, 1, 4) == [0, 1, 2, 3]


def test_one_process_places_without_sharding():
    placement = Placement(torch.device("cpu"))
    model = torch.nn.Linear(3, 2)
    placement.place(model)
    assert not placement.sharded and placement.root(model) is model
    # A plain tensor is its own whole tensor: the same object, no copy.
    assert full_tensor(model.weight) is model.weight


@pytest.mark.parametrize(
    ("wanted", "rank", "armed"),
    [(None, "1", True), ("1", "1", True), ("1", "0", False), ("0", None, True)],
)
def test_a_fault_point_arms_in_the_rank_it_names(monkeypatch, wanted, rank, armed):
    if wanted is None:
        monkeypatch.delenv(faults.FAULT_RANK_ENV, raising=False)
    else:
        monkeypatch.setenv(faults.FAULT_RANK_ENV, wanted)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)  # one process: rank 0
    else:
        monkeypatch.setenv("RANK", rank)
    assert faults._this_rank() is armed
