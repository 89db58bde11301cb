"""The chaos soak, short (issue 23, docs/reliability.md "The chaos soak"): ``bench/chaos_soak.py``
run as an operator runs it, 75 s of traffic with one database outage, one broker pause, one
replica restart, two learner lives killed at their kill points and one SIGKILL, then its audit.

The script exits 1 when any audit check fails; the test also reads its report to see that every
fault it was meant to inject happened, so a soak that injected nothing cannot pass.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.kafka]

DURATION_S = 75


def test_a_short_chaos_soak_passes_its_audit(tmp_path):
    out = tmp_path / "soak.json"
    res = subprocess.run(
        [
            sys.executable,
            "bench/chaos_soak.py",
            "--duration",
            str(DURATION_S),
            "--seeds",
            "0",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    print(res.stdout[-6000:])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    (report,) = json.loads(out.read_text())
    assert report["problems"] == [] and report["drained"]
    # Every fault of the schedule happened: one outage of each kind, one restart, the kills.
    assert sorted(w["what"].split(" ")[0] for w in report["windows"]) == ["broker", "database", "replica"]
    assert all(w["recovered_s"] is not None for w in report["windows"])
    assert report["learner"]["point_kills"] == 2 and report["learner"]["sigkills"] == 1
    (restart,) = report["restarts"]
    assert restart["ready_version"] >= restart["newest_at_spawn"]
    # Traffic went on through it: answers, trained feedback, versions served by the replicas.
    q = report["requests"]
    assert q["chats_2xx"] > 0 and q["failures_outside_windows"] == 0 and q["4xx"] == 0
    assert (
        report["feedback_fate"].get("trained", 0) > 0 and report["feedback_fate"].get("unaccounted", 0) == 0
    )
    assert report["versions"] >= 2 and report["swaps"] >= 2
