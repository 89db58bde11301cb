"""The learner's fault points (``learner.faults``): a point spec names a known point. The kill -9
harness that kills the learner at each of them: tests/system/test_learner_faults.py."""

from __future__ import annotations

import pytest

from learner.faults import POINTS, parse


def test_fault_point_spec_is_checked():
    assert parse("after_commit:3") == ("after_commit", 3) and parse("during_step") == ("during_step", 1)
    assert parse("") is None and parse(None) is None
    assert [parse(p) for p in POINTS] == [(p, 1) for p in POINTS] and len(set(POINTS)) == 12
    for bad in ("after_lunch:1", "after_commit:0", "after_commit:x"):
        with pytest.raises(ValueError):
            parse(bad)
