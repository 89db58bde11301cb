"""saoserve_feedback_to_served_seconds: from the join of the feedback that completed a batch to
the first whole answer from the version trained on it (issue 10), and
saoserve_feedback_to_swap_seconds: to the replica serving that version (issue 21), on hand-made
times."""

from __future__ import annotations

import server.metrics as metrics_module
from server.metrics import ServerMetrics


def observed(m: ServerMetrics, name: str = "feedback_to_served") -> tuple[float, float]:
    """(count, sum) of the histogram ``name`` (``feedback_to_served`` or ``feedback_to_swap``)."""
    samples = {s.name: s.value for s in getattr(m, name).collect()[0].samples}
    return samples[f"saoserve_{name}_seconds_count"], samples[f"saoserve_{name}_seconds_sum"]


def test_each_version_is_measured_once_by_the_first_answer_from_it_or_later(monkeypatch):
    m = ServerMetrics()
    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "time", lambda: now[0])
    # Version 1's batch completed at t = 970, version 2's at t = 990.
    m.awaiting_answer(1, 970.0)
    m.awaiting_answer(2, 990.0)
    m.awaiting_answer(3, None)  # an event without the time (an older learner): not measured
    # feedback→swap ends at the swap, now: 1000 − 970 = 30 s and 1000 − 990 = 10 s, sum 40.
    assert observed(m, "feedback_to_swap") == (2.0, 40.0)
    now[0] = 1004.0
    m.answered(0)  # an answer begun under version 0 ends nothing
    assert observed(m) == (0.0, 0.0)
    now[0] = 1010.0
    m.answered(2)  # ends 1 (1010 − 970 = 40 s) and 2 (1010 − 990 = 20 s): 2 counts, sum 60
    assert observed(m) == (2.0, 60.0)
    now[0] = 1020.0
    m.answered(2)  # already counted
    m.answered(5)
    assert observed(m) == (2.0, 60.0)


def test_a_clock_behind_the_learner_counts_zero_not_a_negative_latency(monkeypatch):
    m = ServerMetrics()
    monkeypatch.setattr(metrics_module.time, "time", lambda: 100.0)
    m.awaiting_answer(4, 103.0)
    m.answered(4)
    assert observed(m) == (1.0, 0.0)
    assert observed(m, "feedback_to_swap") == (1.0, 0.0)


def test_a_tenant_policys_swap_is_counted_in_its_own_series(monkeypatch):
    from server.metrics import TenantPolicyMetrics

    m = ServerMetrics()
    monkeypatch.setattr(metrics_module.time, "time", lambda: 50.0)
    TenantPolicyMetrics(m, "acme").awaiting_answer(2, 42.5)  # 50 − 42.5 = 7.5 s
    samples = {
        (s.name, s.labels.get("tenant")): s.value for s in m.tenant_feedback_to_swap.collect()[0].samples
    }
    assert samples[("saoserve_tenant_feedback_to_swap_seconds_count", "acme")] == 1.0
    assert samples[("saoserve_tenant_feedback_to_swap_seconds_sum", "acme")] == 7.5
    assert observed(m, "feedback_to_swap") == (0.0, 0.0)  # the global policy's series is not moved
