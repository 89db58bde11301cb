"""The lifecycle in the learner (learner/process.py): the gate's rejection before anyone is
served, the reset to the parent and the quarantine; the guard's verdict on probation (rollback
to the promoted version, promotion); a restart mid-probation. The tiny random Llama and the
hand-fed records of testing/learner.py; the gate's verdict is made from figures
(``learner.guard.gate.decide``), since that model has no tokenizer to answer probes with, except in
the test of the gate as the learner runs it (tests/unit/learner/guard/test_gate.py's tiny model and byte
tokenizer). The verdict the guard records for /metrics and the dashboard."""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch
from sqlalchemy import insert, select, update

from core.control import GUARD_VERDICT, PAUSED, get_flag, set_flag
from core.db import (
    LearnerCounter,
    LearnerSample,
    LearnerStep,
    PolicyVersion,
    QuarantinedSample,
    VersionStatusEvent,
)
from core.keys import KeyStore
from core.lifecycle import judge_lineage
from core.lifecycle_store import step_metric
from core.logbus import open_log
from core.records import PolicyEvent, utcnow
from core.sequential import Decision
from learner.data.samples import Sample, collate
from learner.guard.gate import GateConfig, GateResult, decide
from learner.guard.guard import KL_AFTER
from learner.guard.guard_config import GuardConfig
from learner.guard.guard_votes import Electorate
from learner.process import Learner
from server.db_figures import read_lifecycle
from testing.guard import add_rated, prpl_eb_lower
from testing.learner import (
    BATCH,
    GATE_VOCAB,
    assert_policy_is,
    committed_weights,
    feed,
    gate_model_dir,
    in_process,
    run_until,
    trained_ids,
)
from testing.logs import read_topic

# Bounds stated here, not the calibrated defaults: 1.0 nats/token to the base, 0.5 to the parent.
GATE = GateConfig(max_kl_base=1.0, max_kl_promoted=0.5)


def gate_result(kl: float) -> GateResult:
    """The gate's result for a candidate whose KL to the base and to its parent is ``kl``
    (nats/token) and whose answers are otherwise healthy."""
    reasons = decide(GATE, kl, kl, 0, 0.0, 1.0, 0.0, None)
    return GateResult(
        probes=16,
        answer_tokens=512,
        kl_base=kl,
        kl_promoted=kl,
        unusable_tokens=0,
        nonfinite_logits=0,
        empty_share=0.0,
        mean_length=31.0,
        reference_mean_length=31.0,
        length_ratio=1.0,
        repetition_rate=0.0,
        quality=None,
        elapsed_s=1.0,
        passed=not reasons,
        reasons=reasons,
    )


def lifecycles(learner: Learner) -> dict[int, str]:
    with learner.db.connect() as conn:
        return dict(conn.execute(select(PolicyVersion.version, PolicyVersion.lifecycle)).all())


def announced(learner: Learner) -> list[PolicyEvent]:
    """The policy topic's publish events (what servers load)."""
    events = [PolicyEvent.model_validate_json(e.value) for e in read_topic(learner.log, "policy")]
    return [e for e in events if e.kind == "publish"]


def notices(learner: Learner) -> list[tuple[int, str, str]]:
    """The policy topic's stage notices: (version, stage moved to, actor)."""
    events = [PolicyEvent.model_validate_json(e.value) for e in read_topic(learner.log, "policy")]
    return [(e.version, e.lifecycle, e.actor) for e in events if e.kind == "stage"]


def events(learner: Learner) -> list[tuple]:
    with learner.db.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                select(
                    VersionStatusEvent.version,
                    VersionStatusEvent.from_status,
                    VersionStatusEvent.to_status,
                    VersionStatusEvent.actor,
                ).order_by(VersionStatusEvent.id)
            )
        ]


def step_sample_ids(learner: Learner, version: int) -> list[str]:
    with learner.db.connect() as conn:
        return [
            r.sample_id
            for r in conn.execute(
                select(QuarantinedSample.sample_id).where(QuarantinedSample.version == version)
            )
        ]


@pytest.fixture
def learner(tmp_path, monkeypatch):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=100)
    yield learner
    learner.db.dispose()


def test_a_candidate_with_twice_the_kl_bound_is_rejected_before_it_serves(learner, monkeypatch):
    log = open_log(learner.settings.resolved_database_url)
    fed = feed(log, 3 * BATCH, 0)
    learner.poll_once()
    # Step 1: KL 0.1 nats/token, under both bounds (1.0 to the base, 0.5 to the parent): canary.
    monkeypatch.setattr(learner, "_run_gate", lambda: gate_result(0.1))
    assert learner.train_step() is not None and learner.version == 1
    v1 = committed_weights(learner, 1)
    # Step 2: KL 1.0 = 2 × max_kl_promoted (0.5): the gate rejects it.
    monkeypatch.setattr(learner, "_run_gate", lambda: gate_result(2 * GATE.max_kl_promoted))
    assert learner.train_step() is not None and learner.version == 2
    assert lifecycles(learner) == {0: "promoted", 1: "canary", 2: "rejected"}
    # Never announced: the policy topic has version 1 only, carrying its stage.
    assert [(e.version, e.lifecycle) for e in announced(learner)] == [(1, "canary")]
    with learner.db.connect() as conn:
        row = conn.execute(select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == 2)).one()
    assert row.status == "committed" and row.parent_version == 1
    assert row.gate["passed"] is False and row.gate["kl_promoted"] == 1.0
    assert row.gate["reasons"] == ["KL to the promoted version 1 nats/token > 0.5"]
    assert not (learner.policy_dir / "v000002").exists()
    # The learner is back on version 1's weights, with fresh optimizer moments.
    assert learner.weights_version == 1 and learner.algorithm.policy_opt.state == {}
    assert_policy_is(learner, v1)
    # The step's samples are quarantined (and counted).
    quarantined = step_sample_ids(learner, 2)
    assert sorted(quarantined) == sorted(fed[BATCH : 2 * BATCH])
    with learner.db.connect() as conn:
        assert (
            conn.execute(select(LearnerCounter.value).where(LearnerCounter.name == "quarantined")).scalar()
            == 2
        )
        # A re-sent copy of a quarantined sample (after its tombstone's TTL) waits beside new ones …
        conn.execute(
            insert(LearnerSample).values(
                id=quarantined[0], prompt_id="p", payload="{}", created_at=utcnow() - timedelta(days=1)
            )
        )
        conn.commit()
    # … and is never picked: step 3 trains the last two fed samples, from version 1.
    monkeypatch.setattr(learner, "_run_gate", lambda: gate_result(0.1))
    assert learner.train_step() is not None and learner.version == 3
    counts = trained_ids(learner)
    assert all(counts[i] == 1 for i in quarantined)  # the rejected step only: zero times after
    assert counts == Counter(fed)
    assert lifecycles(learner)[3] == "canary" and learner.weights_version == 3
    with learner.db.connect() as conn:
        assert (
            conn.execute(select(PolicyVersion.parent_version).where(PolicyVersion.version == 3)).scalar() == 1
        )
    assert events(learner) == [
        (0, None, "promoted", "learner"),
        (1, None, "candidate", "learner"),
        (1, "candidate", "canary", "learner"),
        (2, None, "candidate", "learner"),
        (2, "candidate", "rejected", "learner"),
        (3, None, "candidate", "learner"),
        (3, "candidate", "canary", "learner"),
    ]


def test_a_restart_after_a_gate_rejection_trains_from_the_parent(learner, monkeypatch):
    feed(open_log(learner.settings.resolved_database_url), 2 * BATCH, 0)
    learner.poll_once()
    learner.train_step()
    monkeypatch.setattr(learner, "_run_gate", lambda: gate_result(2 * GATE.max_kl_promoted))
    learner.train_step()
    restarted = Learner(learner.settings, learner.config)
    restarted.load()
    assert (restarted.version, restarted.weights_version) == (2, 1)
    assert_policy_is(restarted, committed_weights(restarted, 1))
    assert [e.version for e in announced(restarted)] == [
        1
    ]  # the rejected version 2 is not announced at start


def rate(
    learner: Learner, version: int, rewards: list[float], at, first: int = 0, arm: str | None = None
) -> None:
    """Record rated single-turn answers dispatched by ``version`` at ``at`` (what the server's
    trajectory index and feedback claims hold), routed to the canary ``arm``."""
    with learner.db.begin() as conn:
        for i, r in enumerate(rewards, start=first):
            add_rated(conn, f"r{version}-{arm}-{i}", version, r, at + timedelta(milliseconds=i), arm=arm)


def test_a_lineage_whose_answers_collapse_is_vetoed_though_the_sparse_rewards_cannot_tell(learner):
    """The broken-learner run of docs/guard.md ("Simulated attacks and faults"): rewards near 0
    on both sides, so the reward rule cannot reject; the lineage's answers turned degenerate."""
    feed(open_log(learner.settings.resolved_database_url), BATCH, 0)
    learner.poll_once()
    before = utcnow() - timedelta(hours=1)
    # The promoted record: 32 ratings, 3 of them wins (mean 0.094: its lower bound is 0), and
    # 60 more answers served unrated; every answer 8 tokens, ended by the model (sound).
    rate(learner, 0, [1.0] * 3 + [0.0] * 29, before)
    with learner.db.begin() as conn:
        for i in range(60):
            add_rated(conn, f"u0-{i}", 0, None, before, state=None)
    learner.train_step()
    # The lineage: 40 ratings of 0 on answers of 1 token (an empty answer and its end token).
    with learner.db.begin() as conn:
        for i in range(40):
            add_rated(conn, f"r1-{i}", 1, 0.0, utcnow(), n_tokens=1)
    # Rewards alone: upper_C on forty 0s is above lower_P = 0 on 3/32, so no rejection...
    assert prpl_eb_lower([1.0] * 3 + [0.0] * 29, 0.025) == 0.0
    rewards_only = judge_lineage([0.0] * 40, [1.0] * 3 + [0.0] * 29, learner.config.guard.rule_params())
    assert rewards_only.decision == Decision.CONTINUE and rewards_only.upper > 0
    # ...the health veto: forty 0s (degenerate) against 92 1s (sound): upper(Δ) < 0.
    assert learner.guard_check() == Decision.REJECT
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert verdict["reason"].startswith("degenerate answers (health veto): ")
    assert (verdict["candidate"]["n"], verdict["candidate"]["mean"]) == (40, 0.0)
    assert (verdict["promoted"]["n"], verdict["promoted"]["mean"]) == (92, 1.0)
    assert lifecycles(learner) == {0: "promoted", 1: "rejected", 2: "promoted"}


def set_kl_ref(learner: Learner, version: int, kl: float, name: str = "kl_ref") -> None:
    """Write ``kl`` as the ``name`` metric (``kl_ref``) of the step that trained ``version``
    (the KL anchor's figure: the tiny test learner runs without the anchor)."""
    with learner.db.begin() as conn:
        row = conn.execute(
            select(LearnerStep.id, LearnerStep.metrics).where(LearnerStep.version == version)
        ).one()
        conn.execute(
            update(LearnerStep).where(LearnerStep.id == row.id).values(metrics=row.metrics | {name: kl})
        )


def test_a_lineage_that_drifted_from_the_promoted_version_is_vetoed_before_its_answers_tell(learner):
    """The broken-learner runs of docs/guard.md: the answers stayed long and the rewards sparse,
    so neither the reward rule nor the health veto could reject, while the training batches'
    KL to the base passed the gate's bound (0.6) at the lineage's 6th-9th version. The veto
    bounds the drift beyond the promoted version's (issue 40: measured from the base, a promoted
    version near the bound had every lineage after it rejected in a loop)."""
    feed(open_log(learner.settings.resolved_database_url), 3 * BATCH, 0)
    learner.poll_once()
    rate(learner, 0, [1.0] * 3 + [0.0] * 29, utcnow() - timedelta(hours=1))
    for _ in range(3):
        learner.train_step()
    assert lifecycles(learner) == {0: "promoted", 1: "canary", 2: "canary", 3: "canary"}
    # Version 1's step measured the promoted version it started from: 0.5 nats/token to the
    # base, near the bound 0.6. Version 2's measured version 1: 0.87 = 0.5 + 0.37, the largest
    # clean drift measured (docs/log/2026-12-05-demo-runs.md) beyond the promoted version's. From the base (0.87 >
    # 0.6) it was rejected; from the promoted version (0.37 <= 0.6) it continues.
    set_kl_ref(learner, 1, 0.5)
    set_kl_ref(learner, 2, 0.87)
    assert learner.guard_check() == Decision.CONTINUE
    # The vetoes' figures are kept at a check that rejects nothing: one drift measured (0.87 −
    # 0.5 = 0.37; version 3's step wrote none, as the test learner runs without the KL anchor),
    # its bound 0.6; the health veto's verdict.
    vetoes = json.loads(get_flag(learner.db, GUARD_VERDICT))["vetoes"]
    assert vetoes["drift"] == {"kl_max": pytest.approx(0.37), "bound": 0.6, "measured": 1}
    assert vetoes["health"]["decision"] == "continue"
    # Version 2, measured by the step trained from it (step 3's kl_ref), 1.14: 1.14 − 0.5 =
    # 0.64 > max_kl_ref 0.6.
    set_kl_ref(learner, 3, 1.14)
    assert learner.guard_check() == Decision.REJECT
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert verdict["reason"] == (
        "drifted from the promoted version (drift veto): a training batch measured KL 0.64 nats/token "
        "beyond the promoted version's, over 0.6"
    )
    assert lifecycles(learner) == {0: "promoted", 1: "rejected", 2: "rejected", 3: "rejected", 4: "promoted"}


def anchored(tmp_path) -> Learner:
    """A learner with the KL anchor (so it can measure a version's drift) whose rule promotes a
    lineage that won as often as the promoted record (δ 0.5)."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    return in_process(tmp_path, url, algorithm={"name": "sao", "kl_coef": 0.1}, guard=GuardConfig(delta=0.5))


def waiting_batch(learner: Learner) -> torch.Tensor:
    """The input ids of the batch ``train_step`` would train next (the samples still waiting)."""
    rows, _ = learner._next_batch()
    return collate([Sample.from_json(json.loads(r.payload)) for r in rows], learner.version).input_ids


def step_metric_of(learner: Learner, version: int, name: str) -> float | None:
    """The metric ``name`` of the step that trained ``version``."""
    with learner.db.connect() as conn:
        return step_metric(conn, [version], name)[version]


def kl_after(learner: Learner, version: int) -> float | None:
    """``version``'s own KL to the base, as the guard measured it before a promotion."""
    return step_metric_of(learner, version, KL_AFTER)


def test_a_lineage_whose_newest_drifted_is_vetoed_at_its_promotion_not_promoted_unmeasured(
    tmp_path, monkeypatch
):
    """Issue 40, item 2's gap: a lineage is promoted on its newest version's ratings, and the
    newest is measured by the step trained from it, which has not run. Before promoting, the
    learner measures it on the next batch, which no version has trained on."""
    learner = anchored(tmp_path)
    feed(open_log(learner.settings.resolved_database_url), 2 * BATCH, 0)
    learner.poll_once()
    rate(learner, 0, [1.0] * 60, utcnow() - timedelta(hours=1))
    learner.train_step()
    # Step 1 started from the base: πθ = π_ref, k3 = e⁰ − 1 − 0 = 0 on every token.
    assert step_metric_of(learner, 1, "kl_ref") == 0.0
    # The promoted version's drift stands at 0.5 (set by hand, as if it had drifted).
    set_kl_ref(learner, 1, 0.5)
    rate(learner, 1, [1.0] * 60, utcnow())  # 60 wins each, δ 0.5: the rule promotes
    expected = waiting_batch(learner)
    measured = []

    def reference_kl(batch):
        measured.append(batch.input_ids)
        return 1.14

    monkeypatch.setattr(learner.algorithm, "reference_kl", reference_kl)
    # Version 1 on the waiting batch: 1.14 − 0.5 = 0.64 > max_kl_ref 0.6: rejected, not promoted.
    assert learner.guard_check() == Decision.REJECT
    assert len(measured) == 1 and torch.equal(measured[0], expected)
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert verdict["reason"] == (
        "drifted from the promoted version (drift veto): a training batch measured KL 0.64 nats/token "
        "beyond the promoted version's, over 0.6"
    )
    assert verdict["vetoes"]["drift"] == {"kl_max": pytest.approx(0.64), "bound": 0.6, "measured": 1}
    assert kl_after(learner, 1) == 1.14
    assert lifecycles(learner) == {0: "promoted", 1: "rejected", 2: "promoted"}
    # The measured batch is still to train (only the samples that trained version 1 are quarantined).
    assert learner.waiting_samples() == BATCH and torch.equal(waiting_batch(learner), expected)
    learner.db.dispose()


def test_a_clean_newest_is_measured_then_promoted_and_the_next_step_reads_the_same_figure(tmp_path):
    learner = anchored(tmp_path)
    feed(open_log(learner.settings.resolved_database_url), 2 * BATCH, 0)
    learner.poll_once()
    rate(learner, 0, [1.0] * 60, utcnow() - timedelta(hours=1))
    learner.train_step()
    set_kl_ref(learner, 1, 0.5)
    rate(learner, 1, [1.0] * 60, utcnow())
    assert learner.guard_check() == Decision.PROMOTE
    # Measured on the waiting batch (the real pass): one step of lr 5e-5 from the base, a small
    # KL m >= 0 (k3 >= 0); m − 0.5 <= 0.6 for any m <= 1.1: promoted.
    m = kl_after(learner, 1)
    assert 0.0 <= m <= 1.1
    assert lifecycles(learner) == {0: "promoted", 1: "promoted"}
    assert json.loads(get_flag(learner.db, GUARD_VERDICT))["lineage"] == [1]
    # The step that trains that batch starts from version 1 and measures it on the same batch,
    # before its update, with the same estimator: the same figure, to the bit.
    assert learner.train_step()["kl_ref"] == m
    learner.db.dispose()


def test_with_no_untrained_batch_the_promotion_waits_for_one_and_it_is_measured_before_it_trains(tmp_path):
    learner = anchored(tmp_path)
    log = open_log(learner.settings.resolved_database_url)
    feed(log, BATCH, 0)
    learner.poll_once()
    rate(learner, 0, [1.0] * 60, utcnow() - timedelta(hours=1))
    learner.train_step()
    rate(learner, 1, [1.0] * 60, utcnow())
    # The rule promotes, but no batch waits to measure version 1 on: deferred, still on probation.
    assert learner.waiting_samples() == 0
    assert learner.guard_check() == Decision.CONTINUE
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert verdict["reason"].startswith(
        "promotion deferred (drift veto): version 1, the newest, has no KL measured yet and no batch "
        "it has not trained on is full ("
    )
    assert lifecycles(learner) == {0: "promoted", 1: "canary"} and kl_after(learner, 1) is None
    # A batch arrives. The loop ticks the guard before it trains: the deferred promotion's batch
    # is measured at once (though the next check is an hour away), version 1 promoted, and only
    # then the batch trains version 2, whose step measures version 1 on it again: the same figure.
    learner.guard._next_check = time.monotonic() + 3600
    feed(log, BATCH, BATCH)
    assert run_until(learner, lambda: 2 in lifecycles(learner))
    assert lifecycles(learner) == {0: "promoted", 1: "promoted", 2: "canary"}
    assert step_metric_of(learner, 2, "kl_ref") == kl_after(learner, 1)
    learner.db.dispose()


def test_a_measure_that_fails_delays_the_promotion_not_the_training(tmp_path, monkeypatch):
    learner = anchored(tmp_path)
    log = open_log(learner.settings.resolved_database_url)
    feed(log, BATCH, 0)
    learner.poll_once()
    rate(learner, 0, [1.0] * 60, utcnow() - timedelta(hours=1))
    learner.train_step()
    rate(learner, 1, [1.0] * 60, utcnow())
    assert learner.guard_check() == Decision.CONTINUE  # deferred: no batch waits

    def reference_kl(batch):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(learner.algorithm, "reference_kl", reference_kl)
    learner.guard._next_check = time.monotonic() + 3600
    feed(log, BATCH, BATCH)
    learner.poll_once()
    # The deferral's measure fails: logged, not raised, and not tried again before the next
    # check; the loop goes on to train.
    learner.guard.tick()
    assert learner.guard._awaiting is None
    # A check due at every tick (check_s 0) measures, fails and defers again: never raises, so
    # the loop's iteration always reaches the step.
    learner.guard._next_check = 0.0
    learner.guard.tick()
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert verdict["decision"] == "continue" and "its measure failed" in verdict["reason"]
    assert learner.train_step() is not None
    assert lifecycles(learner) == {0: "promoted", 1: "canary", 2: "canary"}
    learner.db.dispose()


def test_a_lineage_served_by_a_canary_split_is_judged_against_the_control_arm_of_its_window(learner):
    feed(open_log(learner.settings.resolved_database_url), BATCH, 0)
    learner.poll_once()
    # The promoted version's record before the lineage: 30 losses. On probation a lineage that
    # also lost every rating would be as good as that record (not rejected).
    rate(learner, 0, [0.0] * 30, utcnow() - timedelta(hours=1))
    learner.train_step()
    assert lifecycles(learner) == {0: "promoted", 1: "canary"}
    # The split: the lineage's canary arm lost 30 times while the control arm of the same
    # window (version 0 beside it) won 30 times; an answer of version 0 with no arm after the
    # start (in flight at the swap) and a control answer before it count for neither arm.
    now = utcnow()
    rate(learner, 1, [0.0] * 30, now, arm="canary")
    rate(learner, 0, [1.0] * 30, now, arm="control")
    rate(learner, 0, [0.0] * 5, now, first=100)
    rate(learner, 0, [0.0] * 5, now - timedelta(hours=2), first=200, arm="control")
    # 30 losses against 30 wins, each arm n = 30: upper(Δ) < 0 (tests/unit/core/test_lifecycle.py).
    assert learner.guard_check() == Decision.REJECT
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert verdict["lineage"] == [1] and verdict["decision"] == "reject"
    assert (verdict["candidate"]["n"], verdict["candidate"]["mean"]) == (30, 0.0)
    assert (verdict["promoted"]["n"], verdict["promoted"]["mean"]) == (30, 1.0)
    assert lifecycles(learner) == {0: "promoted", 1: "rejected", 2: "promoted"}


def rate_as(
    learner: Learner, version: int, arm: str, raters: list[tuple[str | None, float]], at, **row
) -> None:
    """Record one rated answer of ``version`` in ``arm`` per ``(identity, reward)`` of ``raters``,
    1 ms apart in that order (``row``: the index row's other fields, e.g. ``train``)."""
    with learner.db.begin() as conn:
        for i, (who, r) in enumerate(raters):
            tid = f"v{version}-{arm}-{at.timestamp()}-{i}"
            add_rated(conn, tid, version, r, at + timedelta(milliseconds=i), arm=arm, identity=who, **row)


def attacked_arm(reward: float) -> list[tuple[str, float]]:
    """120 ratings of one arm: every third (40) from 10 honest users (4 each, 1.0), the other
    80 from one API key rating ``reward``."""
    return [
        (f"user:u{i // 3 % 10}", 1.0) if i % 3 == 0 else ("key:kevil0000000000", reward) for i in range(120)
    ]


def test_one_identity_rating_by_arm_does_not_decide_the_verdict_under_the_identity_cap(learner):
    """Issue 40: one API key rating 0 on the candidate's answers and 1 on the control's, among
    honest raters, got an honest lineage rejected. The honest ratings alone (40 wins in each
    arm) decide nothing yet; the key's 80 ratings an arm decide a rejection unless the guard's
    streams pass the identity cap."""
    feed(open_log(learner.settings.resolved_database_url), BATCH, 0)
    learner.poll_once()
    learner.train_step()
    now = utcnow()
    rate_as(learner, 1, "canary", attacked_arm(0.0), now)
    rate_as(learner, 0, "control", attacked_arm(1.0), now)
    # The cap is off by default (GuardConfig.vote_identity_share None): windows of BATCH votes.
    assert learner.guard.electorate == Electorate(None, BATCH)
    # No cap: 40 wins and 80 losses against 120 wins: rejected... judged first with the
    # guard's electorate off, so the lineage stays for the capped check.
    learner.guard.electorate = Electorate(None, 20)
    with learner.db.connect() as conn:
        created = {1: now - timedelta(seconds=1)}  # before the ratings, however slow the run
        uncapped, _, senders, _ = learner.guard._judge(conn, [1], [0], created)
    assert uncapped.decision == Decision.REJECT and uncapped.candidate.n == 120
    # The cap at share 0.1 of windows of 20: k = 2 votes an identity per window. Window 1: the
    # key's 2 oldest, then the next honest ones up to 20 (18: users 0-9, 0-7, each <= 2);
    # window 2: the key's next 2 (first in line) and 18 honest; window 3: 2 and the last 4
    # honest, 6 < 20: the last. The key counts 6 times, the honest raters 40: 46 an arm.
    learner.guard.electorate = Electorate(0.1, 20)
    assert learner.guard_check() == Decision.CONTINUE
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert (verdict["candidate"]["n"], verdict["candidate"]["mean"]) == (46, pytest.approx(40 / 46))
    assert (verdict["promoted"]["n"], verdict["promoted"]["mean"]) == (46, 1.0)
    # Who held the votes (saoserve_guard_top_sender_share): uncapped, the key 80 of 120 in each
    # arm; capped, 6 of 46 (each honest user 4), among 11 identified senders.
    assert senders["candidate"] == {"votes": 120, "identified": 11, "top_share": pytest.approx(80 / 120)}
    assert verdict["senders"]["candidate"] == {
        "votes": 46,
        "identified": 11,
        "top_share": pytest.approx(6 / 46),
    }
    assert verdict["senders"]["promoted"] == verdict["senders"]["candidate"]


def test_an_opted_out_or_unknown_sender_s_ratings_never_vote(learner):
    """Issue 40: ratings of answers from a key that opted out of training voted (they decided a
    promotion). A key that opts out after its answers were logged (``train`` true on them), a
    record with no flag (indexed before revision 0016) of that key, a record logged ``train:
    false`` (``store: false``, the traffic that is not production), and, with the cap on, an
    answer without identity: none votes."""
    feed(open_log(learner.settings.resolved_database_url), BATCH, 0)
    learner.poll_once()
    learner.train_step()
    store = KeyStore(learner.db)
    info, _ = store.create("acme", utcnow())
    now = utcnow()
    who = f"key:{info.id}"
    rate_as(learner, 1, "canary", [(who, 0.0)] * 30, now)
    rate_as(learner, 0, "control", [(who, 1.0)] * 30, now)
    learner.guard.electorate = Electorate(None, BATCH)
    with learner.db.connect() as conn:
        created = {1: now - timedelta(seconds=1)}  # before the ratings, however slow the run
        assert learner.guard._judge(conn, [1], [0], created)[0].decision == Decision.REJECT
    store.set_train(info.id, False)
    rate_as(learner, 1, "canary", [(who, 0.0)] * 30, now + timedelta(seconds=1), train=None)
    rate_as(learner, 1, "canary", [("user:probe", 0.0)] * 30, now + timedelta(seconds=2), train=False)
    assert learner.guard_check() == Decision.CONTINUE
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert (verdict["candidate"]["n"], verdict["promoted"]["n"]) == (0, 0)
    # Anonymous answers vote while the cap is off, not once it is on.
    rate_as(learner, 1, "canary", [(None, 0.0)] * 30, now + timedelta(seconds=3))
    rate_as(learner, 0, "control", [(None, 1.0)] * 30, now + timedelta(seconds=3))
    with learner.db.connect() as conn:
        assert learner.guard._judge(conn, [1], [0], created)[0].candidate.n == 30
    learner.guard.electorate = Electorate(0.5, BATCH)
    assert learner.guard_check() == Decision.CONTINUE
    assert json.loads(get_flag(learner.db, GUARD_VERDICT))["candidate"]["n"] == 0


def test_a_lineage_worse_than_the_promoted_record_is_rejected_and_rolled_back_while_paused(learner):
    fed = feed(open_log(learner.settings.resolved_database_url), 2 * BATCH, 0)
    learner.poll_once()
    before = utcnow() - timedelta(hours=1)
    rate(learner, 0, [1.0] * 30, before)  # the promoted version's record, before the lineage
    learner.train_step()
    learner.train_step()
    assert lifecycles(learner) == {0: "promoted", 1: "canary", 2: "canary"}
    # Too few ratings of each version: 19 and 11 < min_samples 20. Each version is judged on its
    # own ratings (issue 40): the lineage's 30 losses together no longer decide.
    rate(learner, 1, [0.0] * 19, utcnow())
    rate(learner, 2, [0.0] * 11, utcnow())
    assert learner.guard_check() == Decision.CONTINUE
    rate(learner, 2, [0.0] * 19, utcnow(), first=11)
    set_flag(learner.db, PAUSED, "1")  # the guard acts while training is paused
    # Version 2 (the lineage's second: α_2 = 0.05 / (2·3)), 30 losses against 30 wins. Each
    # side at α_2 / 2 = 1/240: lower_P on thirty 1s is l, upper_C on thirty 0s its mirror 1 − l,
    # so upper(Δ) = 1 − 2l < 0 (l > 1/2; tests/unit/core/test_lifecycle.py writes the bound out).
    low = prpl_eb_lower([1.0] * 30, 0.05 / 6 / 2)
    assert learner.guard_check() == Decision.REJECT
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert low > 0.5 and verdict["upper"] == pytest.approx(1 - 2 * low)
    assert verdict["reason"].startswith("version 2 of 2 (α_j = 0.00833): worse")
    assert lifecycles(learner) == {0: "promoted", 1: "rejected", 2: "rejected", 3: "promoted"}
    # Version 3 carries version 0's weights, is announced promoted, and the learner is on it.
    with learner.db.connect() as conn:
        row = conn.execute(select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == 3)).one()
        q = Counter(conn.execute(select(QuarantinedSample.version)).scalars())
    assert row.parent_version == 0 and row.metrics == {"rollback_to": 0}
    assert [(e.version, e.lifecycle) for e in announced(learner)][-1] == (3, "promoted")
    # ...and the policy topic says what became of the lineage (notices servers log, never load).
    assert notices(learner) == [(1, "rejected", "guard"), (2, "rejected", "guard")]
    assert learner.weights_version == 3
    # The samples of both rejected versions are quarantined: BATCH each.
    assert q == {1: BATCH, 2: BATCH} and sum(q.values()) == len(fed)
    assert events(learner)[-3:] == [
        (1, "canary", "rejected", "guard"),
        (2, "canary", "rejected", "guard"),
        (3, None, "promoted", "guard"),
    ]
    # Nothing left to judge: the lineage is empty.
    assert learner.guard_check() is None


def test_a_lineage_not_worse_is_promoted_and_a_restart_mid_probation_resumes_it(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", guard=GuardConfig(delta=0.5))
    feed(open_log(learner.settings.resolved_database_url), BATCH, 0)
    learner.poll_once()
    rate(learner, 0, [1.0] * 60, utcnow() - timedelta(hours=1))
    learner.train_step()
    rate(learner, 1, [1.0] * 10, utcnow())
    assert learner.guard_check() == Decision.CONTINUE  # 10 < min_samples 20
    # The verdict is kept for /metrics and the dashboard: the lineage [1], 10 against 60 ratings,
    # all wins (means 1.0).
    with learner.db.connect() as conn:
        shown = read_lifecycle(conn)
    assert (shown.promoted, shown.lineage, shown.stages["canary"]) == (0, [1], 1)
    v = shown.verdict
    assert (v["lineage"], v["decision"], v["timed_out"]) == ([1], "continue", False)
    assert (v["candidate"]["n"], v["promoted"]["n"], v["candidate"]["mean"], v["promoted"]["mean"]) == (
        10,
        60,
        1.0,
        1.0,
    )
    assert -1.0 <= v["lower"] <= v["upper"] <= 1.0
    # A restart mid-probation: the same stage, weights and verdict (the state is the database's).
    restarted = Learner(learner.settings, learner.config)
    restarted.load()
    assert lifecycles(restarted)[1] == "canary" and restarted.weights_version == 1
    assert_policy_is(restarted, committed_weights(restarted, 1))
    assert restarted.guard_check() == Decision.CONTINUE
    # 60 wins each: lower(Δ) = lower_C − upper_P = lower_C − 1 > −δ = −0.5 (tests/unit/core/test_lifecycle.py).
    rate(restarted, 1, [1.0] * 50, utcnow() + timedelta(seconds=1), first=10)
    assert restarted.guard_check() == Decision.PROMOTE
    assert lifecycles(restarted) == {0: "promoted", 1: "promoted"}
    assert events(restarted)[-1] == (1, "canary", "promoted", "guard")
    assert notices(restarted) == [(1, "promoted", "guard")]
    # Promoted: the lineage is empty, and its verdict is no longer shown.
    with restarted.db.connect() as conn:
        shown = read_lifecycle(conn)
    assert (shown.promoted, shown.lineage, shown.verdict) == (1, [], None)
    learner.db.dispose()
    restarted.db.dispose()


def test_an_operator_rejecting_the_version_serving_rolls_it_back_even_with_the_guard_off(learner):
    from core.control import GUARD_OFF
    from core.lifecycle_store import transition

    fed = feed(open_log(learner.settings.resolved_database_url), BATCH, 0)
    learner.poll_once()
    learner.train_step()
    set_flag(learner.db, GUARD_OFF, "1")
    with learner.db.begin() as conn:
        transition(conn, 1, "rejected", "alice", "answers in the wrong language", utcnow())
    assert learner.guard_check() == Decision.REJECT
    assert lifecycles(learner) == {0: "promoted", 1: "rejected", 2: "promoted"}
    assert sorted(step_sample_ids(learner, 1)) == sorted(fed)
    assert [(e.version, e.lifecycle) for e in announced(learner)] == [(1, "canary"), (2, "promoted")]
    assert events(learner)[-2:] == [(1, "canary", "rejected", "alice"), (2, None, "promoted", "guard")]


def test_the_gate_as_the_learner_runs_it_computes_the_reference_once(tmp_path, monkeypatch):
    """Two steps, two gates (against the base, then against version 1): the base's answers are
    generated once, and each verdict is the one ``run_gate`` gives without them."""
    import learner.guard.gate as gate

    cfg = GateConfig(max_kl_base=100.0, max_kl_promoted=100.0, max_new_tokens=8)
    learner = in_process(
        tmp_path,
        f"sqlite:///{tmp_path / 'db.sqlite'}",
        model_dir=gate_model_dir(tmp_path / "model"),
        guard=GuardConfig(gate=cfg),
    )
    references, gates = [], []
    real_reference, real_gate = gate.reference_answers, gate.run_gate

    def counted_reference(*args):
        references.append(real_reference(*args))
        return references[-1]

    def kept_gate(candidate, base, promoted, tokenizer, config, judge=None, reference=None):
        result = real_gate(candidate, base, promoted, tokenizer, config, judge=judge, reference=reference)
        # The models as the gate saw them: the policy trains on, the parent is reloaded.
        gates.append(
            (copy.deepcopy(candidate), base, copy.deepcopy(promoted), tokenizer, config, reference, result)
        )
        return result

    monkeypatch.setattr(gate, "reference_answers", counted_reference)
    monkeypatch.setattr(gate, "run_gate", kept_gate)
    feed(open_log(learner.settings.resolved_database_url), 2 * BATCH, 0, vocab=GATE_VOCAB)
    learner.poll_once()
    assert learner.train_step() is not None and learner.train_step() is not None
    assert len(references) == 1 and len(gates) == 2
    (first_promoted, second_promoted) = (g[2] for g in gates)
    assert first_promoted is None and second_promoted is not None  # the base, then version 1
    assert all(g[5] is references[0] for g in gates)
    with learner.db.connect() as conn:
        stored = dict(conn.execute(select(PolicyVersion.version, PolicyVersion.gate)).all())
    for version, (candidate, base, promoted, tokenizer, config, _, result) in enumerate(gates, start=1):
        alone = real_gate(candidate, base, promoted, tokenizer, config)
        assert result.model_dump(exclude={"elapsed_s"}) == alone.model_dump(exclude={"elapsed_s"})
        assert result.passed and stored[version]["kl_base"] == result.kl_base
    assert lifecycles(learner) == {0: "promoted", 1: "canary", 2: "canary"}
    learner.db.dispose()


def learner_state(learner: Learner) -> dict:
    """A deep copy of the learner's whole state (policy, critic, both optimizers, step count,
    baselines): ``Algorithm.state_dict``."""
    return copy.deepcopy(learner.algorithm.state_dict())


def assert_same_state(a: dict, b: dict) -> None:
    """Every tensor of two ``learner_state``s equal, and every other entry (step count)."""

    def leaves(x, path=()):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from leaves(v, (*path, k))
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                yield from leaves(v, (*path, i))
        else:
            yield path, x

    la, lb = dict(leaves(a)), dict(leaves(b))
    assert la.keys() == lb.keys()
    for k, va in la.items():
        vb = lb[k]
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), k
        else:
            assert va == vb, k


def test_a_rollback_restores_the_whole_learner_also_after_a_crash_right_after_its_commit(tmp_path):
    """Issue 40, item 5: at the restore the critic was still the rejected lineage's, the step
    count was not reverted, and a restart right after the rollback's commit brought the
    lineage's optimizer entries back (from its checkpoint)."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    learner = in_process(tmp_path, url, guard=GuardConfig(delta=0.5), checkpoint_every=1)
    feed(open_log(learner.settings.resolved_database_url), 3 * BATCH, 0)
    learner.poll_once()
    rate(learner, 0, [1.0] * 60, utcnow() - timedelta(hours=1))
    learner.train_step()
    rate(learner, 1, [1.0] * 60, utcnow())
    assert learner.guard_check() == Decision.PROMOTE  # 60 wins each, δ 0.5
    promoted = learner_state(learner)  # version 1's, kept at its promotion
    assert promoted["step"] == 1 and promoted["critic_optimizer"]["state"]
    learner.train_step()
    learner.train_step()  # the lineage [2, 3]: the critic, both optimizers and the step move on
    moved = learner_state(learner)
    assert moved["step"] == 3
    assert any(not torch.equal(moved["critic"][k], promoted["critic"][k]) for k in promoted["critic"])
    # The drift veto rejects the lineage: version 2's drift (measured by step 3) 0.7 > 0.6.
    set_kl_ref(learner, 3, 0.7)
    assert learner.guard_check() == Decision.REJECT
    assert lifecycles(learner) == {0: "promoted", 1: "promoted", 2: "rejected", 3: "rejected", 4: "promoted"}
    # The restore: version 1's whole state (the step count back to 1), published as version 4.
    assert_same_state(learner_state(learner), promoted)
    assert learner.weights_version == 4 and learner.algorithm.steps == 1
    # A crash right after the rollback's commit: checkpoint.pt still holds version 3 (the
    # lineage's); a restart resumes from the state kept with version 4 (version 1's).
    restarted = Learner(learner.settings, learner.config)
    restarted.load()
    assert restarted.version == 4 and restarted.weights_version == 4
    assert_same_state(learner_state(restarted), promoted)
    learner.db.dispose()
    restarted.db.dispose()
