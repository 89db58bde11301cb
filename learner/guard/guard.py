"""The guard in the learner: the stage a new version enters, and the verdict on the lineage on
probation carried out (docs/guard.md, "The gate" and "The lifecycle"; docs/design.md §9.1).

A version the learner trains is gated first (``learner.guard.gate.run_gate`` against the base and its
parent): it enters ``canary`` (probation) when the gate passes or none is configured,
``rejected`` when it fails, ``promoted`` with the guard off. Then, every ``guard.check_s``
seconds, the lineage on probation is judged against the promoted versions' record, each of
its versions on its own ratings, with only the answers that may vote (``learner.guard.guard_votes``:
no opted-out answer, the identity cap). The decisions are pure and live below: the stages, the
moves and the rule in ``core.lifecycle`` and ``core.sequential``, their rows in
``core.lifecycle_store``. This module does the I/O around them: it reads the votes, records the
verdict, commits the moves, quarantines the samples of a rejected lineage with the rollback
that restores the promoted version's whole learner state (the learner's, passed in), keeps the
promoted version's learner state, and sends the stage notices.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from datetime import datetime
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine

from core import lifecycle_store
from core.control import GUARD_OFF, GUARD_PIN, GUARD_VERDICT, get_flag, set_flag
from core.db import PolicyVersion, TrajectoryIndex, bump_counter
from core.keys import opted_out_keys, trusted_keys
from core.lifecycle import GUARD, Arm, Stage, drifted, lineage
from core.logbus import LogTransport
from core.records import POLICY_KEY, TOPIC_POLICY, as_utc, utcnow
from core.sequential import Decision, Verdict, decide_lineage
from learner.faults import fault_point
from learner.guard.gate_models import GateReferences
from learner.guard.guard_config import GuardConfig
from learner.guard.guard_votes import Electorate, Senders, Tally, health_votes, rated_votes, values
from learner.publish import AlsoCommit, promoted_version, storable

log = logging.getLogger(__name__)

HELD_BACK_WARNING = 40
"""Ratings held back by the vote cap, in an arm, from which the guard warns (``_log_held_back``),
as the alert ``SaoserveGuardVotesHeldBack`` fires from 40."""


KL_AFTER = "kl_ref_after"
"""The step metric (``learner_steps.metrics`` of the step that trained a version) that holds the
version's own KL to the base, measured by the guard before it promoted a lineage whose newest the
version was (``Guard._measure``; nats per action token, as ``kl_ref``)."""


class DriftProbe(Protocol):
    """The learner's measure of ``version``'s KL to the base before the guard promotes it
    (``learner.process.Learner.measure_drift``): the KL anchor's k3 estimate (as ``kl_ref``, nats
    per action token, no gradient) of the policy, which holds ``version``, on the next batch the
    learner would train (which no version has trained on); None when it cannot now (no batch is
    full, or the policy does not hold ``version``). Raises what the pass raises."""

    def __call__(self, version: int) -> float | None: ...


class Rollback(Protocol):
    """Publish ``version``'s weights as a new, promoted version by ``actor``, committing
    ``also(conn, new_version, now)`` with it; returns the new version, None when refused
    (``learner.process.Learner.rollback``)."""

    def __call__(self, version: int, *, actor: str, also: AlsoCommit) -> int | None: ...


class Guard:
    """The guard of one learner: ``db`` and ``log`` the learner's, ``config`` its ``guard``
    section, ``references`` the gate's reference models, ``rollback`` the learner's restore of a
    version's weights, ``electorate`` who votes (``learner.guard.guard_votes``: the learner's identity
    cap and batch size), ``keep_state`` the learner's keeping of a promoted version's state
    (``learner.process.Learner.keep_state``), ``keys_db`` the database of the API keys (default
    ``db``; a tenant namespace's learner passes the global one), ``drift_probe`` the learner's
    measure of the newest version's drift before a promotion (None: the learner has no KL anchor
    and measures none; the drift veto then never fires). Not thread-safe: the learner's loop
    drives it."""

    def __init__(
        self,
        db: Engine,
        log: LogTransport,
        config: GuardConfig,
        references: GateReferences,
        rollback: Rollback,
        electorate: Electorate,
        keep_state: Callable[[int], None],
        keys_db: Engine | None = None,
        drift_probe: DriftProbe | None = None,
    ) -> None:
        self.db = db
        self.drift_probe = drift_probe
        self.keys_db = keys_db or db
        self.electorate = electorate
        self.keep_state = keep_state
        self.log = log
        self.config = config
        self.references = references
        self.rollback = rollback
        # When the lineage is next evaluated (time.monotonic).
        self._next_check = 0.0
        # The newest version whose promotion waits for its drift figure (``_check``), None when
        # none waits.
        self._awaiting: int | None = None
        # The first version of the lineage whose held-back ratings were last logged, so a
        # lineage the cap holds is logged once, not at every check.
        self._held_back_logged: int | None = None

    def on(self) -> bool:
        """Whether the lifecycle runs: on in the config and not turned off by an operator."""
        return self.config.enabled and get_flag(self.db, GUARD_OFF) != "1"

    def run_gate(self, policy, parent: int):
        """The gate (``learner.guard.gate.run_gate``) on ``policy`` just stepped, against the base and
        ``parent``, the version it was trained from (serving now), in eval mode (its training
        mode is restored after); the ``GateResult``, None when the guard is off or no gate is
        configured. Raises what loading the references or the gate raises."""
        cfg = self.config.gate
        if cfg is None or not self.on():
            return None
        from learner.guard.gate import run_gate

        base, parent_model, tokenizer = self.references.models(parent)
        reference = self.references.answers(cfg)
        training = policy.training
        policy.eval()
        try:
            return run_gate(policy, base, parent_model, tokenizer, cfg, reference=reference)
        finally:
            policy.train(training)

    def tick(self) -> None:
        """``check`` at most every ``guard.check_s`` seconds, and at once when the figure a
        deferred promotion waits for could be measured (``_measure``: a batch is full). The
        learner's loop ticks before it trains (``learner.process.Learner.run``), so the batch
        that ends a deferral is measured before a step trains on it. A measure that fails is
        logged and not tried again before the next check, and the loop goes on to train: a pass
        that keeps failing delays promotions, never the training."""
        now = time.monotonic()
        waiting, self._awaiting = self._awaiting, None
        if waiting is not None:
            measured = self._measure(waiting)
            if measured:
                self._next_check = now
            elif measured is False:
                self._awaiting = waiting
        if now < self._next_check:
            return
        self._next_check = now + self.config.check_s
        self.check()

    def check(self) -> Decision | None:
        """``_check``; then, with the guard on, the promoted version's learner state is kept if
        the learner holds it (promoted by this check, by an operator, or a rollback's), for a
        later rollback to restore whole (``keep_state``)."""
        decision = self._check()
        if self.on():
            self.keep_state(promoted_version(self.db).version)
        return decision

    def _check(self) -> Decision | None:
        """Evaluate the lineage on probation and carry out the verdict (docs/guard.md, "The
        lifecycle"); returns the decision, None when there was nothing to judge.

        First, a version that serves (announced) but was rejected since (by an operator) is
        rolled back, guard on or off: the promoted version's weights are published as a new
        version. Then, unless the guard is off or an operator pinned the promoted version, each
        version of the lineage is judged on its own rated answers against the promoted versions'
        (``_judge``): when a canary split served the lineage (its answers carry the canary arm),
        its canary-arm answers against the promoted versions' control-arm answers of its own
        window; on probation, its answers against the promoted versions' from before the lineage.
        Unless that rejects, the drift veto rejects a lineage one of whose versions measured a KL
        to the base more than ``guard.max_kl_ref`` beyond the promoted version's on a training
        batch (``drift_from_promoted``, ``core.lifecycle.drifted``);
        then the health veto compares the same arms' shares of sound answers
        (every answer, rated or not; ``guard.min_answer_tokens``) and rejects when the lineage's
        is surely lower. A ``promote`` whose newest version no step has measured yet first has
        the learner measure it (``_measure``) and is judged again with that figure, so the drift
        veto can still reject; when it cannot be measured now (no batch is full) the promotion
        is deferred (``continue``, the reason says why) until a batch fills, which ``tick``
        measures before a step trains on it. ``promote`` moves every version of the lineage to
        ``promoted``; ``reject`` moves them to ``rejected``, quarantines the samples that
        trained them and publishes the promoted version's weights as a new, promoted version,
        all in one transaction.
        """
        self._awaiting = None
        with self.db.connect() as conn:
            rows = conn.execute(
                select(
                    PolicyVersion.version,
                    PolicyVersion.lifecycle,
                    PolicyVersion.status,
                    PolicyVersion.created_at,
                ).order_by(PolicyVersion.version)
            ).all()
            st = lifecycle_store.stages(conn)
            served = [r for r in rows if r.status == "published"]
            if served and served[-1].lifecycle == Stage.REJECTED:
                self._reject_lineage([], "an operator rejected the version serving")
                return Decision.REJECT
            members = lineage(st)
            if not members or not self.on() or get_flag(self.db, GUARD_PIN) is not None:
                return None
            created = {r.version: as_utc(r.created_at) for r in rows if r.version in members}
            promoted = [v.version for v in st if v.stage == Stage.PROMOTED]
            verdict, vetoes, senders, unmeasured = self._judge(conn, members, promoted, created)
        if unmeasured is not None:
            measured = self._measure(unmeasured)
            if measured:
                with self.db.connect() as conn:
                    verdict, vetoes, senders, unmeasured = self._judge(conn, members, promoted, created)
            if unmeasured is not None:
                if measured is False:
                    self._awaiting = unmeasured
                why = {
                    False: "no batch it has not trained on is full",
                    None: "its measure failed (logged; the next check tries again)",
                }.get(measured, "its figure did not reach the judgement (the next check tries again)")
                verdict = replace(
                    verdict,
                    decision=Decision.CONTINUE,
                    reason=f"promotion deferred (drift veto): version {unmeasured}, the newest, has no "
                    f"KL measured yet and {why} ({verdict.reason})",
                )
        self._record_verdict(members, verdict, vetoes, senders)
        self._log_held_back(members, senders)
        if verdict.decision == Decision.PROMOTE:
            now = utcnow()
            with self.db.begin() as conn:
                for v in members:
                    lifecycle_store.transition(conn, v, Stage.PROMOTED, GUARD, verdict.reason, now)
                fault_point("during_guard_promote")
            fault_point("after_guard_promote")
            self._notify(members, Stage.PROMOTED, GUARD)
            log.info("guard: versions %s promoted: %s", members, verdict.reason)
        elif verdict.decision == Decision.REJECT:
            self._reject_lineage(members, verdict.reason)
        return verdict.decision

    def _judge(
        self, conn: Connection, members: list[int], promoted: list[int], created: dict[int, datetime]
    ) -> tuple[Verdict, dict, dict, int | None]:
        """The rule's verdict on the lineage ``members`` (each recorded at ``created[v]``, UTC)
        against the ``promoted`` versions, then the vetoes (``check``); with the vetoes' own
        figures at this check, whatever the verdict: ``{"drift": {"kl_max", "bound",
        "measured"}, "health": Verdict as a dict}`` (a key absent when its veto is off); who
        holds the counted ratings of the two arms of the version the verdict is about
        (``{"candidate": Senders, "promoted": Senders}`` as dicts, ``guard_votes.Senders``); and the
        newest version when the verdict promotes but the drift veto has no figure of it yet and
        the learner can measure one (``drift_probe``), else None.

        Each version of the lineage is judged on its own answers (``decide_lineage``): with a
        canary split, its canary-arm answers against the promoted versions' control-arm answers
        dispatched while it was the newest (from its record to the next version's); on
        probation, its answers against the promoted versions' newest ``promoted_window`` from
        before the lineage. Only the answers that vote count (``learner.guard.guard_votes``)."""
        guard = self.config
        with self.keys_db.connect() as keys:
            opted = opted_out_keys(keys)
            voters = self.electorate.with_trusted(trusted_keys(keys))
        started = created[members[0]]
        split = _served_split(conn, members)
        ends = [created[v] for v in members[1:]] + [None]
        before_lineage = {"before": started, "limit": guard.promoted_window}

        def arms(votes, *args) -> list[tuple[Tally, Tally]]:
            if not split:
                comparison = votes(conn, promoted, *args, voters, opted, **before_lineage)
                return [(votes(conn, [v], *args, voters, opted), comparison) for v in members]
            return [
                (
                    votes(conn, [v], *args, voters, opted, arm=Arm.CANARY),
                    votes(
                        conn, promoted, *args, voters, opted, arm=Arm.CONTROL, since=created[v], before=end
                    ),
                )
                for v, end in zip(members, ends, strict=True)
            ]

        elapsed = max((utcnow() - started).total_seconds(), 0.0)
        rated = arms(rated_votes)
        j, verdict = decide_lineage(
            [(values(own.votes), values(other.votes)) for own, other in rated],
            guard.rule_params(),
            elapsed_s=elapsed,
        )
        own, other = rated[j] if j is not None else (Tally([]), Tally([]))
        senders = {
            "candidate": asdict(Senders.of(own, voters.trusted)),
            "promoted": asdict(Senders.of(other, voters.trusted)),
        }
        vetoes: dict = {}
        drift: list[float | None] = []
        if guard.max_kl_ref is not None:
            before = lifecycle_store.step_metric(conn, members, "kl_ref")
            drift = drift_from_promoted(members, before, lifecycle_store.step_metric(conn, members, KL_AFTER))
            known = [d for d in drift if d is not None]
            vetoes["drift"] = {
                "kl_max": max(known, default=None),
                "bound": guard.max_kl_ref,
                "measured": len(known),
            }
            over = drifted(drift, guard.max_kl_ref)
            if verdict.decision != Decision.REJECT and over is not None:
                verdict = replace(
                    verdict,
                    decision=Decision.REJECT,
                    reason=f"drifted from the promoted version (drift veto): a training batch measured KL "
                    f"{over:.3g} nats/token beyond the promoted version's, over {guard.max_kl_ref}",
                )
        if guard.min_answer_tokens is not None:
            _, health = decide_lineage(
                [
                    (values(own.votes), values(other.votes))
                    for own, other in arms(health_votes, guard.min_answer_tokens)
                ],
                guard.health_params(),
                promotes=False,
            )
            vetoes["health"] = asdict(health)
            if verdict.decision != Decision.REJECT and health.decision == Decision.REJECT:
                verdict = replace(health, reason=f"degenerate answers (health veto): {health.reason}")
        promotes = verdict.decision == Decision.PROMOTE
        unmeasured = promotes and bool(drift) and drift[-1] is None and self.drift_probe is not None
        return verdict, vetoes, senders, members[-1] if unmeasured else None

    def _log_held_back(self, members: list[int], senders: dict) -> None:
        """Warn, once a lineage, when the identity cap holds back more of an arm's ratings than
        it counts, ``HELD_BACK_WARNING`` or more (the alert ``SaoserveGuardVotesHeldBack``'s
        condition, without its 30 minutes): the verdict waits on the cap, which is right
        against a flooding key and wrong for keys that rate for many people, which the operator
        trusts (docs/guard.md, "Who votes")."""
        held = {
            arm: s
            for arm, s in senders.items()
            if s["held_back"] >= HELD_BACK_WARNING and s["held_back"] > s["votes"]
        }
        if not held or self._held_back_logged == members[0]:
            return
        self._held_back_logged = members[0]
        log.warning(
            "guard: the vote cap holds back more ratings than it counts on versions %s (%s); if they "
            "come through a key that rates for many people (a backend, a judge), trust it: "
            "saoserve admin keys trust KEY_ID on",
            members,
            "; ".join(f"{arm}: {s['votes']} counted, {s['held_back']} held back" for arm, s in held.items()),
        )

    def _measure(self, version: int) -> bool | None:
        """Have the learner measure ``version``'s drift (``drift_probe``) and keep the figure as
        ``KL_AFTER`` of the step that trained it, where ``_judge`` reads it. True: measured and
        kept; False: the probe cannot now (no full batch; the caller waits for one); None: it
        failed, or ``version`` has no step to keep the figure on (logged; not retried before the
        next check, so a failing pass never holds the loop from training)."""
        try:
            kl = self.drift_probe(version)
            if kl is None:
                return False
            with self.db.begin() as conn:
                kept = lifecycle_store.set_step_metric(conn, version, KL_AFTER, kl)
        except Exception:
            log.exception("guard: measuring version %d's drift before its promotion failed", version)
            return None
        if not kept:
            log.warning("guard: version %d has no learner step to keep its measured drift on", version)
            return None
        log.info("guard: version %d measured %.4g nats/token to the base before its promotion", version, kl)
        return True

    def _record_verdict(self, members: list[int], verdict: Verdict, vetoes: dict, senders: dict) -> None:
        """Keep the verdict (bounds, counts, decision) on ``members`` as the ``guard_verdict``
        flag, for /metrics and the dashboard: ``{"lineage": [...], "at": ISO time, **Verdict,
        "vetoes": ..., "senders": ...}``, the vetoes' figures of ``_judge`` at every check (not
        only once one rejects), so an operator sees how near each is to its bound, and who holds
        each arm's ratings (``saoserve_guard_top_sender_share``, docs/guard.md "Watching who
        votes")."""
        record = (
            {"lineage": members, "at": utcnow().isoformat()}
            | asdict(verdict)
            | {"vetoes": vetoes, "senders": senders}
        )
        set_flag(self.db, GUARD_VERDICT, json.dumps(storable(record)))

    def _reject_lineage(self, members: list[int], reason: str) -> int | None:
        """Reject ``members``, quarantine the samples of every rejected version after the
        promoted one, and publish the promoted version's weights as a new version, in one
        transaction (``rollback``); returns the new version (None: the rollback was refused)."""
        target = promoted_version(self.db)

        def also(conn: Connection, new_version: int, now) -> None:
            for v in members:
                lifecycle_store.transition(conn, v, Stage.REJECTED, GUARD, reason, now)
            rejected = [
                v.version
                for v in lifecycle_store.stages(conn)
                if target.version < v.version < new_version and v.stage == Stage.REJECTED
            ]
            trained = lifecycle_store.trained_sample_ids(conn, rejected)
            n = lifecycle_store.quarantine(conn, trained, f"trained the rejected lineage {rejected}", now)
            bump_counter(conn, lifecycle_store.QUARANTINED, n)
            fault_point("during_guard_reject")

        new_version = self.rollback(target.version, actor=GUARD, also=also)
        if new_version is not None:
            self._notify(members, Stage.REJECTED, GUARD)
        log.warning(
            "guard: lineage %s rejected (%s); version %s restores version %d",
            members,
            reason,
            new_version,
            target.version,
        )
        return new_version

    def _notify(self, versions: list[int], stage: Stage, actor: str) -> None:
        """Append the stage notices of ``versions`` to the policy topic
        (``core.lifecycle_store.stage_events``). A failure is logged, not raised: the move is
        committed, and a notice changes nothing served."""
        try:
            with self.db.connect() as conn:
                events = lifecycle_store.stage_events(conn, versions, stage, actor)
            for e in events:
                self.log.append(TOPIC_POLICY, POLICY_KEY, e.to_json())
        except Exception as exc:
            log.warning("stage notices of versions %s (%s) not sent: %s", versions, stage, exc)


def _served_split(conn: Connection, members: list[int]) -> bool:
    """Whether a canary split served the lineage ``members``: one of their answers carries the
    canary arm (then both arms of each version's window are compared, else probation)."""
    q = select(TrajectoryIndex.id).where(
        TrajectoryIndex.dispatch_version.in_(members), TrajectoryIndex.arm == str(Arm.CANARY)
    )
    return conn.execute(q.limit(1)).first() is not None


def drift_from_promoted(
    members: list[int], before: Mapping[int, float | None], after: Mapping[int, float | None] | None = None
) -> list[float | None]:
    """Each version of the lineage ``members`` (oldest first): how far its KL to the base goes
    beyond the promoted version's, nats per action token, from the KL anchor's figures of the
    steps that trained them: ``before[v]`` (``kl_ref``) measured the policy step v started from,
    on the batch that policy drew; ``after[v]`` (``KL_AFTER``) measured version v itself, the
    same way, on a batch no version had trained on, when the guard was about to promote a
    lineage whose newest it was (``Guard._measure``). So the promoted version's figure is
    ``before[members[0]]`` (the lineage's first step started from it; 0, the base's, when not
    measured), and version v's is the next step's ``before``, else its own ``after``; None where
    nothing measured it (the anchor off, or the newest version until it is measured).

    Why not on the batch that trained it: a version measured on the batch that just trained it
    reads the update's push on those very tokens, many times its drift on the tokens it draws
    itself (docs/log/2026-12-06-drift-veto-fp32.md), and a veto on that figure rejected every
    lineage of a float32 demo. Why beyond the promoted version's: measured from the base alone, a
    promoted version that drifted near the bound had every lineage after it rejected for the
    drift it inherited, in a loop (issue 40); this bounds what the lineage added."""
    after = after or {}
    origin = before.get(members[0]) if members else None
    origin = 0.0 if origin is None else origin
    out: list[float | None] = []
    for i, v in enumerate(members):
        kl = before.get(members[i + 1]) if i + 1 < len(members) else None
        kl = after.get(v) if kl is None else kl
        out.append(None if kl is None else kl - origin)
    return out
