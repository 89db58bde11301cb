"""The learner tier's shared fixture: ``learner``, the tiny in-process learner of
testing/learner.py on its own SQLite database (the guard's tests on a learner: lifecycle, drift
veto, who votes)."""

from __future__ import annotations

import pytest

from testing.learner import in_process


@pytest.fixture
def learner(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=100)
    yield learner
    learner.db.dispose()
