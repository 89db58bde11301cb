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
from collections import Counter
from datetime import timedelta

import pytest
import torch
from sqlalchemy import insert, select

from core.control import GUARD_VERDICT, PAUSED, get_flag, set_flag
from core.db import (
    LearnerCounter,
    LearnerSample,
    PolicyVersion,
    QuarantinedSample,
    VersionStatusEvent,
)
from core.lifecycle import judge_lineage
from core.logbus import open_log
from core.records import PolicyEvent, utcnow
from core.sequential import Decision
from learner.guard.gate import GateConfig, GateResult, decide
from learner.guard.guard_config import GuardConfig
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
    lifecycles,
    rate,
    set_kl_ref,
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
