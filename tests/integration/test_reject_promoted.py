"""Rejecting a promoted version with a learner (issue 40 item 3): the rejection reaches its
descendants, the prune kept the folder of the promoted version before it, and the learner's next
guard check restores that version's weights as a new promoted version.

Before the fix, with ``keep_versions`` small: rejecting promoted v2 left v3, v4 on canary against
a control (v1) whose folder was pruned, and rejecting the newest then made the learner refuse its
rollback at every check ("version None restores version 1").

A learner on a tiny random Llama in this process (``tests.learner_harness``), PostgreSQL, the real
app for the operator's move.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from sqlalchemy import select

from core.control import GUARD_OFF, set_flag
from core.db import LearnerCounter, PolicyVersion
from core.lifecycle import Stage
from core.logbus import open_log
from core.policy_store import version_dirs
from learner.process import Learner
from testing.fakes import FakeEngine
from testing.learner import committed_weights, feed, in_process
from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.integration


def stages(learner: Learner) -> dict[int, tuple[str, int | None]]:
    with learner.db.connect() as conn:
        rows = conn.execute(
            select(PolicyVersion.version, PolicyVersion.lifecycle, PolicyVersion.parent_version)
        )
        return {r.version: (r.lifecycle, r.parent_version) for r in rows}


async def test_rejecting_a_promoted_version_restores_the_one_before_it(tmp_path, pg_url):
    """Steps 1, 2 with the guard off (promoted), 3, 4 with it on (canary); ``keep_versions`` 1.
    Folders kept: v1, v2 (promoted), v4 (the newest); v3 pruned. The operator rejects v2:
    versions [2, 3, 4] rejected. The guard check then publishes v5 = v1's weights (parent 1,
    promoted) and refuses nothing."""
    learner = in_process(tmp_path / "learner", pg_url, keep_versions=1)
    feed(open_log(pg_url), 8, 0)
    learner.poll_once()
    set_flag(learner.db, GUARD_OFF, "1")
    learner.train_step()
    learner.train_step()
    set_flag(learner.db, GUARD_OFF, None)
    learner.train_step()
    learner.train_step()
    assert stages(learner) == {
        0: ("promoted", None),
        1: ("promoted", 0),
        2: ("promoted", 1),
        3: ("canary", 2),
        4: ("canary", 3),
    }
    assert [v for v, _ in version_dirs(learner.policy_dir)] == [1, 2, 4]

    settings = make_settings(tmp_path / "server", database_url=pg_url)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/admin/lifecycle/reject", json={"version": 2}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["versions"] == [2, 3, 4]

    learner.guard_check()
    after = stages(learner)
    assert after[5] == (str(Stage.PROMOTED), 1)
    assert [after[v][0] for v in (2, 3, 4)] == ["rejected"] * 3
    v1 = committed_weights(learner, 1)
    assert all(torch.equal(committed_weights(learner, 5)[k], w) for k, w in v1.items())
    with learner.db.connect() as conn:
        refused = conn.execute(
            select(LearnerCounter.value).where(LearnerCounter.name == "rollback_refused")
        ).scalar_one_or_none()
    assert refused is None
