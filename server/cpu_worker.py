"""vLLM's CPU worker inside its engine process, with a thread count of its own.

vLLM's CPU platform runs the model in a separate worker process (the ``mp`` executor) and hands
each step's inputs and outputs over a shared-memory queue whose readers spin (``sched_yield``)
for a second after every read. While requests are in flight, the engine process spins a core
of its own waiting for the worker: on a machine shared with the learner that is a core taken
from the learner. With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the CPU platform leaves the
single-process ``uni`` executor in place, so the model runs in the engine process (still a child
of the server; vLLM's ``AsyncLLM`` always starts one) and nothing spins; ``OMP_NUM_THREADS`` then
sets its compute threads, which the ``mp`` executor would have bound by
``VLLM_CPU_OMP_THREADS_BIND`` instead. Measured in docs/precision.md, "Sharing the cores".

vLLM reads both variables in the engine process it spawns, so they are set in this process's
environment only while that process starts, and put back after: engines started later in the
same process (the test suite's) keep their own layout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

IN_PROCESS_WORKER = "VLLM_ENABLE_V1_MULTIPROCESSING"
THREADS = "OMP_NUM_THREADS"


def worker_environment(threads: int) -> dict[str, str]:
    """The variables that start a CPU engine with its worker in-process on ``threads`` compute
    threads. Raises ValueError if ``threads < 1``."""
    if threads < 1:
        raise ValueError(f"an engine needs at least one compute thread, not {threads}")
    return {IN_PROCESS_WORKER: "0", THREADS: str(threads)}


@contextmanager
def in_process_worker(threads: int | None) -> Iterator[None]:
    """Within the block, engines start with ``worker_environment(threads)``; None changes
    nothing (vLLM's own layout). The variables' earlier values (or their absence) are restored
    on leaving, also when the block raises."""
    if threads is None:
        yield
        return
    wanted = worker_environment(threads)
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
