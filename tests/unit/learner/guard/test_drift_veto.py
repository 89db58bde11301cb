"""The drift veto's figure per lineage version (learner.guard.guard.drift_from_promoted; issue 40,
item 2): measured beyond the promoted version's KL to the base, each version by the step trained
from it, and the newest by the guard before it promotes the lineage (``kl_ref_after``)."""

from __future__ import annotations

import pytest

from core.lifecycle import drifted
from learner.guard.guard import drift_from_promoted


def test_each_version_s_drift_beyond_the_promoted_version_s():
    # Lineage [5, 6, 7]. Step 5 started from the promoted version: its kl_ref 0.55 is the
    # promoted version's drift from the base (near the bound 0.6). Each version is measured by
    # the step trained from it, on the batch it drew: version 5 by step 6 (0.58), version 6 by
    # step 7 (1.20); the newest (7) not yet.
    before = {5: 0.55, 6: 0.58, 7: 1.20}
    # 0.58 − 0.55 = 0.03, 1.20 − 0.55 = 0.65, None.
    assert drift_from_promoted([5, 6, 7], before) == pytest.approx([0.03, 0.65, None])
    assert drifted(drift_from_promoted([5, 6, 7], before), 0.6) == pytest.approx(0.65)
    # Measured from the base, version 5 (0.58) would already be within 0.02 of the bound and
    # version 6 (1.20) over it: every lineage after a promoted version near the bound rejected.
    assert drifted([before[6], before[7]], 0.6) == pytest.approx(1.20)
    assert drifted(drift_from_promoted([5, 6], before), 0.6) is None


def test_a_version_no_step_measured_has_no_figure():
    # No figure for the promoted version: the base's, 0. Step 6 wrote none (the anchor off).
    before = {5: None, 6: None, 7: 0.45}
    assert drift_from_promoted([5, 6, 7], before) == pytest.approx([None, 0.45, None])
    assert drift_from_promoted([5], {}) == [None]
    assert drift_from_promoted([], {}) == []


def test_the_newest_version_is_measured_before_its_lineage_is_promoted():
    # Lineage [5, 6, 7], the promoted version's drift 0.55 (step 5's kl_ref); version 5 measured
    # by step 6 (0.58), version 6 by step 7 (0.90). Version 7, the newest, no step has measured:
    # the guard measured it before promoting, on a batch no version had trained on (its step's
    # kl_ref_after): 1.20.
    before = {5: 0.55, 6: 0.58, 7: 0.90}
    # 0.58 − 0.55 = 0.03, 0.90 − 0.55 = 0.35, 1.20 − 0.55 = 0.65 > 0.6: the newest drifted.
    assert drift_from_promoted([5, 6, 7], before, {7: 1.20}) == pytest.approx([0.03, 0.35, 0.65])
    assert drifted(drift_from_promoted([5, 6, 7], before, {7: 1.20}), 0.6) == pytest.approx(0.65)
    # A clean newest, 1.00: 1.00 − 0.55 = 0.45 <= 0.6.
    assert drifted(drift_from_promoted([5, 6, 7], before, {7: 1.00}), 0.6) is None
    # A lineage of one version, measured only so: 1.20 − 0.55 = 0.65.
    assert drift_from_promoted([5], {5: 0.55}, {5: 1.20}) == pytest.approx([0.65])


def test_the_next_step_s_figure_comes_first_and_its_own_stands_in_where_that_step_wrote_none():
    # Version 5 measured before a promotion (0.90) and later by the step trained from it (0.70,
    # after a restart between the two): the step's counts, 0.70 − 0.55 = 0.15; version 6 has
    # neither. Where step 6 wrote no kl_ref (an MIS step that dropped every row): 0.90 − 0.55 = 0.35.
    assert drift_from_promoted([5, 6], {5: 0.55, 6: 0.70}, {5: 0.90}) == pytest.approx([0.15, None])
    assert drift_from_promoted([5, 6], {5: 0.55, 6: None}, {5: 0.90}) == pytest.approx([0.35, None])
