"""Named kill points in the learner's cycle, for the fault-injection harness (issue 13, docs/design.md §8).

``SAOSERVE_FAULT_POINT=<point>:<n>`` makes the learner process end with ``os._exit(137)`` the
n-th time it passes ``<point>`` (n defaults to 1); with N ranks (``learner.distributed``),
``SAOSERVE_FAULT_RANK=<r>`` arms it in rank r only (``RANK`` of ``torchrun``; unset: every rank): no ``finally`` block, atexit handler or
buffered write runs, which is what ``kill -9`` at that line does. Unset (the normal case),
``fault_point`` is one comparison with None. The variable is read once, at import; ``arm``
sets the point in a process forked from one that imported this module already (the harness's
fork server).

Points, in the order of one cycle (``learner.process.Learner``):

* ``after_read``: the joiner has read records from the log, nothing committed yet;
* ``after_join_commit``: offsets, pending joins, samples and evidence committed;
* ``during_step``: the update applied to the in-memory models, nothing written (on a rank > 0:
  its share of the step done, not yet reported to rank 0);
* ``after_weights``: the new version's directory written, not yet in the database;
* ``after_commit``: the version (and the removal of its samples) committed;
* ``after_checkpoint``: ``checkpoint.pt`` replaced (only on checkpoint steps);
* ``after_policy_event``: the policy event appended to the log, its status not yet
  ``published``.

Points of the version lifecycle (docs/guard.md), passed only when the guard acts:

* ``after_gate_reject``: a version the gate rejected committed with its quarantine, the policy
  not yet put back to the parent's weights (nor the version's folder deleted);
* ``during_guard_promote``: the guard's promotion of the lineage written in its transaction,
  not committed;
* ``after_guard_promote``: that promotion committed;
* ``during_guard_reject``: the guard's rejection of the lineage, the quarantine of its samples
  and the new version restoring the promoted weights written in one transaction, not committed;
* ``after_rollback_commit``: a rollback's new version committed (the guard's restore, or an
  operator's), not yet announced.

And the other fault injection, of the algorithm's updates themselves: ``BrokenLearner`` (a
learner config's ``broken_learner``), for measuring the guard.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.logbus import LogTransport

FAULT_ENV = "SAOSERVE_FAULT_POINT"
FAULT_RANK_ENV = "SAOSERVE_FAULT_RANK"
EXIT_CODE = 137
"""What a shell reports for a process killed by SIGKILL (128 + 9)."""

CYCLE_POINTS = (
    "after_read",
    "after_join_commit",
    "during_step",
    "after_weights",
    "after_commit",
    "after_checkpoint",
    "after_policy_event",
)
"""The points every training cycle passes."""

LIFECYCLE_POINTS = (
    "after_gate_reject",
    "during_guard_promote",
    "after_guard_promote",
    "during_guard_reject",
    "after_rollback_commit",
)
"""The points passed only when the gate rejects or the guard decides."""

POINTS = CYCLE_POINTS + LIFECYCLE_POINTS


def parse(value: str | None) -> tuple[str, int] | None:
    """``"<point>:<n>"`` → (point, n); empty or None → None.

    Raises:
        ValueError: an unknown point or an n that is not an integer >= 1.
    """
    if not value:
        return None
    name, _, count = value.partition(":")
    if name not in POINTS:
        raise ValueError(f"{FAULT_ENV}: unknown point {name!r} (one of {', '.join(POINTS)})")
    n = int(count) if count else 1
    if n < 1:
        raise ValueError(f"{FAULT_ENV}: the count must be >= 1, got {n}")
    return name, n


def _this_rank() -> bool:
    """Whether this process is the rank ``SAOSERVE_FAULT_RANK`` names (any, when unset)."""
    wanted = os.environ.get(FAULT_RANK_ENV)
    return not wanted or wanted == os.environ.get("RANK", "0")


_target = parse(os.environ.get(FAULT_ENV)) if _this_rank() else None
_passes = 0


def arm(value: str | None) -> None:
    """Arm ``"<point>:<n>"`` (or disarm with None) and reset the pass count. Raises as ``parse``."""
    global _target, _passes
    _target = parse(value)
    _passes = 0


def armed() -> bool:
    """Whether this process was started with a fault point."""
    return _target is not None


def fault_point(name: str) -> None:
    """Exit the process at once (status 137) on the armed point's n-th pass; else nothing."""
    global _passes
    if _target is None or name != _target[0]:
        return
    _passes += 1
    if _passes >= _target[1]:
        os._exit(EXIT_CODE)


class ReadFaultLog:
    """A log transport that passes ``after_read`` each time a read returns records.

    Wraps the learner's transport only when a fault point is armed, so the joiner needs no hook.
    """

    def __init__(self, inner: LogTransport):
        self._inner = inner
        self._unread = False

    def read(self, *args, **kwargs):
        entries = self._inner.read(*args, **kwargs)
        if entries:
            self._unread = True
            fault_point("after_read")
        return entries

    def take_read(self) -> bool:
        """Whether a read returned records since the last call (the join had something to commit)."""
        seen, self._unread = self._unread, False
        return seen

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class BrokenLearner(BaseModel):
    """FAULT INJECTION, for measuring the guard only (docs/guard.md, "Simulated attacks and
    faults"): every policy update of the run is wrong on purpose. ``flip``: the policy loss is
    negated before its backward pass, so each AdamW step is the opposite of the right one (the
    loss reported is still the true one). ``scale``: the policy's learning rate is multiplied by
    ``factor``, so each AdamW step is ``factor`` times too large (scaling the loss instead would
    do nothing: the gradient is clipped and AdamW divides it by its own scale). Never in a preset
    and not an option of ``saoserve learn``: only ``saoserve demo|compare --broken-learner`` sets
    it, and ``kind`` has no default."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)
    kind: Literal["flip", "scale"]
    """Which fault: the sign of the policy loss, or the size of the policy step."""
    factor: float = Field(100.0, gt=1.0)
    """``scale``: the multiplier of the policy's learning rate (100)."""

    @property
    def loss_sign(self) -> float:
        """-1 for ``flip``, else 1: the factor on the policy loss."""
        return -1.0 if self.kind == "flip" else 1.0

    @property
    def lr_factor(self) -> float:
        """``factor`` for ``scale``, else 1: the factor on the policy's learning rate."""
        return self.factor if self.kind == "scale" else 1.0
