"""judge.runstats on hand-made records: quantiles, the staleness distribution, feedback→served
and feedback→swap per version, request rates and step series (issue 10)."""

from __future__ import annotations

import pytest

from judge.runstats import (
    feedback_to_served,
    feedback_to_swap,
    latency_summary,
    quantile,
    requests_per_second,
    staleness_distribution,
    step_series,
)


def test_quantile_by_hand() -> None:
    # Sorted 1, 2, 3, 4: p50 at position 0.5·3 = 1.5 -> 2 + 0.5·(3 − 2) = 2.5;
    # p95 at 0.95·3 = 2.85 -> 3 + 0.85·(4 − 3) = 3.85.
    assert quantile([4, 1, 3, 2], 0.5) == pytest.approx(2.5)
    assert quantile([4, 1, 3, 2], 0.95) == pytest.approx(3.85)
    assert quantile([7.0], 0.95) == 7.0
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        quantile([1.0], 1.5)


def test_staleness_distribution_by_hand() -> None:
    steps = [
        {"version": 1, "staleness_hist": {"0": 30}},
        {"version": 2, "staleness_hist": {"0": 10, "1": 50}},
        {"version": 3, "staleness_hist": {"1": 6, "2": 4}},
        {"version": 4},  # a step without the histogram (an older learner) adds nothing
    ]
    got = staleness_distribution(steps)
    # Tokens: staleness 0: 30 + 10 = 40, 1: 50 + 6 = 56, 2: 4; total 100.
    assert got["histogram"] == {"0": 40, "1": 56, "2": 4} and got["tokens"] == 100
    # Mean (0·40 + 1·56 + 2·4) / 100 = 0.64.
    assert got["mean"] == pytest.approx(0.64)
    # Cumulative 40, 96, 100: 96 >= 95 first at staleness 1.
    assert got["p95"] == 1
    assert staleness_distribution([{"staleness_hist": {"0": 95, "3": 5}}])["p95"] == 0
    assert staleness_distribution([]) == {"mean": None, "p95": None, "histogram": {}, "tokens": 0}
    with pytest.raises(ValueError):
        staleness_distribution([{"staleness_hist": {"-1": 3}}])


def test_feedback_to_served_by_hand() -> None:
    records = [
        {"id": "a", "first_version": 0, "t_first_token": 0.5, "t_answer": 1.0, "t_feedback": 2.0},
        {"id": "b", "first_version": 0, "t_first_token": 2.5, "t_answer": 3.0, "t_feedback": 4.5},
        {"id": "c", "first_version": 0, "t_first_token": 4.0, "t_answer": 5.0, "t_feedback": 6.0},
        {"id": "d", "first_version": 1, "t_first_token": 9.5, "t_answer": 13.0, "t_feedback": 14.0},
        # began before the swap
        {"id": "e", "first_version": 0, "t_first_token": 8.0, "t_answer": 13.5, "t_feedback": None},
        {"id": "f", "first_version": 2, "t_first_token": 19.5, "t_answer": 21.0, "t_feedback": 21.5},
        {"id": "g", "first_version": 1, "t_first_token": 10.0, "t_answer": 12.0, "t_feedback": 12.5},
        {
            "id": "h",
            "first_version": 1,
            "t_first_token": None,
            "t_answer": 11.0,
            "t_feedback": None,
        },  # no text
    ]
    steps = [
        {"version": 1, "completing_sample": "b"},
        {"version": 2, "completing_sample": "d"},
        {"version": 3, "completing_sample": "f"},  # version 3 served nothing in the run
        {"version": 4, "completing_sample": "x"},  # another client's sample
        {"version": 5},
    ]
    got = feedback_to_served(steps, records, at="t_answer")
    # v1: batch completed by b's feedback at 4.5; the first answer begun by v1 or later came
    # back at 11.0 (h) -> 6.5 s. v2: completed at 14.0 (d); first answer of v2+ at 21.0 (f) -> 7.0 s.
    assert got == [
        {"version": 1, "completed": 4.5, "served": 11.0, "latency_s": 6.5},
        {"version": 2, "completed": 14.0, "served": 21.0, "latency_s": 7.0},
    ]
    assert feedback_to_served(steps, records) == got  # at the whole answer by default
    # To the first token: v1's first text at 9.5 (d; h had none) -> 5.0 s; v2's at 19.5 (f) -> 5.5 s.
    at_first = feedback_to_served(steps, records, at="t_first_token")
    assert [(x["version"], x["served"], x["latency_s"]) for x in at_first] == [
        (1, 9.5, 5.0),
        (2, 19.5, 5.5),
    ]
    with pytest.raises(ValueError, match="at must be one of"):
        feedback_to_served(steps, records, at="t_sent")
    # The server was first seen serving v1 at 9.0 (9.0 − 4.5 = 4.5 s) and v2 at 19.0 (19.0 − 14.0 = 5.0 s).
    timeline = [{"t": 8.0, "version": 0}, {"t": 9.0, "version": 1}, {"t": 19.0, "version": 2}]
    assert [(x["version"], x["latency_s"]) for x in feedback_to_swap(steps, records, timeline)] == [
        (1, 4.5),
        (2, 5.0),
    ]
    # p50 of [6.5, 7.0] = 6.75; p95 = 6.5 + 0.95·0.5 = 6.975.
    summary = latency_summary([x["latency_s"] for x in got])
    assert summary == {"p50": pytest.approx(6.75), "p95": pytest.approx(6.975), "n": 2}
    assert latency_summary([]) == {"p50": None, "p95": None, "n": 0}


def test_requests_per_second_and_step_series() -> None:
    # Bins of 10 s: [0, 10) holds 0.5, 9.9 -> 0.2/s; [10, 20) none; [20, 30) holds 25 -> 0.1/s.
    assert requests_per_second([0.5, 9.9, 25.0], 10) == pytest.approx([0.2, 0.0, 0.1])
    assert requests_per_second([], 10) == []
    with pytest.raises(ValueError):
        requests_per_second([1.0], 0)
    with pytest.raises(ValueError):
        requests_per_second([-1.0], 5)
    steps = [{"kept_fraction": 1.0}, {"kept_fraction": float("nan")}, {}, {"kept_fraction": 0.75}]
    assert step_series(steps, "kept_fraction") == [1.0, None, None, 0.75]
