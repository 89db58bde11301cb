"""Rollbacks in the learner (issues 13 and 23; docs/design.md §8, ``learner.guard.rollback``): an earlier
version's weights published as a new version; a request for an unknown version, or one that is no
version number, refused and cleared; a rollback requested while another runs carried out next;
each one logged and followed by pruning.

In-process learners on a tiny random Llama and hand-fed records (``testing.learner``).
"""

from __future__ import annotations

import torch
from sqlalchemy import select

from core.control import ROLLBACK_TO, get_flag, set_flag
from core.db import LearnerCounter, PolicyVersion
from core.logbus import open_log
from learner import publish
from learner.process import Learner
from learner.publish import latest_version
from testing.learner import assert_policy_is, committed_weights, feed, in_process, run_until


def test_rollback_publishes_the_old_weights_as_a_new_version(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    learner.poll_once()
    learner.train_step()
    learner.train_step()
    set_flag(learner.db, ROLLBACK_TO, "1")
    assert learner.rollback(1) == 3
    with learner.db.connect() as conn:
        row = conn.execute(select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == 3)).one()
    assert row.parent_version == 1 and row.metrics == {"rollback_to": 1} and row.status == "published"
    assert get_flag(learner.db, ROLLBACK_TO) is None and learner.algorithm.policy_opt.state == {}
    v1 = committed_weights(learner, 1)
    assert all(torch.equal(committed_weights(learner, 3)[k], v) for k, v in v1.items())
    assert_policy_is(learner, v1)


def test_rollback_to_an_unknown_version_is_refused_and_cleared(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    set_flag(learner.db, ROLLBACK_TO, "7")
    assert learner.rollback(7) is None
    assert get_flag(learner.db, ROLLBACK_TO) is None and learner.version == 0
    with learner.db.connect() as conn:
        refused = conn.execute(
            select(LearnerCounter.value).where(LearnerCounter.name == "rollback_refused")
        ).scalar()
    assert refused == 1


def test_a_rollback_request_that_is_no_version_number_is_refused_and_cleared(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    set_flag(learner.db, ROLLBACK_TO, "v1")
    assert learner._requested_rollback() is True
    assert get_flag(learner.db, ROLLBACK_TO) is None and learner.version == 0
    with learner.db.connect() as conn:
        refused = conn.execute(
            select(LearnerCounter.value).where(LearnerCounter.name == "rollback_refused")
        ).scalar()
    assert refused == 1 and learner._requested_rollback() is False


def versions(learner: Learner) -> list[tuple]:
    with learner.db.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                select(PolicyVersion.version, PolicyVersion.parent_version, PolicyVersion.metrics).order_by(
                    PolicyVersion.version
                )
            )
        ]


def test_a_rollback_requested_while_another_runs_is_carried_out(tmp_path, monkeypatch):
    """Finding 2: rollback to 1, then to 0 while the first is being carried out; the first's
    commit cleared the flag, so the second never happened."""
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    learner.poll_once()
    learner.train_step()
    learner.train_step()
    set_flag(learner.db, ROLLBACK_TO, "1")
    real = publish.write_version
    written = []

    def second_request_meanwhile(algorithm, policy_dir, base_dir, version: int, dtype):
        if not written:  # POST /admin/rollback {"version": 0} while version 3 is being written
            set_flag(learner.db, ROLLBACK_TO, "0")
        written.append(version)
        return real(algorithm, policy_dir, base_dir, version, dtype)

    monkeypatch.setattr(publish, "write_version", second_request_meanwhile)
    assert run_until(learner, lambda: latest_version(learner.db).version == 4, 30)
    assert written == [3, 4]
    assert versions(learner)[3:] == [(3, 1, {"rollback_to": 1}), (4, 0, {"rollback_to": 0})]
    assert get_flag(learner.db, ROLLBACK_TO) is None


def test_a_rollback_is_logged_and_prunes_the_version_folders(tmp_path, caplog):
    """Finding 11: rollbacks were not logged and did not prune (more folders than keep_versions)."""
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", keep_versions=4)
    feed(open_log(learner.settings.resolved_database_url), 8, 0)
    learner.poll_once()
    for _ in range(4):
        learner.train_step()
    caplog.set_level("INFO", logger="learner.process")
    # Versions 5, 6, 7 republish 3, 4, 3; after each, only the newest 4 folders stay.
    assert [learner.rollback(v) for v in (3, 4, 3)] == [5, 6, 7]
    assert sorted(d.name for d in (tmp_path / "policies").glob("v[0-9]*")) == [
        "v000004",
        "v000005",
        "v000006",
        "v000007",
    ]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("rolled back")] == [
        "rolled back to version 3: its weights are published as version 5",
        "rolled back to version 4: its weights are published as version 6",
        "rolled back to version 3: its weights are published as version 7",
    ]
