"""What a learner step commits (``learner.step_plan.plan_step``): the version and its parent, the
stage and its lifecycle events, the quarantine and the way back after a gate's rejection, the
stored metrics, the checkpoint's cadence. Pure: no database, no model; expectations worked by
hand."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from core.lifecycle import Stage
from learner.guard.gate import GateResult
from learner.step_plan import QUARANTINE_REASON, Trained, plan_step, stage_of_new, why

JOINED = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def trained(step: int = 4, **metrics) -> Trained:
    """Three samples: two of identity ``a`` (rewards 1 and 0), one anonymous (reward 1)."""
    return Trained(
        metrics={"policy_loss": 0.25, "reward_mean": 2 / 3} | metrics,
        sample_ids=("s1", "s2", "s3"),
        identities=("a", "a", None),
        rewards=(1.0, 0.0, 1.0),
        deferred=1,
        joined_at=JOINED,
        step=step,
    )


def gate(passed: bool) -> GateResult:
    reasons = [] if passed else ["KL to the promoted version 1 nats/token > 0.5"]
    return GateResult(
        probes=16,
        answer_tokens=512,
        kl_base=0.25,
        kl_promoted=1.0 if not passed else 0.125,
        unusable_tokens=0,
        nonfinite_logits=0,
        empty_share=0.0,
        mean_length=31.0,
        reference_mean_length=31.0,
        length_ratio=1.0,
        repetition_rate=0.0,
        quality=math.nan,
        elapsed_s=1.5,
        passed=passed,
        reasons=reasons,
    )


def test_with_the_guard_off_the_next_version_is_promoted_from_its_parent():
    plan = plan_step(trained(), None, False, version=7, parent=5, checkpoint_every=10)
    assert (plan.version, plan.parent, plan.stage, plan.step) == (8, 5, Stage.PROMOTED, 4)
    assert plan.events == (
        (None, Stage.CANDIDATE, "trained from version 5"),
        (Stage.CANDIDATE, Stage.PROMOTED, "the guard is off"),
    )
    assert (plan.quarantine, plan.back_to, plan.gate) == (None, None, None)
    assert plan.sample_ids == ("s1", "s2", "s3")


def test_with_the_guard_on_and_no_gate_the_version_goes_under_watch():
    plan = plan_step(trained(), None, True, version=0, parent=0, checkpoint_every=10)
    assert (plan.version, plan.stage) == (1, Stage.CANARY)
    assert plan.events[1] == (Stage.CANDIDATE, Stage.CANARY, "no gate configured; under watch")
    assert "gate_reasons" not in plan.metrics


def test_a_passed_gate_is_a_canary_with_its_figures_stored_finite():
    plan = plan_step(trained(), gate(True), True, version=2, parent=2, checkpoint_every=10)
    assert plan.stage == Stage.CANARY and plan.back_to is None and plan.quarantine is None
    assert plan.events[1][2] == "gate passed (KL to base 0.25, to parent 0.125); under watch"
    assert plan.gate["passed"] is True and plan.gate["quality"] is None  # NaN stored as null
    assert plan.metrics["gate_reasons"] == []


def test_a_failed_gate_rejects_quarantines_and_goes_back_to_the_parent():
    plan = plan_step(trained(), gate(False), True, version=3, parent=2, checkpoint_every=10)
    assert (plan.version, plan.stage, plan.back_to) == (4, Stage.REJECTED, 2)
    assert plan.quarantine == QUARANTINE_REASON == "trained a version the gate rejected"
    assert plan.events == (
        (None, Stage.CANDIDATE, "trained from version 2"),
        (Stage.CANDIDATE, Stage.REJECTED, "gate failed: KL to the promoted version 1 nats/token > 0.5"),
    )
    assert plan.metrics["gate_reasons"] == ["KL to the promoted version 1 nats/token > 0.5"]
    assert plan.gate["kl_promoted"] == 1.0 and plan.gate["passed"] is False


def test_a_failed_gate_with_the_guard_off_does_not_reject():
    assert stage_of_new(False, gate(False)) == Stage.PROMOTED
    assert why(False, gate(False)) == "the guard is off"


def test_the_metrics_add_the_batch_s_identities_and_its_completion():
    plan = plan_step(trained(), None, True, version=0, parent=0, checkpoint_every=10)
    # Identities a, a and one anonymous: 2 distinct; a holds 1 of the 2 reward units (0.5) and 2
    # of the 3 samples; the newest sample s3 completed the batch, joined at JOINED.
    assert plan.metrics == {
        "policy_loss": 0.25,
        "reward_mean": 2 / 3,
        "identity_count": 2,
        "identity_top_share": 0.5,
        "identity_top_sample_share": 2 / 3,
        "identity_deferred": 1,
        "completing_sample": "s3",
        "batch_completed_at": JOINED.timestamp(),
    }
    # The version's row keeps the numbers (and nulls); the step's row all, with the samples' ids.
    assert "completing_sample" not in plan.version_metrics
    assert plan.version_metrics["identity_count"] == 2
    assert plan.step_metrics == plan.metrics | {"sample_ids": ["s1", "s2", "s3"]}


def test_a_naive_join_time_is_read_as_utc():
    naive = Trained(**{**trained().__dict__, "joined_at": JOINED.replace(tzinfo=None)})
    plan = plan_step(naive, None, True, version=0, parent=0, checkpoint_every=10)
    assert plan.metrics["batch_completed_at"] == JOINED.timestamp() == 1735787045.0


def test_non_finite_metrics_are_stored_as_null_and_returned_as_they_are():
    plan = plan_step(
        trained(explained_variance=math.nan, hist={"0": math.inf}),
        None,
        True,
        version=0,
        parent=0,
        checkpoint_every=10,
    )
    assert math.isnan(plan.metrics["explained_variance"])
    assert plan.version_metrics["explained_variance"] is None and "hist" not in plan.version_metrics
    assert plan.step_metrics["explained_variance"] is None and plan.step_metrics["hist"] == {"0": None}


def test_step_metrics_are_json_ready():
    plan = plan_step(trained(started=JOINED), None, True, version=0, parent=0, checkpoint_every=10)
    assert plan.step_metrics["started"] == str(JOINED)  # what json.dumps(default=str) writes


@pytest.mark.parametrize(
    ("step", "every", "written"), [(4, 2, True), (3, 2, False), (1, 1, True), (9, 10, False)]
)
def test_the_checkpoint_is_written_every_checkpoint_every_steps(step, every, written):
    plan = plan_step(trained(step=step), None, True, version=0, parent=0, checkpoint_every=every)
    assert plan.checkpoint is written


def test_the_inputs_are_not_modified():
    given = trained()
    before = dict(given.metrics)
    plan_step(given, gate(False), True, version=0, parent=0, checkpoint_every=10)
    assert given.metrics == before


def test_an_empty_batch_is_refused():
    empty = Trained({}, (), (), (), 0, JOINED, 1)
    with pytest.raises(ValueError):
        plan_step(empty, None, True, version=0, parent=0, checkpoint_every=10)
