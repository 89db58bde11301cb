"""The row split of a sharded learner step and the per-rank fault arming (issue 38); the
sharded step itself runs in tests/integration/test_sharded_step.py (it needs torchrun)."""

from __future__ import annotations

import pytest
import torch

from learner import faults
from learner.models.placement import Placement, full_tensor


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


class FakeChannel:
    """Rank 0's side of ``learner.distributed.Channel`` without a process group: records the calls
    sent and the reports; ``follower_error`` is what rank 1 reports."""

    def __init__(self, follower_error: str | None = None):
        self.sent, self.reports, self.follower_error = [], [], follower_error

    def send(self, op, *args):
        self.sent.append(op)

    def report(self, error):
        self.reports.append(error)
        failed = [(r, e) for r, e in enumerate([error, self.follower_error]) if e is not None]
        if failed:
            raise RuntimeError(f"learner rank {failed[0][0]} failed: {failed[0][1]}")


class FakeAlgorithm:
    steps = 7

    def step(self, batch):
        if batch == "bad":
            raise ValueError("a row has no action tokens")
        return {"policy_loss": 0.5}


def test_a_mirrored_call_runs_on_rank_0_after_it_is_sent_and_raises_any_ranks_error():
    from learner.distributed import MirroredAlgorithm

    channel = FakeChannel()
    mirrored = MirroredAlgorithm(FakeAlgorithm(), channel)
    assert mirrored.step("ok") == {"policy_loss": 0.5} and mirrored.steps == 7
    assert channel.sent == ["step"] and channel.reports == [None]
    # Rank 0's own error is reported to the group and raised as itself.
    with pytest.raises(ValueError, match="no action tokens"):
        mirrored.step("bad")
    assert channel.reports[-1] == "ValueError: a row has no action tokens"
    # A follower's error is raised on rank 0, naming the rank.
    broken = MirroredAlgorithm(FakeAlgorithm(), FakeChannel(follower_error="OutOfMemoryError: ..."))
    with pytest.raises(RuntimeError, match="learner rank 1 failed: OutOfMemoryError"):
        broken.step("ok")
