"""Pacing open-loop traffic to the learner: one batch of requests per learner step.

With a fixed number of requests in flight and no pacing, a batch arrives as a burst early in
the learner's step in progress; its last feedback then waits for that step and for its own
(feedback→served ≈ two steps, issue 10). Spacing admissions by the learner's measured period
lets a batch complete about when the learner frees up. Where serving and learning share
cores, spreading the traffic also spreads their contention over the whole step, which is why
``SimulationConfig.pace`` is off unless asked for (measurements in docs/log/2026-12-05-demo-runs.md).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

# Pacing aims a little faster than the learner's measured step so the learner is never starved
# by its own measurement (with 1.0 the period seen could not shrink below the traffic's own);
# the backlog cap bounds what the headroom lets pile up.
PACE_HEADROOM = 0.9
PACE_RECENT = 3


def pace_gap(seen: Sequence[tuple[float, int]], batch_size: int) -> float | None:
    """Seconds between admitted requests so that one batch arrives per learner step.

    ``seen``: ``(seconds on the run clock, version)`` each time a new policy version was first
    seen, in order (a poll may skip versions). The learner's step period is the median of the
    last ``PACE_RECENT`` intervals between them, each divided by the versions it spans; the gap
    is ``PACE_HEADROOM × period / batch_size``. A batch then completes about when the learner
    finishes the step before it, so its feedback waits for no step but its own (feedback→served
    ≈ one step), while its tokens come from the version served during that step (staleness 1).
    None (no pacing) until two versions have been seen.

    Raises ValueError if ``batch_size`` < 1 or the versions do not increase.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    periods = []
    for (t0, v0), (t1, v1) in itertools.pairwise(seen):
        if v1 <= v0:
            raise ValueError(f"versions must increase, got {v0} then {v1}")
        periods.append((t1 - t0) / (v1 - v0))
    if not periods:
        return None
    return PACE_HEADROOM * statistics.median(periods[-PACE_RECENT:]) / batch_size
