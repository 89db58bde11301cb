"""Prometheus metrics of one server (a registry per app, so tests can run several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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
        self.in_flight = Gauge("saoserve_requests_in_flight", "Chat requests being served.", registry=r)
