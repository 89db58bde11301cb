"""Prometheus metrics of one server (a registry per app, so tests can run several apps)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine

from core import lifecycle_store
from core.control import GUARD_OFF, GUARD_PIN, GUARD_VERDICT
from core.db import ControlFlag, LearnerCounter, LearnerStep
from core.lifecycle import Stage, lineage, promoted
from core.policies import GLOBAL
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
"""The identity cap's step metrics (learner/identity_cap.py) exported as
``saoserve_learner_<name>`` gauges."""


@dataclass(frozen=True)
class LearnerFigures:
    """One policy's learner as /metrics shows it: ``counters`` (``learner_counters``, which the
    learner bumps in its commits: ``expired``, ``dead_letters``, ``excluded_*``...; name ->
    count) and ``identity`` (the newest step's ``IDENTITY_GAUGES`` figures, those it has)."""

    counters: dict[str, int]
    identity: dict[str, float]


def read_learner(conn: Connection) -> LearnerFigures:
    """The learner's counters and the newest step's identity figures, in the caller's connection."""
    counters = dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())
    newest = conn.execute(
        select(LearnerStep.metrics).order_by(LearnerStep.id.desc()).limit(1)
    ).scalar_one_or_none()
    figures = newest if isinstance(newest, dict) else {}
    identity = {k: float(figures[k]) for k in IDENTITY_GAUGES if isinstance(figures.get(k), int | float)}
    return LearnerFigures(counters, identity)


class LearnerEvents(PolicyCollector):
    """A collector of each policy's learner (``read_learner``): its counters as
    ``saoserve_learner_events_total{event=<counter>}`` and the newest step's identity figures
    as ``saoserve_learner_<IDENTITY_GAUGES name>`` (absent before a step has them); a tenant
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
    ``saoserve_guard_decision{decision=continue|promote|reject}`` (1 for the verdict's) and
    ``saoserve_guard_verdict_timestamp_seconds``. A tenant policy's are the same as
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
        try:
            at = datetime.fromisoformat(v["at"]).timestamp()
        except (KeyError, TypeError, ValueError):
            return
        yield Series(
            GaugeMetricFamily,
            "guard_verdict_timestamp_seconds",
            "Unix time of the last verdict on the lineage.",
        ).add((), at)


def label_counts(counter: Counter, label: str) -> dict[str, int]:
    """``counter``'s counts by its label ``label`` (summed over its other labels); a value
    never counted is absent."""
    out: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels[label]
                out[key] = out.get(key, 0) + int(sample.value)
    return out


NO_TENANT = "-"
"""The ``tenant`` label of requests without an API key."""
OTHER_TENANTS = "other"
"""The ``tenant`` label of every tenant past the first ``MAX_TENANT_LABELS`` one process saw."""
MAX_TENANT_LABELS = 100
# Seconds: the buckets of feedback→served, the global policy's and each tenant policy's.
FEEDBACK_TO_SERVED_BUCKETS = (1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600)


class PolicySeries:
    """The series of one policy's serving: the version it serves and since when, its swaps,
    the stage notices and canary split of its lineage, feedback→served of its versions. Set by
    that policy's ``PolicyWatcher``, ``CanaryRouter``, ``ServerState`` and the admin routes in
    its namespace; ``ServerMetrics`` holds the global policy's, ``TenantPolicyMetrics`` a tenant
    policy's (docs/tenants.md, "A policy per tenant"). A subclass binds ``policy_version``,
    ``policy_swapped_at``, ``swaps``, ``swap_seconds``, ``feedback_to_served`` and
    ``_awaiting_answer``."""

    def serving(self, version: int) -> None:
        """Record that ``version`` serves from now on (both gauges in one step, no await between,
        so a scrape never pairs a version with another version's time)."""
        self.policy_version.set(version)
        self.policy_swapped_at.set(time.time())

    def awaiting_answer(self, version: int, batch_completed_at: float | None) -> None:
        """Start feedback→served for ``version``, trained on a batch completed at
        ``batch_completed_at`` (unix s, from the policy event; None: not measured)."""
        if batch_completed_at is not None:
            self._awaiting_answer[version] = batch_completed_at

    def answered(self, first_token_version: int) -> None:
        """A whole answer was logged whose first token came from ``first_token_version``: it ends
        feedback→served for every awaited version up to that one (each counted once)."""
        done = [v for v in self._awaiting_answer if v <= first_token_version]
        now = time.time()
        for v in done:
            self.feedback_to_served.observe(max(0.0, now - self._awaiting_answer.pop(v)))

    def swapped(self, res) -> None:
        """Record a successful swap (a ``server.engine.SwapResult``)."""
        self.swaps.labels("ok").inc()
        self.swap_seconds.observe(res.seconds)
        self.serving(res.version)


class ServerMetrics(PolicySeries):
    def __init__(self) -> None:
        # Each policy's scrape read in flight, and the one thread it runs in (``read_for_scrape``).
        self._scrape_reads: dict[str, Future] = {}
        self._scrape_pools: dict[str, ThreadPoolExecutor] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "saoserve_requests_total", "Chat requests by outcome.", ["stream", "outcome"], registry=r
        )
        self.failed_before_generation = Counter(
            "saoserve_requests_failed_before_generation_total",
            "Requests that failed before generation (no trajectory).",
            ["reason"],
            registry=r,
        )
        self.trajectories = Counter(
            "saoserve_trajectories_logged_total",
            "Trajectory records made durable.",
            ["finish_reason"],
            registry=r,
        )
        self.log_failures = Counter(
            "saoserve_log_failures_total", "Records the log could not accept.", ["topic"], registry=r
        )
        self.spooled = Counter(
            "saoserve_records_spooled_total",
            "Records kept in the local spool while the log was down.",
            registry=r,
        )
        self.feedback = Counter(
            "saoserve_feedback_total", "Feedback requests by result.", ["result"], registry=r
        )
        self.tokens = Counter("saoserve_generated_tokens_total", "Response tokens generated.", registry=r)
        self.latency = Histogram(
            "saoserve_request_seconds",
            "End-to-end chat latency (s).",
            buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.log_append = Histogram(
            "saoserve_log_append_seconds", "Time to make one record durable (s).", ["topic"], registry=r
        )
        self.policy_version = Gauge("saoserve_policy_version", "Policy version being served.", registry=r)
        self.swaps = Counter("saoserve_policy_swaps_total", "Policy loads by result.", ["result"], registry=r)
        self.stage_events = Counter(
            "saoserve_policy_stage_events_total",
            "Lifecycle moves of announced versions read from the policy topic, by the stage moved to.",
            ["stage"],
            registry=r,
        )
        self.swap_seconds = Histogram("saoserve_policy_swap_seconds", "Hot-swap duration (s).", registry=r)
        self.policy_swapped_at = Gauge(
            "saoserve_policy_swapped_at_seconds",
            "Unix time at which the version being served started serving (swap done, or start).",
            registry=r,
        )
        self.in_flight = Gauge("saoserve_requests_in_flight", "Chat requests being served.", registry=r)
        self.canary_requests = Counter(
            "saoserve_canary_requests_total",
            "Chat requests a canary split routed, by arm (canary: the lineage; control: the promoted version).",
            ["arm"],
            registry=r,
        )
        self.canary_share = Gauge(
            "saoserve_canary_share",
            "The share of new requests this replica routes to the canary lineage (0: no split in effect).",
            registry=r,
        )
        self.learner = LearnerEvents()
        r.register(self.learner)
        self.lifecycle = LifecycleGauges()
        r.register(self.lifecycle)
        self.feedback_to_served = Histogram(
            "saoserve_feedback_to_served_seconds",
            "From the join of the feedback that completed a learner batch to the first whole answer "
            "this replica logged whose first token came from the version trained on it, or a later one (s).",
            buckets=FEEDBACK_TO_SERVED_BUCKETS,
            registry=r,
        )
        # Published versions awaiting their first answer: version -> batch_completed_at (unix s).
        self._awaiting_answer: dict[int, float] = {}
        # Per tenant (docs/tenants.md): the label comes from the key registry, never the request.
        self.tenant_trajectories = Counter(
            "saoserve_tenant_trajectories_logged_total",
            "Trajectory records made durable, by the tenant of the API key that sent them.",
            ["tenant", "finish_reason"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "saoserve_tenant_generated_tokens_total",
            "Response tokens generated, by the tenant of the API key that asked for them.",
            ["tenant"],
            registry=r,
        )
        self.tenant_feedback = Counter(
            "saoserve_tenant_feedback_accepted_total",
            "Feedback accepted, by the tenant of the API key that sent it.",
            ["tenant"],
            registry=r,
        )
        self._tenants: set[str] = set()
        # Per tenant policy (docs/tenants.md, "A policy per tenant"): a tenant policy's serving
        # sets these, never the global policy's series above; ``tenant`` takes only the names
        # of ``Settings.tenant_policies``.
        self.tenant_policy_version = Gauge(
            "saoserve_tenant_policy_version",
            "Version of the tenant's own policy being served.",
            ["tenant"],
            registry=r,
        )
        self.tenant_policy_swapped_at = Gauge(
            "saoserve_tenant_policy_swapped_at_seconds",
            "Unix time at which the version of the tenant's policy being served started serving.",
            ["tenant"],
            registry=r,
        )
        self.tenant_policy_swaps = Counter(
            "saoserve_tenant_policy_swaps_total",
            "Loads of the tenant policy's versions by result.",
            ["tenant", "result"],
            registry=r,
        )
        self.tenant_policy_swap_seconds = Histogram(
            "saoserve_tenant_policy_swap_seconds",
            "Load duration of the tenant policy's versions (s).",
            ["tenant"],
            registry=r,
        )
        self.tenant_stage_events = Counter(
            "saoserve_tenant_policy_stage_events_total",
            "Lifecycle moves of the tenant policy's announced versions, by the stage moved to.",
            ["tenant", "stage"],
            registry=r,
        )
        self.tenant_canary_requests = Counter(
            "saoserve_tenant_canary_requests_total",
            "Chat requests of the tenant policy a canary split routed, by arm.",
            ["tenant", "arm"],
            registry=r,
        )
        self.tenant_canary_share = Gauge(
            "saoserve_tenant_canary_share",
            "The share of the tenant policy's new requests routed to its canary lineage (0: no split).",
            ["tenant"],
            registry=r,
        )
        self.tenant_feedback_to_served = Histogram(
            "saoserve_tenant_feedback_to_served_seconds",
            "feedback→served (as saoserve_feedback_to_served_seconds) of the tenant policy's versions (s).",
            ["tenant"],
            buckets=FEEDBACK_TO_SERVED_BUCKETS,
            registry=r,
        )

    def read_policy(self, policy: str, db: Engine) -> None:
        """Read ``policy``'s learner counters and lifecycle from its namespace's database ``db``
        for a scrape, in one connection (blocking; ``read_for_scrape`` runs it); a database that
        does not answer leaves that policy's last figures (``read_figures``)."""
        read_figures((self.learner, self.lifecycle), db, policy)

    async def read_for_scrape(self, dbs: dict[str, Engine], timeout_s: float) -> None:
        """Read every policy's figures (``read_policy``; ``dbs``: policy -> its database) at
        once, each in a thread of its own policy's, and wait at most ``timeout_s`` seconds: a
        policy whose read has not ended by then keeps its last figures for this scrape, and its
        read goes on (it is not started again while it runs). So one database that does not
        answer neither holds the scrape back past the scraper's own time-out nor takes threads
        from the pool that chat's database work runs in."""
        waits = []
        for policy, db in dbs.items():
            running = self._scrape_reads.get(policy)
            if running is None or running.done():
                pool = self._scrape_pools.setdefault(
                    policy, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"scrape-{policy}")
                )
                running = self._scrape_reads[policy] = pool.submit(self.read_policy, policy, db)
            waits.append(asyncio.wrap_future(running))
        await asyncio.wait(waits, timeout=timeout_s)
        for policy in dbs:
            if not self._scrape_reads[policy].done():
                PolicyLog(log, policy).warning(
                    "learner counters and lifecycle not read within %s s for /metrics", timeout_s
                )

    def of_tenant_policy(self, tenant: str) -> TenantPolicyMetrics:
        """These metrics as ``tenant``'s own policy sets them (``TenantPolicyMetrics``)."""
        return TenantPolicyMetrics(self, tenant)

    def tenant_label(self, tenant: str | None) -> str:
        """The ``tenant`` label of a request: its key's tenant (the registry's name), ``-``
        without a key; past ``MAX_TENANT_LABELS`` distinct tenants in this process, ``other``,
        so the series stay bounded whatever the registry holds."""
        if tenant is None:
            return NO_TENANT
        if tenant not in self._tenants and len(self._tenants) >= MAX_TENANT_LABELS:
            return OTHER_TENANTS
        self._tenants.add(tenant)
        return tenant

    def outcomes(self) -> dict[str, dict[str, int]]:
        """This replica's request counts since it started (the dashboard's refusals): ``chat``
        (requests that reached generation, by outcome: ``ok``, ``aborted``, ``engine_error``,
        ``log_unavailable``), ``chat_refused`` (failed before generation, by reason: 4xx
        ``invalid_request``, 5xx ``storage_unavailable`` / ``engine_error``) and ``feedback``
        (by result: ``accepted``, or the refusal: ``unknown`` 404, ``bad_token`` 403,
        ``duplicate`` 409, ...; docs/design.md §4)."""
        return {
            "chat": label_counts(self.requests, "outcome"),
            "chat_refused": label_counts(self.failed_before_generation, "reason"),
            "feedback": label_counts(self.feedback, "result"),
        }


class Bound:
    """A labelled metric with its first label fixed: ``labels(*rest)`` is
    ``metric.labels(first, *rest)`` (a tenant policy's ``swaps.labels("ok")``)."""

    def __init__(self, metric: Counter, first: str) -> None:
        self.metric, self.first = metric, first

    def labels(self, *rest: str):
        return self.metric.labels(self.first, *rest)


class TenantPolicyMetrics(PolicySeries):
    """``ServerMetrics`` as a tenant policy's watcher, canary router, state and admin routes see
    it: the policy series (``PolicySeries``, the stage events and the canary split) are the
    ``saoserve_tenant_*{tenant}`` ones, so a tenant policy's swap never moves
    ``saoserve_policy_version``; every other attribute (requests, trajectories, the log, the
    registry) is the shared object's, counted once for the replica."""

    def __init__(self, shared: ServerMetrics, tenant: str) -> None:
        self.shared, self.tenant = shared, tenant
        self.policy_version = shared.tenant_policy_version.labels(tenant)
        self.policy_swapped_at = shared.tenant_policy_swapped_at.labels(tenant)
        self.swaps = Bound(shared.tenant_policy_swaps, tenant)
        self.swap_seconds = shared.tenant_policy_swap_seconds.labels(tenant)
        self.stage_events = Bound(shared.tenant_stage_events, tenant)
        self.canary_requests = Bound(shared.tenant_canary_requests, tenant)
        self.canary_share = shared.tenant_canary_share.labels(tenant)
        self.feedback_to_served = shared.tenant_feedback_to_served.labels(tenant)
        self._awaiting_answer: dict[int, float] = {}

    def __getattr__(self, name: str):
        return getattr(self.shared, name)
