"""The learner's committed state through failures and stops (issues 13 and 23; docs/design.md §8):
a failed commit drops the step applied in memory and the next load takes the committed state; a
checkpoint or a version folder ahead of the database is ignored; pause joins without training; a
clean stop (the stop event, Ctrl-C, SIGTERM) writes the checkpoint at the last committed version
and never past it; non-finite metrics are stored as null (``learner.publish.storable``; on
PostgreSQL in tests/integration/test_learner_restart.py).

In-process learners on a tiny random Llama and hand-fed records (``testing.learner``).
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections import Counter

import pytest
import torch
from sqlalchemy import select

from core.control import PAUSED, set_flag
from core.db import PolicyVersion, make_engine
from core.logbus import open_log
from core.policy_store import CHECKPOINT_FILE
from learner import publish
from learner.process import Learner
from learner.publish import latest_version, storable
from testing.learner import (
    assert_policy_is,
    committed_weights,
    feed,
    in_process,
    run_until,
    trained_ids,
    wait_for,
)


def test_storable_replaces_non_finite_numbers_with_null():
    metrics = {
        "a": math.nan,
        "b": math.inf,
        "c": -math.inf,
        "d": 1.5,
        "e": 3,
        "h": {"0": math.nan},
        "l": [1.0, math.inf],
    }
    assert storable(metrics) == {
        "a": None,
        "b": None,
        "c": None,
        "d": 1.5,
        "e": 3,
        "h": {"0": None},
        "l": [1.0, None],
    }


def test_failed_commit_reloads_the_committed_state(tmp_path, monkeypatch):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=1)
    log = open_log(learner.settings.resolved_database_url)
    fed = feed(log, 4, 0)
    learner.poll_once()
    assert learner.train_step() is not None and learner.version == 1
    real = publish.commit_version

    def refuse(*args, **kwargs):
        monkeypatch.setattr(publish, "commit_version", real)
        raise RuntimeError("the database refused the commit")

    monkeypatch.setattr(publish, "commit_version", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        learner.train_step()
    # The step was applied in memory and v000002 written, but nothing committed: the models are
    # dropped, the samples still wait.
    assert learner.algorithm is None and learner.waiting_samples() == 2
    assert (tmp_path / "policies" / "v000002").is_dir()
    learner.load()
    assert learner.version == 1 and not (tmp_path / "policies" / "v000002").exists()
    assert_policy_is(learner, committed_weights(learner, 1))
    assert learner.train_step() is not None and learner.version == 2
    assert trained_ids(learner) == Counter(fed)


def test_checkpoint_and_directory_ahead_of_the_database_are_ignored(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=1)
    feed(open_log(learner.settings.resolved_database_url), 2, 0)
    learner.poll_once()
    learner.train_step()
    # What the old order left after a kill before the commit: checkpoint and directory of v2.
    ahead = {"version": 2, "learner": learner.algorithm.state_dict() | {"step": 99}, "config": {}}
    torch.save(ahead, tmp_path / "policies" / CHECKPOINT_FILE)
    (tmp_path / "policies" / "v000002").mkdir()
    restarted = Learner(learner.settings, learner.config)
    restarted.load()
    assert restarted.version == 1 and restarted.algorithm.steps == 0
    assert not (tmp_path / "policies" / "v000002").exists()
    assert_policy_is(restarted, committed_weights(restarted, 1))


def test_pause_joins_without_training_and_resume_trains(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    set_flag(learner.db, PAUSED, "1")
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    stop = threading.Event()
    thread = threading.Thread(target=learner.run, args=(stop,))
    thread.start()
    try:
        assert wait_for(lambda: learner.waiting_samples() == 4)
        assert latest_version(learner.db).version == 0
        set_flag(learner.db, PAUSED, None)
        assert wait_for(lambda: latest_version(learner.db).version == 2)
    finally:
        stop.set()
        thread.join(60)
    assert learner.waiting_samples() == 0


def restarted(learner: Learner) -> Learner:
    again = Learner(learner.settings, learner.config)
    again.load()
    return again


def test_a_clean_stop_writes_the_checkpoint_at_the_last_committed_version(tmp_path):
    """Finding 11: a restarted learner lost its critic, optimizer state and step count (the
    checkpoint was written every checkpoint_every steps only)."""
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=10)
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    assert run_until(learner, lambda: latest_version(learner.db).version == 2)
    state = torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)
    assert state["version"] == 2
    again = restarted(learner)
    assert again.version == 2 and again.algorithm.steps == 2
    # The optimizer moments came back: 2 AdamW steps recorded for every parameter.
    moments = again.algorithm.policy_opt.state
    assert moments and all(int(s["step"]) == 2 for s in moments.values())


def test_ctrl_c_writes_the_checkpoint_and_a_step_cut_short_does_not(tmp_path, monkeypatch):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=10)
    feed(open_log(learner.settings.resolved_database_url), 6, 0)
    train = learner.train_step

    def ctrl_c_at_version_2():
        if learner.version == 2:
            raise KeyboardInterrupt
        return train()

    monkeypatch.setattr(learner, "train_step", ctrl_c_at_version_2)
    with pytest.raises(KeyboardInterrupt):
        learner.run()
    assert torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)["version"] == 2
    # Ctrl-C in the middle of the third step: the update is in memory only, so nothing is
    # written (the checkpoint stays at 2, never claiming the uncommitted step).
    monkeypatch.setattr(learner, "train_step", train)
    step = learner._step

    def ctrl_c_in_the_step(batch):
        step(batch)
        raise KeyboardInterrupt

    monkeypatch.setattr(learner, "_step", ctrl_c_in_the_step)
    with pytest.raises(KeyboardInterrupt):
        learner.run()
    assert learner.algorithm is None and latest_version(learner.db).version == 2
    assert torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)["version"] == 2
    assert restarted(learner).algorithm.steps == 2


def test_sigterm_stops_saoserve_learn_cleanly_with_a_checkpoint(tmp_path):
    from learner.process import run_learner

    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=10)
    feed(open_log(learner.settings.resolved_database_url), 2, 0)
    engine = make_engine(learner.settings.resolved_database_url)

    def term_at_version_1() -> None:
        wait_for(lambda: versions_of(engine) == [0, 1], 60)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_at_version_1, daemon=True).start()
    before = signal.getsignal(signal.SIGTERM)
    run_learner(learner.settings, learner.config)
    assert signal.getsignal(signal.SIGTERM) is before
    assert torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)["version"] == 1
    engine.dispose()


def versions_of(engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(select(PolicyVersion.version).order_by(PolicyVersion.version)).scalars())


def test_a_version_is_announced_before_its_checkpoint_is_written(tmp_path, monkeypatch):
    # The checkpoint (critic, optimizer moments: seconds at the demo's size) is written every
    # checkpoint_every-th step; servers need only the committed version, so its policy event is
    # on the topic before the checkpoint starts, and a checkpoint that fails leaves it announced.
    from core.records import TOPIC_POLICY, PolicyEvent

    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=1)
    log = open_log(learner.settings.resolved_database_url)
    feed(log, 2, 0)
    learner.poll_once()
    announced_at_checkpoint: list[list[int]] = []

    def checkpoint(version: int) -> None:
        events = [PolicyEvent.model_validate_json(e.value) for e in log.read(TOPIC_POLICY, 0, 0, 500, 0.0)]
        announced_at_checkpoint.append([e.version for e in events])
        raise OSError("disk full")

    monkeypatch.setattr(learner, "_checkpoint", checkpoint)
    with pytest.raises(OSError, match="disk full"):
        learner.train_step()
    assert announced_at_checkpoint == [[1]]
    # Committed and announced: a restart serves on from the database's version 1.
    learner.load()
    assert learner.version == 1 and not learner._unannounced
