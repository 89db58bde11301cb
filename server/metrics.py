"""Prometheus metrics of one server (a registry per app, so tests can run several apps)."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from sqlalchemy import select
from sqlalchemy.engine import Engine

from core.db import LearnerCounter

log = logging.getLogger(__name__)


class LearnerEvents:
    """A collector of the learner's counters (``learner_counters``, which the learner bumps in its
    commits: ``expired``, ``dead_letters``, ``excluded_*``...) as
    ``saoserve_learner_events_total{event=<counter>}``: the values of the last ``read``."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def read(self, db: Engine) -> None:
        """Take the counters from the database; while it does not answer, keep the last ones."""
        try:
            with db.connect() as conn:
                self.values = dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())
        except Exception as exc:
            log.warning("learner counters not read for /metrics: %s", exc.__class__.__name__)

    def collect(self):
        family = CounterMetricFamily(
            "saoserve_learner_events",
            "Learner counters from the database (dead_letters: records and samples set aside).",
            labels=["event"],
        )
        for name, value in sorted(self.values.items()):
            family.add_metric([name], value)
        yield family


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


class ServerMetrics:
    def __init__(self) -> None:
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
        self.swap_seconds = Histogram("saoserve_policy_swap_seconds", "Hot-swap duration (s).", registry=r)
        self.policy_swapped_at = Gauge(
            "saoserve_policy_swapped_at_seconds",
            "Unix time at which the version being served started serving (swap done, or start).",
            registry=r,
        )
        self.in_flight = Gauge("saoserve_requests_in_flight", "Chat requests being served.", registry=r)
        self.learner = LearnerEvents()
        r.register(self.learner)
        self.feedback_to_served = Histogram(
            "saoserve_feedback_to_served_seconds",
            "From the join of the feedback that completed a learner batch to the first whole answer "
            "this replica logged whose first token came from the version trained on it, or a later one (s).",
            buckets=(1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600),
            registry=r,
        )
        # Published versions awaiting their first answer: version -> batch_completed_at (unix s).
        self._awaiting_answer: dict[int, float] = {}

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

    def swapped(self, res) -> None:
        """Record a successful swap (a ``server.engine.SwapResult``)."""
        self.swaps.labels("ok").inc()
        self.swap_seconds.observe(res.seconds)
        self.serving(res.version)
