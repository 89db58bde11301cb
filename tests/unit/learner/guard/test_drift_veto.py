"""The drift veto's figure per lineage version (learner.guard.guard.drift_from_promoted; issue 40,
item 2): measured beyond the promoted version's KL to the base, the newest version included."""

from __future__ import annotations

import pytest

from core.lifecycle import drifted
from learner.guard.guard import drift_from_promoted


def test_each_version_s_drift_beyond_the_promoted_version_s():
    # Lineage [5, 6, 7]. Step 5 started from the promoted version: its kl_ref 0.55 is the
    # promoted version's drift from the base (near the bound 0.6).
    before = {5: 0.55, 6: 0.58, 7: 0.70}  # kl_ref: the policy each step started from
    after = {5: 0.58, 6: 0.70, 7: 1.20}  # kl_ref_after: the version each step made
    # 0.58 − 0.55, 0.70 − 0.55, 1.20 − 0.55: the newest (7) is measured by its own step.
    assert drift_from_promoted([5, 6, 7], before, after) == pytest.approx([0.03, 0.15, 0.65])
    assert drifted(drift_from_promoted([5, 6, 7], before, after), 0.6) == pytest.approx(0.65)
    # Measured from the base, version 5 (0.58) would already be within 0.02 of the bound and
    # version 6 (0.70) over it: every lineage after a promoted version near the bound rejected.
    assert drifted([after[5], after[6]], 0.6) == pytest.approx(0.70)
    assert drifted(drift_from_promoted([5, 6], before, after), 0.6) is None


def test_steps_without_the_after_figure_fall_back_to_the_next_step_s():
    # Steps that predate kl_ref_after: version 5's drift is step 6's kl_ref; the newest's is
    # not measured yet (None). No figure for the promoted version: the base's, 0.
    before = {5: None, 6: 0.30, 7: 0.45}
    assert drift_from_promoted([5, 6, 7], before, {}) == pytest.approx([0.30, 0.45, None])
    assert drift_from_promoted([5], {}, {}) == [None]
    assert drift_from_promoted([], {}, {}) == []
