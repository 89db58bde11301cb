"""The figures ``/metrics`` reads from each policy's database at scrape time, as prometheus
collectors: the learner's counters and its newest step's identity-cap figures, and the version
lifecycle (versions per stage, the guard's switches, the learner's last verdict on the lineage).

Separate from ``server.metrics``, which holds the series this server sets itself while it
serves: these are not counted here but written by the learner and the operators into the
database, so they are read afresh for each scrape (``read_figures``: one connection a policy),
hold the values of the last read, and are kept as they were while a database does not answer.
The dashboard and ``/readyz`` read the lifecycle the same way (``read_lifecycle``), without a
registry. Families and labels: docs/guard.md, "Where the lifecycle shows"; docs/tenants.md,
"Operators" (the ``saoserve_tenant_*`` ones of a tenant policy).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine

from core import lifecycle_store
from core.control import GUARD_OFF, GUARD_PIN, GUARD_VERDICT, PAUSED
from core.db import ControlFlag, LearnerCounter, LearnerStep
from core.lifecycle import Stage, lineage, promoted
from core.policies import GLOBAL
from core.records import as_utc
from server.policy_log import PolicyLog

log = logging.getLogger(__name__)


@dataclass
class Series:
    """One policy's samples of one metric, before /metrics names the family: ``name`` without
    the ``saoserve_`` prefix (``policy_versions``), ``kind`` ``GaugeMetricFamily`` or
    ``CounterMetricFamily``, ``labels``, and ``samples`` as (label values, value)."""

    kind: type[GaugeMetricFamily] | type[CounterMetricFamily]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def add(self, values: tuple[str, ...], value: float) -> Series:
        self.samples.append((values, value))
        return self


class PolicyCollector:
    """A collector of figures that each policy's database holds, read for each scrape: the
    values of each policy's last ``read``, one family per metric name over every policy.

    The global policy's series are ``saoserve_<name>{labels}``; a tenant policy's are
    ``saoserve_tenant_<name>{tenant, labels}`` (docs/tenants.md, "Metrics"), the ``tenant``
    label taking only the policy names the scrape reads (``Settings.tenant_policies``). A
    subclass binds ``what`` (the figures, for the warning), ``fetch(conn, policy)`` (one
    policy's figures, in the caller's connection) and ``series(figures)`` (their ``Series``)."""

    what: str

    def __init__(self) -> None:
        self.readings: dict[str, object] = {}

    def read(self, db: Engine, policy: str = GLOBAL) -> None:
        """Take ``policy``'s figures from its database ``db`` (``read_figures``)."""
        read_figures((self,), db, policy)

    def forget(self, policy: str) -> None:
        """Drop ``policy``'s last figures: its series leave the next scrape (a tenant policy no
        longer served). A policy without figures is left as it is."""
        self.readings.pop(policy, None)

    def collect(self):
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        # A snapshot (another scrape's reads may add a policy meanwhile); the global policy
        # first, then the tenants by name (the reads finish in any order).
        for policy, figures in sorted(list(self.readings.items()), key=lambda kv: (kv[0] != GLOBAL, kv[0])):
            tenant = () if policy == GLOBAL else (policy,)
            for s in self.series(figures):
                name = f"saoserve_{s.name}" if policy == GLOBAL else f"saoserve_tenant_{s.name}"
                family = families.get(name)
                if family is None:
                    labels = [*(("tenant",) if tenant else ()), *s.labels]
                    family = families[name] = s.kind(name, s.doc, labels=labels)
                for values, value in s.samples:
                    family.add_metric([*tenant, *values], value)
        yield from families.values()


def read_figures(collectors: Sequence[PolicyCollector], db: Engine, policy: str) -> None:
    """Take ``policy``'s figures of every one of ``collectors`` from its database ``db``, in one
    connection (a database that does not answer costs one connect wait, not one a collector);
    while it does not answer, each keeps its last ones (one warning naming the policy)."""
    try:
        with db.connect() as conn:
            figures = [c.fetch(conn, policy) for c in collectors]
    except Exception as exc:
        what = " and ".join(c.what for c in collectors)
        PolicyLog(log, policy).warning("%s not read for /metrics: %s", what, exc.__class__.__name__)
        return
    for c, f in zip(collectors, figures, strict=True):
        c.readings[policy] = f


IDENTITY_GAUGES = {
    "identity_top_share": "Largest share of the newest learner batch's reward from one identity (key or user).",
    "identity_top_sample_share": "Largest share of the newest learner batch's samples from one identity.",
    "identity_count": "Distinct identities in the newest learner batch (anonymous samples each one).",
    "identity_deferred": "Samples the identity cap held back at the newest learner step (still waiting).",
}
"""The identity cap's step metrics (learner/data/identity_cap.py) exported as
``saoserve_learner_<name>`` gauges."""


STEP_GAUGES = {
    "reward_mean": ("learner_reward_mean", "Mean reward of the newest learner step's batch, in [0, 1]."),
    "staleness_mean": (
        "learner_staleness_mean",
        "Mean staleness (versions) of the newest learner step's tokens.",
    ),
    "kept_fraction": ("learner_kept_fraction", "Share of the newest learner step's tokens DIS kept."),
    "step_time_s": ("learner_step_seconds", "Duration of the newest learner step (s)."),
}
"""The newest step's figures (``learner_steps.metrics``) exported as gauges for the alerts and the
board (deploy/prometheus, deploy/grafana; issue 42): metric key -> (name, help)."""


@dataclass(frozen=True)
class LearnerFigures:
    """One policy's learner as /metrics shows it: ``counters`` (``learner_counters``, which the
    learner bumps in its commits: ``expired``, ``dead_letters``, ``excluded_*``...; name ->
    count), ``identity`` (the newest step's ``IDENTITY_GAUGES`` figures, those it has),
    ``step`` (its ``STEP_GAUGES`` figures, those it has, and ``at``: its unix time and
    ``version``: the version it published; empty before a step) and ``paused`` (an operator
    paused learning)."""

    counters: dict[str, int]
    identity: dict[str, float]
    step: dict[str, float] = field(default_factory=dict)
    paused: bool = False


def read_learner(conn: Connection) -> LearnerFigures:
    """The learner's counters, the newest step's figures and the pause flag, in the caller's
    connection."""
    counters = dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())
    newest = conn.execute(
        select(LearnerStep.metrics, LearnerStep.created_at, LearnerStep.version)
        .order_by(LearnerStep.id.desc())
        .limit(1)
    ).one_or_none()
    figures = newest.metrics if newest is not None and isinstance(newest.metrics, dict) else {}
    identity = {k: float(figures[k]) for k in IDENTITY_GAUGES if isinstance(figures.get(k), int | float)}
    step = {k: float(figures[k]) for k in STEP_GAUGES if isinstance(figures.get(k), int | float)}
    if newest is not None:
        step["at"] = as_utc(newest.created_at).timestamp()
        step["version"] = float(newest.version)
    paused = conn.execute(select(ControlFlag.value).where(ControlFlag.name == PAUSED)).scalar_one_or_none()
    return LearnerFigures(counters, identity, step, paused == "1")


class LearnerEvents(PolicyCollector):
    """A collector of each policy's learner (``read_learner``): its counters as
    ``saoserve_learner_events_total{event=<counter>}``, the newest step's identity figures
    as ``saoserve_learner_<IDENTITY_GAUGES name>`` and its ``STEP_GAUGES`` (absent before a step
    has them), ``saoserve_learner_last_step_timestamp_seconds`` and ``_version``, and
    ``saoserve_learner_paused``; a tenant
    policy's as ``saoserve_tenant_learner_events_total{tenant,event}`` and
    ``saoserve_tenant_learner_<name>{tenant}``. The global events family is shown before its
    first read, empty."""

    what = "learner counters"

    def __init__(self) -> None:
        super().__init__()
        self.readings[GLOBAL] = LearnerFigures({}, {})

    def fetch(self, conn: Connection, policy: str) -> LearnerFigures:
        return read_learner(conn)

    @staticmethod
    def series(f: LearnerFigures):
        events = Series(
            CounterMetricFamily,
            "learner_events",
            "Learner counters from the database (dead_letters: records and samples set aside).",
            ("event",),
        )
        for name, value in sorted(f.counters.items()):
            events.add((name,), value)
        yield events
        for name, value in f.identity.items():
            yield Series(GaugeMetricFamily, f"learner_{name}", IDENTITY_GAUGES[name]).add((), value)
        for key, (name, doc) in STEP_GAUGES.items():
            if key in f.step:
                yield Series(GaugeMetricFamily, name, doc).add((), f.step[key])
        if "at" in f.step:
            yield Series(
                GaugeMetricFamily,
                "learner_last_step_timestamp_seconds",
                "Unix time at which the newest learner step was recorded.",
            ).add((), f.step["at"])
            yield Series(
                GaugeMetricFamily,
                "learner_last_step_version",
                "The version the newest learner step published.",
            ).add((), f.step["version"])
        yield Series(GaugeMetricFamily, "learner_paused", "1 while an operator has paused learning.").add(
            (), int(f.paused)
        )


@dataclass(frozen=True)
class LifecycleState:
    """The version lifecycle as /metrics and the dashboard show it (docs/guard.md, "Where the
    lifecycle shows").

    ``stages``: how many versions are in each stage (every stage, 0 included); ``promoted``: the
    promoted version (None before the learner recorded version 0); ``lineage``: the versions on
    probation, oldest first; ``guard_on``: the operators' switch (``guard_off`` not set; the
    learner's config may still have the guard off); ``pinned``: the version an operator pinned,
    or None; ``verdict``: the learner's last verdict on *this* lineage (``guard_verdict``: the
    lineage judged, ``at`` ISO time, ``decision``, ``lower``/``upper`` on Δ = μ_candidate −
    μ_promoted, the arms' ``candidate``/``promoted`` ``{n, mean, lower, upper}``, ``timed_out``,
    ``reason``), None when none was computed since the lineage began."""

    stages: dict[str, int]
    promoted: int | None
    lineage: list[int]
    guard_on: bool
    pinned: int | None
    verdict: dict | None


def read_lifecycle(conn: Connection, policy: str = GLOBAL) -> LifecycleState:
    """``policy``'s lifecycle state from its namespace's database, in the caller's connection."""
    st = lifecycle_store.stages(conn)
    flags = dict(
        conn.execute(
            select(ControlFlag.name, ControlFlag.value).where(
                ControlFlag.name.in_((GUARD_OFF, GUARD_PIN, GUARD_VERDICT))
            )
        ).all()
    )
    has_promoted = any(v.stage == Stage.PROMOTED for v in st)
    members = lineage(st) if has_promoted else []
    verdict = None
    try:
        verdict = json.loads(flags.get(GUARD_VERDICT) or "null")
    except ValueError:
        PolicyLog(log, policy).warning("the guard_verdict flag is not JSON; not shown")
    # A verdict on an earlier lineage (promoted or rejected since) says nothing of this one.
    if not (isinstance(verdict, dict) and members and (verdict.get("lineage") or [None])[0] == members[0]):
        verdict = None
    pin = flags.get(GUARD_PIN)
    return LifecycleState(
        stages={str(s): sum(v.stage == s for v in st) for s in Stage},
        promoted=promoted(st) if has_promoted else None,
        lineage=members,
        guard_on=flags.get(GUARD_OFF) != "1",
        pinned=int(pin) if pin is not None and pin.isdigit() else None,
        verdict=verdict,
    )


class LifecycleGauges(PolicyCollector):
    """A collector of each policy's lifecycle (``read_lifecycle``) as gauges of bounded
    cardinality (no label takes a version number); a policy is absent until its first read.

    ``saoserve_policy_versions{stage}`` (the four stages), ``saoserve_policy_promoted_version``,
    ``saoserve_policy_candidate_version`` (the newest version on probation; absent when none),
    ``saoserve_policy_lineage_versions``, ``saoserve_guard_enabled`` (1/0),
    ``saoserve_guard_pinned_version`` (absent unless pinned); and, once the learner has judged
    the current lineage, ``saoserve_guard_delta_bound{bound=lower|upper}``,
    ``saoserve_guard_ratings{arm=candidate|promoted}``, ``saoserve_guard_arm_mean{arm}``,
    ``saoserve_guard_decision{decision=continue|promote|reject}`` (1 for the verdict's),
    ``saoserve_guard_verdict_timestamp_seconds``, and who holds each arm's counted ratings
    (``learner.guard.guard_votes.Senders``): ``saoserve_guard_top_sender_share{arm}`` (the
    largest share one identified sender holds), ``saoserve_guard_identified_senders{arm}`` and
    ``saoserve_guard_votes_held_back{arm}`` (the ratings the identity cap did not count). A
    tenant policy's are the same as
    ``saoserve_tenant_policy_versions{tenant,stage}``, ``saoserve_tenant_guard_enabled{tenant}``..."""

    what = "lifecycle"

    def fetch(self, conn: Connection, policy: str) -> LifecycleState:
        return read_lifecycle(conn, policy)

    @staticmethod
    def series(st: LifecycleState):
        by_stage = Series(
            GaugeMetricFamily, "policy_versions", "Policy versions by lifecycle stage.", ("stage",)
        )
        for stage, n in st.stages.items():
            by_stage.add((stage,), n)
        yield by_stage
        if st.promoted is not None:
            yield Series(GaugeMetricFamily, "policy_promoted_version", "The promoted policy version.").add(
                (), st.promoted
            )
        if st.lineage:
            yield Series(
                GaugeMetricFamily,
                "policy_candidate_version",
                "The newest policy version on probation (canary or candidate).",
            ).add((), st.lineage[-1])
        yield Series(
            GaugeMetricFamily, "policy_lineage_versions", "Versions in the lineage on probation."
        ).add((), len(st.lineage))
        yield Series(GaugeMetricFamily, "guard_enabled", "1 unless an operator turned the guard off.").add(
            (), int(st.guard_on)
        )
        if st.pinned is not None:
            yield Series(
                GaugeMetricFamily, "guard_pinned_version", "The version an operator pinned as promoted."
            ).add((), st.pinned)
        v = st.verdict
        if v is None:
            return
        bounds = Series(
            GaugeMetricFamily,
            "guard_delta_bound",
            "The decision rule's confidence bounds on reward(lineage) - reward(promoted), in [-1, 1].",
            ("bound",),
        )
        ratings = Series(
            GaugeMetricFamily, "guard_ratings", "Rated answers in each arm of the decision rule.", ("arm",)
        )
        means = Series(GaugeMetricFamily, "guard_arm_mean", "Mean reward of each arm, in [0, 1].", ("arm",))
        for side in ("lower", "upper"):
            if v.get(side) is not None:
                bounds.add((side,), v[side])
        for arm in ("candidate", "promoted"):
            a = v.get(arm) or {}
            if a.get("n") is not None:
                ratings.add((arm,), a["n"])
            if a.get("mean") is not None:
                means.add((arm,), a["mean"])
        decision = Series(
            GaugeMetricFamily,
            "guard_decision",
            "1 for the decision of the last verdict on the lineage.",
            ("decision",),
        )
        for d in ("continue", "promote", "reject"):
            decision.add((d,), int(v.get("decision") == d))
        yield from (bounds, ratings, means, decision)
        top = Series(
            GaugeMetricFamily,
            "guard_top_sender_share",
            "The largest share of an arm's counted ratings that one identified sender (API key or user) holds.",
            ("arm",),
        )
        identified = Series(
            GaugeMetricFamily,
            "guard_identified_senders",
            "Identified senders (API keys or users) among an arm's counted ratings.",
            ("arm",),
        )
        held_back = Series(
            GaugeMetricFamily,
            "guard_votes_held_back",
            "An arm's ratings that may vote but the identity cap did not count (a sender past its share).",
            ("arm",),
        )
        for arm, held in (v.get("senders") or {}).items():
            if isinstance(held, dict) and held.get("top_share") is not None:
                top.add((arm,), held["top_share"])
                identified.add((arm,), held.get("identified", 0))
                held_back.add((arm,), held.get("held_back", 0))
        yield from (top, identified, held_back)
        try:
            at = datetime.fromisoformat(v["at"]).timestamp()
        except (KeyError, TypeError, ValueError):
            return
        yield Series(
            GaugeMetricFamily,
            "guard_verdict_timestamp_seconds",
            "Unix time of the last verdict on the lineage.",
        ).add((), at)
