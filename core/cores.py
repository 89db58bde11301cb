"""How one machine's cores are split between a vLLM engine and a learner that run beside it.

Two processes that each run one thread per core share every core, and a torch or OpenMP pool
waits for its slowest thread at the end of every operator: the learner's thread that shares a
core with the engine gets a time slice in turn, and the learner's whole step runs at that pace
(measured in docs/precision.md, "Sharing the cores"). So a job that runs both on one machine gives each its own cores (``saoserve demo``: the
engine's in ``Settings.engine_threads``, the learner's in ``Settings.learner_threads``).
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset``
    narrows; ``os.cpu_count`` would count the host's)."""
    return len(os.sched_getaffinity(0))


def split_cores(cores: int) -> tuple[int, int]:
    """``(engine_threads, learner_threads)`` for ``cores`` cores: half each, the engine's half
    rounded down, at least one thread each (a single core is then shared, as it must be).

    Raises ValueError if ``cores < 1``.
    """
    if cores < 1:
        raise ValueError(f"need at least one core, not {cores}")
    engine = max(1, cores // 2)
    return engine, max(1, cores - engine)
