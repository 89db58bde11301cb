"""The operators' dashboard (issue 23) without a server: ``GET /dashboard/state`` and ``/metrics``
on SQLite (the test of ``testing.backends.dashboard``), and the counts over a label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from server.metrics import label_counts
from testing.backends.dashboard import *  # noqa: F403 (its test runs here on SQLite)


def test_label_counts_sums_over_the_other_labels():
    c = Counter("x_total", "x", ["stream", "outcome"], registry=CollectorRegistry())
    c.labels("true", "ok").inc(2)
    c.labels("false", "ok").inc()
    c.labels("false", "aborted").inc()
    c.labels("true", "engine_error")  # made, never counted: 0
    assert label_counts(c, "outcome") == {"ok": 3, "aborted": 1, "engine_error": 0}
    assert label_counts(c, "stream") == {"true": 2, "false": 2}
