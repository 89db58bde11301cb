"""The learner step's pure part: the step's figures + the gate's result + the learner's state →
what the step commits and what follows the commit.

``learner.process.Learner.train_step`` is batch → step → gate → :func:`plan_step` → one
transaction (``learner.publish``) → after the commit. The step, the gate and the commit stay in
the Learner; this module does no I/O, so every rule of what a step records is tested here
without a database or a model (tests/unit/learner/test_step_plan.py).

Rules (docs/design.md §3 step 6, §8; docs/guard.md "The lifecycle"):

* The step publishes the next version (the database's latest + 1), trained from the version
  whose weights the policy holds (its parent; the latest unless the newest were rejected).
* Its stage: ``promoted`` with the guard off, ``rejected`` when the gate failed, else
  ``canary`` (also with no gate configured). Its commit records two lifecycle events by the
  learner: ``— → candidate`` ("trained from version P"), then ``candidate → stage`` with the
  reason.
* A rejected version's samples are quarantined (never trained again), the policy goes back to
  the parent's weights and the version's folder is deleted: never served, never restored.
* Metrics are stored finite or null (``learner.publish.storable``): the version's row keeps the
  numbers (what its policy event carries), the step's row all of them with the samples' ids.
* ``checkpoint.pt`` is written after the commit every ``checkpoint_every`` steps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from core.lifecycle import Stage
from core.records import as_utc
from learner.data.identity_cap import identity_shares
from learner.guard.gate import GateResult
from learner.publish import storable

QUARANTINE_REASON = "trained a version the gate rejected"


@dataclass(frozen=True)
class Trained:
    """One step's result, before anything is recorded.

    ``metrics``: the algorithm's figures (``Learner._step``: losses, staleness, step time);
    ``sample_ids``, ``identities`` and ``rewards``: the batch's samples in batch order, the
    newest last (identity None: anonymous); ``deferred``: samples the identity cap held back
    (``learner.data.sample_queue.next_batch``); ``joined_at``: when the newest sample was joined
    (tz-aware, or naive UTC as SQLite returns it); ``step``: the algorithm's step count after it.
    """

    metrics: Mapping[str, object]
    sample_ids: tuple[str, ...]
    identities: tuple[str | None, ...]
    rewards: tuple[float, ...]
    deferred: int
    joined_at: datetime
    step: int


@dataclass(frozen=True)
class StepPlan:
    """What one step commits, in one transaction with its version's row, and what follows.

    ``version``: the version to publish, trained from ``parent``, recorded at ``stage`` with the
    gate's figures ``gate`` (storable, None without a gate) and the numbers ``version_metrics``;
    ``metrics``: the step's whole figures (what ``train_step`` returns and logs);
    ``step_metrics``: the ``learner_steps`` row's (JSON-ready, with ``sample_ids``);
    ``sample_ids``: the samples the commit deletes from the queue; ``events``: the lifecycle
    events (from, to, reason), by the learner, in order; ``quarantine``: the reason the samples
    are quarantined under ``version``, None when they are not; ``back_to``: the version whose
    weights the policy goes back to after the commit (a rejection: the parent), None when it
    keeps the new ones; ``checkpoint``: whether ``checkpoint.pt`` is written after the commit.
    """

    version: int
    parent: int
    stage: Stage
    metrics: dict
    version_metrics: dict
    step_metrics: dict
    gate: dict | None
    step: int
    sample_ids: tuple[str, ...]
    events: tuple[tuple[Stage | None, Stage, str], ...]
    quarantine: str | None
    back_to: int | None
    checkpoint: bool


def stage_of_new(guard_on: bool, gate: GateResult | None) -> Stage:
    """The stage a new trained version is recorded with, given its ``gate`` result (None: no
    gate ran): promoted with the guard off, rejected when the gate failed, else canary."""
    if not guard_on:
        return Stage.PROMOTED
    return Stage.REJECTED if gate is not None and not gate.passed else Stage.CANARY


def why(guard_on: bool, gate: GateResult | None) -> str:
    """The reason recorded with that stage (``stage_of_new``). "Under watch" names a canary
    share and probation alike: the servers, not the learner, decide which one a version gets
    (``core.lifecycle.check_canary_share``, docs/guard.md "The canary share")."""
    if not guard_on:
        return "the guard is off"
    if gate is None:
        return "no gate configured; under watch"
    if gate.passed:
        return f"gate passed (KL to base {gate.kl_base}, to parent {gate.kl_promoted}); under watch"
    return "gate failed: " + "; ".join(gate.reasons)


def step_metrics(trained: Trained, gate: GateResult | None) -> dict:
    """The step's whole figures: the algorithm's, then the batch's concentration by identity
    (``learner.data.identity_cap.identity_shares``), ``identity_deferred``, ``completing_sample``
    (the newest sample's id, whose feedback completed the batch: judge.runstats),
    ``batch_completed_at`` (unix s: when that sample was joined, within a poll of its feedback's
    receipt, the start of feedback→served that servers measure as
    ``saoserve_feedback_to_served_seconds``) and, when a gate ran, its ``gate_reasons``.

    Raises ValueError for an empty batch or lengths that differ (``identity_shares``).
    """
    metrics = dict(trained.metrics)
    metrics |= identity_shares(list(trained.identities), list(trained.rewards))
    metrics["identity_deferred"] = trained.deferred
    metrics["completing_sample"] = trained.sample_ids[-1]
    metrics["batch_completed_at"] = as_utc(trained.joined_at).timestamp()
    if gate is not None:
        metrics["gate_reasons"] = gate.reasons
    return metrics


def plan_step(
    trained: Trained,
    gate: GateResult | None,
    guard_on: bool,
    version: int,
    parent: int,
    checkpoint_every: int,
) -> StepPlan:
    """What the step ``trained`` commits (module docstring for the rules).

    Args:
        trained: the step's result (:class:`Trained`).
        gate: the gate's result on the stepped policy, None when none ran.
        guard_on: whether the lifecycle runs (``learner.guard.guard.Guard.on``).
        version: the database's latest version, as the learner committed or loaded it.
        parent: the version whose weights the policy was stepped from.
        checkpoint_every: write ``checkpoint.pt`` after every this many steps (≥ 1).

    Returns:
        The :class:`StepPlan`. Pure: no I/O, ``trained`` and ``gate`` are not modified.

    Raises:
        ValueError: an empty batch, or sample lists of different lengths.
    """
    metrics = step_metrics(trained, gate)
    clean = storable(metrics)
    stage = stage_of_new(guard_on, gate)
    rejected = stage == Stage.REJECTED
    sample_ids = list(trained.sample_ids)
    return StepPlan(
        version=version + 1,
        parent=parent,
        stage=stage,
        metrics=metrics,
        version_metrics={k: v for k, v in clean.items() if v is None or isinstance(v, int | float)},
        step_metrics=json.loads(json.dumps(clean | {"sample_ids": sample_ids}, default=str)),
        gate=None if gate is None else storable(gate.model_dump(mode="json")),
        step=trained.step,
        sample_ids=trained.sample_ids,
        events=(
            (None, Stage.CANDIDATE, f"trained from version {parent}"),
            (Stage.CANDIDATE, stage, why(guard_on, gate)),
        ),
        quarantine=QUARANTINE_REASON if rejected else None,
        back_to=parent if rejected else None,
        checkpoint=trained.step % checkpoint_every == 0,
    )
