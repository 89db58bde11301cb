"""The learner's busy fraction and the waits of full batches (``judge.runstats.learner_utilisation``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from judge.runstats import learner_utilisation

T0 = datetime(2026, 12, 2, tzinfo=UTC)


def _at(s: float, naive: bool = False) -> str:
    when = T0 + timedelta(seconds=s)
    return (when.replace(tzinfo=None) if naive else when).isoformat()


def test_busy_fraction_and_full_batch_waits_by_hand() -> None:
    # Steps (start = commit − step time): v1 10–20 s, v2 25–40 s, v3 58–70 s.
    steps = [
        {"version": 1, "created_at": _at(20), "step_time_s": 10.0, "batch_completed_at": T0.timestamp() + 5},
        # Its batch was full at 12 s, before v1's commit at 20 s: waited 25 − 20 = 5 s.
        {"version": 2, "created_at": _at(40), "step_time_s": 15.0, "batch_completed_at": T0.timestamp() + 12},
        # Full at 50 s, after v2's commit at 40 s; a naive time is UTC: waited 58 − 50 = 8 s.
        {
            "version": 3,
            "created_at": _at(70, naive=True),
            "step_time_s": 12.0,
            "batch_completed_at": T0.timestamp() + 50,
        },
    ]
    u = learner_utilisation(steps)
    # Busy 10 + 15 + 12 = 37 s over 70 − 10 = 60 s.
    assert u["busy_s"] == pytest.approx(37.0) and u["span_s"] == pytest.approx(60.0)
    assert u["busy_fraction"] == pytest.approx(37 / 60) and u["steps"] == 3
    # Waits 5 and 8: median 6.5, max 8, total 13.
    assert u["full_wait_s"] == {
        "p50": pytest.approx(6.5),
        "max": pytest.approx(8.0),
        "total": pytest.approx(13.0),
        "n": 2,
    }


def test_order_is_by_commit_and_steps_without_times_are_skipped() -> None:
    # Given out of order and with an untimed row: the same as v1 10–20 s, v2 25–40 s alone.
    steps = [
        {"version": 2, "created_at": _at(40), "step_time_s": 15.0},
        {"version": 9, "created_at": _at(99)},
        {"version": 1, "created_at": _at(20), "step_time_s": 10.0},
    ]
    u = learner_utilisation(steps)
    # Busy 25 s over 40 − 10 = 30 s; no batch_completed_at, so no waits.
    assert u["busy_fraction"] == pytest.approx(25 / 30)
    assert u["full_wait_s"] == {"p50": None, "max": None, "total": None, "n": 0}


def test_no_steps_and_a_negative_step_time() -> None:
    empty = learner_utilisation([])
    assert empty["busy_fraction"] is None and empty["steps"] == 0 and empty["full_wait_s"]["n"] == 0
    with pytest.raises(ValueError, match="negative step_time_s"):
        learner_utilisation([{"created_at": _at(5), "step_time_s": -1.0}])
