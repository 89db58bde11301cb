"""How ``learner.distributed.run_ranked`` ends on rank 0 (no process group: ``init``, the
learner and ``torch.distributed``'s barrier and teardown are stand-ins).

Every follower told ``stop`` returns from ``follow`` and waits in ``_leave_together``'s barrier
on the control group (``CONTROL_TIMEOUT``: 30 days). Rank 0 tells them ``stop`` whether its
learner ended cleanly or raised, so it must reach that barrier in both cases, or the followers
wait for a rank that has left.
"""

from __future__ import annotations

import pytest
import torch

from learner import distributed
from learner.models.placement import Placement


class Told:
    """The control channel of rank 0 of 2: records what it sends."""

    group, rank, world = object(), 0, 2

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, op: str, *args) -> None:
        self.sent.append(op)


def ranked(monkeypatch, run_learner) -> tuple[Told, list[str]]:
    """Stand-ins for rank 0's process group; the calls to the barrier and the teardown, in order."""
    channel, calls = Told(), []
    monkeypatch.setattr(distributed, "init", lambda config: (Placement(torch.device("cpu"), 0, 2), channel))
    monkeypatch.setattr(distributed, "run_learner", run_learner)
    monkeypatch.setattr(distributed.dist, "barrier", lambda group=None: calls.append("barrier"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: calls.append("destroy"))
    return channel, calls


def test_a_clean_stop_tells_the_ranks_and_waits_for_them(monkeypatch):
    channel, calls = ranked(monkeypatch, lambda settings, config, make_learner: "learner")
    assert distributed.run_ranked(None, None) == "learner"
    assert channel.sent == ["stop"] and calls == ["barrier", "destroy"]


def test_a_learner_that_raises_still_waits_for_the_ranks_it_told_to_stop(monkeypatch):
    def fails(settings, config, make_learner):
        raise RuntimeError("the database is gone")

    channel, calls = ranked(monkeypatch, fails)
    with pytest.raises(RuntimeError, match="the database is gone"):
        distributed.run_ranked(None, None)
    assert channel.sent == ["stop"]
    assert calls == ["barrier", "destroy"]
