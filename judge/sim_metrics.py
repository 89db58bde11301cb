"""The simulation's own Prometheus figures (issue 42): the target style's share and the judged
reward over the last answers, for the board's adaptation view (deploy/grafana/saoserve.json).

The server never learns an answer's style (the judge's verdict stays in the simulation), so the
simulation exports what it judged itself: ``saoserve simulate --metrics-port P`` serves
``/metrics`` on port P with ``saoserve_simulation_target_share``,
``saoserve_simulation_reward_mean`` (both over the last ``window`` judged answers),
``saoserve_simulation_answers_total`` and ``saoserve_simulation_step``. The figures are computed
from the run's records at each scrape (``SimulationCollector``), so the traffic drivers are not
touched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

DEFAULT_WINDOW = 48
"""Answers the share and the mean are taken over: 3 steps of the demo's batch of 16 (the report's
trailing window, ``saoserve.run_commands.REPORT_WINDOW``)."""


def window_figures(records: Sequence[dict], window: int) -> tuple[float, float] | None:
    """(target share, mean reward) of the last ``window`` judged answers of ``records`` (each a
    ``SimulationResult.records`` entry: ``target_style``, ``detected_style``, ``reward`` in
    [0, 1]); None before the first. Raises ValueError for a window below 1."""
    if window < 1:
        raise ValueError(f"the window must hold at least one answer, not {window}")
    last = list(records[-window:])
    if not last:
        return None
    share = sum(r["detected_style"] == r["target_style"] for r in last) / len(last)
    return share, sum(float(r["reward"]) for r in last) / len(last)


class SimulationCollector:
    """A prometheus collector of a running simulation's ``records()`` (read at each scrape)."""

    def __init__(self, records: Callable[[], Sequence[dict]], window: int = DEFAULT_WINDOW):
        self.records, self.window = records, window

    def collect(self):
        recs = list(self.records())
        answers = CounterMetricFamily(
            "saoserve_simulation_answers", "Answers the simulation judged and rated."
        )
        answers.add_metric([], len(recs))
        yield answers
        figures = window_figures(recs, self.window)
        if figures is None:
            return
        share, reward = figures
        yield GaugeMetricFamily(
            "saoserve_simulation_target_share",
            f"Share of the last {self.window} judged answers written in their step's target style.",
            value=share,
        )
        yield GaugeMetricFamily(
            "saoserve_simulation_reward_mean",
            f"Mean reward the simulation posted for its last {self.window} judged answers, in [0, 1].",
            value=reward,
        )
        yield GaugeMetricFamily(
            "saoserve_simulation_step",
            "The schedule step of the newest judged answer.",
            value=recs[-1]["step"],
        )


def serve_metrics(
    port: int, records: Callable[[], Sequence[dict]], addr: str = "0.0.0.0"
) -> CollectorRegistry:
    """Serve ``/metrics`` of ``SimulationCollector(records)`` on ``addr:port`` in a daemon
    thread (prometheus_client's server); the registry it serves. Raises OSError when the port
    cannot be bound."""
    registry = CollectorRegistry()
    registry.register(SimulationCollector(records))
    start_http_server(port, addr=addr, registry=registry)
    return registry
