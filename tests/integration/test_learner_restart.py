"""The learner's committed state on PostgreSQL (issues 13 and 23; docs/design.md §8): non-finite
metrics are stored as null (``learner.publish.storable``). The rest on SQLite:
tests/unit/learner/test_learner_restart.py."""

from __future__ import annotations

import math

from sqlalchemy import select

from core.db import LearnerStep, PolicyVersion
from core.logbus import open_log
from testing.learner import (
    feed,
    in_process,
)


def test_non_finite_metrics_are_stored_as_null_on_postgres(tmp_path, pg_url, monkeypatch):
    learner = in_process(tmp_path, pg_url)
    feed(open_log(pg_url), 2, 0)
    learner.poll_once()
    step = learner.algorithm.step

    def poisoned(*args):
        return step(*args) | {"approx_kl": math.nan, "tokens_per_s": math.inf, "by": {"1": -math.inf}}

    monkeypatch.setattr(learner.algorithm, "step", poisoned)
    assert learner.train_step() is not None
    with learner.db.connect() as conn:
        version = conn.execute(select(PolicyVersion.metrics).where(PolicyVersion.version == 1)).scalar_one()
        metrics = conn.execute(select(LearnerStep.metrics)).scalar_one()
    assert version["approx_kl"] is None and version["tokens_per_s"] is None
    assert metrics["approx_kl"] is None and metrics["by"] == {"1": None}
    assert metrics["sample_ids"] == ["t00000", "t00001"]
