"""The chaos soak, short (issue 23, docs/reliability.md "The chaos soak"): ``bench/chaos_soak.py``
run as an operator runs it, 60 s of traffic (two clients) with one database outage, one broker
pause, one replica crash (SIGKILL) and restart, two learner lives killed at their kill points and
one SIGKILL, then its audit.

The script exits 1 when any audit check fails; the test also reads its report to see that every
fault it was meant to inject happened, so a soak that injected nothing cannot pass.

Opt-in (``SAOSERVE_SOAK=1``): two vLLM replicas, PostgreSQL, tansu and a learner for several
minutes are more than CI's two shared cores hold in a test's time (it ran past 420 s there).
The command is in docs/reliability.md, the measured runs in docs/log/2026-12-06-reliability-runs.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testing import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.kafka,
    pytest.mark.skipif(
        os.environ.get("SAOSERVE_SOAK") != "1",
        reason="the chaos soak is opt-in (SAOSERVE_SOAK=1): two engines, PostgreSQL, tansu and a "
        "learner for minutes, past CI's time on two shared cores (docs/reliability.md)",
    ),
]

DURATION_S = 60
# The two points at the start of the learner's cycle: a life dies there within seconds of its
# load, so both fit in the short run (the bench's default arms all seven).
POINTS = "after_read:1,after_join_commit:1"


def test_a_short_chaos_soak_passes_its_audit(tmp_path):
    out = tmp_path / "soak.json"
    args = ["--duration", str(DURATION_S), "--seeds", "0", "--clients", "2", "--think-s", "0.5"]
    args += ["--replica-stop", "kill"]  # a crash: the restart's 10 s of graceful stop saved
    res = subprocess.run(
        [sys.executable, "bench/chaos_soak.py", *args, "--points", POINTS, "--json", str(out)],
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
    fate = report["feedback_fate"]
    assert fate.get("trained", 0) > 0 and fate.get("unaccounted", 0) == 0
    assert report["versions"] >= 2 and report["swaps"] >= 2
