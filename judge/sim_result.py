"""What a simulation run returns (``judge.simulate``): one record per judged answer, the learner's
step metrics, the open loop's timeline, the lifecycle's and the adversary's figures; and the
records saved as JSON lines, the report's input (``judge.report``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SimulationResult:
    """Records (one per judged answer), the learner's step metrics of the run (``GET
    /admin/learner``, versions after ``start_version``; empty without an admin key), and in
    async mode a timeline sampled about once a second: ``{"t": s since start, "version",
    "backlog": samples waiting (estimate), "in_flight": requests}``. ``traffic``: the config's
    ``TRAFFIC_FIELDS``, the settings to state with the run's numbers. ``attack``: the adversary's
    figures (``attack_summary``; None without one); ``lifecycle``: what the lifecycle did with
    the run's versions (``lifecycle_summary``, plus ``last_verdict``: the learner's last verdict
    on the lineage still under watch at the end, or None; None without an admin key or when it
    could not be read). ``t0_wall``: the Unix time (s) of the run's ``t`` = 0, which puts the
    records' times beside the learner's and servers' clocks."""

    records: list[dict] = field(default_factory=list)
    judge_failures: int = 0
    request_failures: int = 0
    interrupted: bool = False
    stopped_by: str | None = None
    mode: str = "sync"
    start_version: int = 0
    wall_s: float = 0.0
    held_s: float = 0.0
    learner_steps: list[dict] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    traffic: dict = field(default_factory=dict)
    attack: dict | None = None
    lifecycle: dict | None = None
    t0_wall: float | None = None

    def details(self) -> dict:
        """What ``judge.report.write_report`` reads besides the records."""
        return {
            "mode": self.mode,
            "traffic": self.traffic,
            "start_version": self.start_version,
            "wall_s": self.wall_s,
            "held_s": self.held_s,
            "learner_steps": self.learner_steps,
            "timeline": self.timeline,
            "request_failures": self.request_failures,
            "judge_failures": self.judge_failures,
            "stopped_by": self.stopped_by,
            "attack": self.attack,
            "lifecycle": self.lifecycle,
            "t0_wall": self.t0_wall,
        }


def save_records(path: Path, records: list[dict]) -> None:
    """One JSON record per line (the report's input), UTF-8 whatever the locale: answers keep
    their characters raw (``ensure_ascii=False``), U+2028 and the like included, which
    ``judge.report.load_records`` reads back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
