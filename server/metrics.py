"""Prometheus metrics of one server (a registry per app, so tests can run several apps): the
series it sets itself while it serves. The figures its registry reads from the database at each
scrape (the learner's counters, the lifecycle) are ``server.db_figures``'s."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy.engine import Engine

from server.db_figures import LearnerEvents, LifecycleGauges, read_figures
from server.policy_log import PolicyLog

log = logging.getLogger(__name__)


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
    ``policy_swapped_at``, ``swaps``, ``swap_seconds``, ``feedback_to_swap``,
    ``feedback_to_served`` and ``_awaiting_answer``."""

    def serving(self, version: int) -> None:
        """Record that ``version`` serves from now on (both gauges in one step, no await between,
        so a scrape never pairs a version with another version's time)."""
        self.policy_version.set(version)
        self.policy_swapped_at.set(time.time())

    def awaiting_answer(self, version: int, batch_completed_at: float | None) -> None:
        """``version`` serves from now on: observe feedback→swap and start feedback→served for
        it, trained on a batch completed at ``batch_completed_at`` (unix s, from the policy
        event; None: not measured). A clock behind the learner's counts 0 s, never less."""
        if batch_completed_at is not None:
            self._awaiting_answer[version] = batch_completed_at
            self.feedback_to_swap.observe(max(0.0, time.time() - batch_completed_at))

    def answered(self, first_token_version: int) -> None:
        """A whole answer was logged whose first token came from ``first_token_version``: it ends
        feedback→served for every awaited version up to that one (each counted once)."""
        done = [v for v in self._awaiting_answer if v <= first_token_version]
        now = time.time()
        for v in done:
            self.feedback_to_served.observe(max(0.0, now - self._awaiting_answer.pop(v)))

    def swapped(self, res) -> None:
        """Record a successful swap (a ``server.engine.types.SwapResult``)."""
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
        self.feedback_to_swap = Histogram(
            "saoserve_feedback_to_swap_seconds",
            "From the join of the feedback that completed a learner batch to this replica serving the "
            "version trained on it (s): feedback→served less the wait for and generation of an answer.",
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
        # Backpressure (server/backpressure.py): 429s by the tenant of the key and the limit.
        self.throttled = Counter(
            "saoserve_requests_throttled_total",
            "Chat requests refused 429 before generation (no trajectory), by the tenant of the API "
            "key that sent them ('-': none) and the limit that refused them.",
            ["tenant", "limit"],
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
        self.tenant_feedback_to_swap = Histogram(
            "saoserve_tenant_feedback_to_swap_seconds",
            "feedback→swap (as saoserve_feedback_to_swap_seconds) of the tenant policy's versions (s).",
            ["tenant"],
            buckets=FEEDBACK_TO_SERVED_BUCKETS,
            registry=r,
        )
        self.tenant_feedback_to_served = Histogram(
            "saoserve_tenant_feedback_to_served_seconds",
            "feedback→served (as saoserve_feedback_to_served_seconds) of the tenant policy's versions (s).",
            ["tenant"],
            buckets=FEEDBACK_TO_SERVED_BUCKETS,
            registry=r,
        )
        # The families a ``TenantPolicyMetrics`` sets (``forget_tenant_policy`` empties them of
        # one tenant policy).
        self.tenant_policy_families = (
            self.tenant_policy_version,
            self.tenant_policy_swapped_at,
            self.tenant_policy_swaps,
            self.tenant_policy_swap_seconds,
            self.tenant_stage_events,
            self.tenant_canary_requests,
            self.tenant_canary_share,
            self.tenant_feedback_to_swap,
            self.tenant_feedback_to_served,
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
            # A tenant policy removed while this scrape waited has no read any more.
            running = self._scrape_reads.get(policy)
            if running is not None and not running.done():
                PolicyLog(log, policy).warning(
                    "learner counters and lifecycle not read within %s s for /metrics", timeout_s
                )

    def of_tenant_policy(self, tenant: str) -> TenantPolicyMetrics:
        """These metrics as ``tenant``'s own policy sets them (``TenantPolicyMetrics``)."""
        return TenantPolicyMetrics(self, tenant)

    def forget_tenant_policy(self, tenant: str) -> None:
        """Take tenant policy ``tenant``'s series off ``/metrics``, once it is no longer served
        (``server.app.TenantPolicySync``) and nothing of it sets them: every series with that
        ``tenant`` label in ``tenant_policy_families``, whatever its other labels (a swap's
        result, a stage, an arm), and its learner counters and lifecycle (``forget`` of each
        collector); its scrape thread is let go. Its figures read by a scrape still in flight
        are dropped when that read ends. A series of its API keys
        (``saoserve_tenant_generated_tokens_total``...) stays: its keys are served by the global
        policy from now on. A name without series is left as it is.

        ``remove_by_labels`` (prometheus-client 0.24) is the public way to find a family's
        series by one label: ``remove`` needs every label's value, and the values a family holds
        are listed only by its private ``_metrics``."""
        for family in self.tenant_policy_families:
            family.remove_by_labels({"tenant": tenant})
        collectors = (self.learner, self.lifecycle)

        def forget(_: Future | None = None) -> None:
            for c in collectors:
                c.forget(tenant)

        forget()
        running = self._scrape_reads.pop(tenant, None)
        if running is not None:
            running.add_done_callback(forget)
        pool = self._scrape_pools.pop(tenant, None)
        if pool is not None:
            pool.shutdown(wait=False)

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
    registry) is the shared object's, counted once for the replica. Its series leave the
    registry with the tenant policy (``ServerMetrics.forget_tenant_policy``)."""

    def __init__(self, shared: ServerMetrics, tenant: str) -> None:
        self.shared, self.tenant = shared, tenant
        self.policy_version = shared.tenant_policy_version.labels(tenant)
        self.policy_swapped_at = shared.tenant_policy_swapped_at.labels(tenant)
        self.swaps = Bound(shared.tenant_policy_swaps, tenant)
        self.swap_seconds = shared.tenant_policy_swap_seconds.labels(tenant)
        self.stage_events = Bound(shared.tenant_stage_events, tenant)
        self.canary_requests = Bound(shared.tenant_canary_requests, tenant)
        self.canary_share = shared.tenant_canary_share.labels(tenant)
        self.feedback_to_swap = shared.tenant_feedback_to_swap.labels(tenant)
        self.feedback_to_served = shared.tenant_feedback_to_served.labels(tenant)
        self._awaiting_answer: dict[int, float] = {}

    def __getattr__(self, name: str):
        return getattr(self.shared, name)
