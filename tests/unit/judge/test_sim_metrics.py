"""judge.sim_metrics: the simulation's target share and judged reward over its last answers,
hand-worked, and served on a port for Prometheus."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from judge.sim_metrics import SimulationCollector, serve_metrics, window_figures


def rec(step: int, target: str, detected: str, reward: float) -> dict:
    return {"step": step, "target_style": target, "detected_style": detected, "reward": reward}


RECORDS = [
    rec(0, "pirate", "formal", 0.0),
    rec(0, "pirate", "pirate", 0.75),
    rec(1, "pirate", "pirate", 0.5),
    rec(1, "poetic", "pirate", 0.0),
    rec(2, "poetic", "poetic", 1.0),
]


def test_window_figures():
    # The last 3: pirate/pirate (hit, 0.5), poetic/pirate (miss, 0), poetic/poetic (hit, 1.0):
    # share 2/3, mean (0.5 + 0 + 1.0) / 3 = 0.5.
    assert window_figures(RECORDS, 3) == (pytest.approx(2 / 3), 0.5)
    # All 5: hits 3 of 5; rewards 0 + 0.75 + 0.5 + 0 + 1.0 = 2.25 → 0.45.
    assert window_figures(RECORDS, 48) == (0.6, 0.45)
    assert window_figures([], 3) is None
    with pytest.raises(ValueError, match="at least one answer"):
        window_figures(RECORDS, 0)


def samples(collector) -> dict[str, float]:
    return {s.name: s.value for f in collector.collect() for s in f.samples}


def test_the_collector_reads_the_records_at_each_scrape():
    recs: list[dict] = []
    c = SimulationCollector(lambda: recs, window=2)
    assert samples(c) == {"saoserve_simulation_answers_total": 0}  # no share before an answer
    recs.extend(RECORDS)
    # The last 2: (miss, 0), (hit, 1.0): share 0.5, mean 0.5; the newest answer's step is 2.
    assert samples(c) == {
        "saoserve_simulation_answers_total": 5,
        "saoserve_simulation_target_share": 0.5,
        "saoserve_simulation_reward_mean": 0.5,
        "saoserve_simulation_step": 2,
    }


def test_served_on_a_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve_metrics(port, lambda: RECORDS[:2], addr="127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["saoserve_simulation_target_share"] == 0.5  # 1 hit of 2
    assert got["saoserve_simulation_reward_mean"] == 0.375  # (0 + 0.75) / 2
    with pytest.raises(OSError):
        serve_metrics(port, lambda: RECORDS, addr="127.0.0.1")  # the port is taken
