"""The drift veto's figure per lineage version (learner.guard.guard.drift_from_promoted; issue 40,
item 2): measured beyond the promoted version's KL to the base, each version by the step trained from it."""

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
