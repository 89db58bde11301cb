"""The chaos soak's faults (bench/chaos_soak.py): the learner's lives, each armed with a kill point
(``SAOSERVE_FAULT_POINT``, it dies there with status 137) or planned for a SIGKILL at a random
moment of its cycle, and restarted at once when it ends; on a schedule drawn from the seed,
PostgreSQL stopped and started, the broker paused and resumed, one replica stopped and started
again. Every outage is recorded as a ``Window`` with its timestamps, and every life as a
``Life``, for the audit (bench/soak_audit.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from testing.replicas import Process

SIGKILL = "sigkill"  # a life's plan: unarmed, SIGKILLed at a random moment of its cycle
SIGKILL_AFTER_S = (0.2, 2.0)  # that moment: seconds after the life's first join commit


@dataclass
class Window:
    """An outage: ``what`` was down from ``start`` to ``end`` (Unix s); ``slot`` None: every
    replica is affected, else only that replica; ``recovered_s``: from ``end`` to every replica
    answering ``/readyz`` 200."""

    what: str
    start: float
    end: float = 0.0
    slot: int | None = None
    recovered_s: float | None = None


@dataclass
class Life:
    """One learner life: its kill point (None: unarmed), whether it is planned for a SIGKILL, how
    it ended (``rc``: 137 at its point, -9 for a SIGKILL, None still running at the end);
    ``sigkill_at_s``: seconds from its start to the SIGKILL."""

    n: int
    point: str | None
    started: float
    planned_sigkill: bool = False
    ended: float | None = None
    rc: int | None = None
    sigkilled: bool = False
    sigkill_at_s: float | None = None


class SoakFaults:
    """The fault methods of ``Soak`` (bench/chaos_soak.py), on its fields: ``dep`` (the
    deployment), ``db``, ``replicas``, ``windows``, ``lives``, ``plans``, ``learner`` and
    ``learner_args``, ``restarts``, ``swaps_before_restart``, ``ready_log`` (under ``lock``),
    ``seed``, ``args`` and the ``stop_all`` event."""

    def _start_life(self) -> None:
        plan = self.plans.pop(0) if self.plans else None
        point = plan if plan != SIGKILL else None
        n = len(self.lives)
        self.learner = self.dep.learn(
            *self.learner_args, env={"SAOSERVE_FAULT_POINT": point or ""}, name=f"learner-{n}"
        )
        life = Life(n, point, time.time(), planned_sigkill=plan == SIGKILL)
        self.lives.append(life)
        if life.planned_sigkill:
            threading.Thread(target=self._sigkill_in_cycle, args=(life, self.learner), daemon=True).start()

    def supervise(self) -> None:
        """Restart the learner whenever a life ends, until the soak's end."""
        while not self.stop_all.is_set():
            proc = self.learner
            if proc is not None and not proc.alive():
                life = self.lives[-1]
                life.ended, life.rc = time.time(), proc.proc.returncode
                # Ended otherwise first (at its start, the database down): the next life takes its plan.
                if life.point and life.rc != 137:
                    self.plans.insert(0, life.point)
                elif life.planned_sigkill and life.rc != -9:
                    self.plans.insert(0, SIGKILL)
                self.dep.procs.remove(proc)
                self._start_life()
            time.sleep(0.2)

    def _sigkill_in_cycle(self, life: Life, proc: Process) -> None:
        """SIGKILL ``life`` a seeded 0.2-2 s after its first join commit (the learner's consumer
        offsets in the database advance), so that the kill lands at a random moment of its cycle
        (a join, a step, a version's write or commit...), not in its imports or its load."""
        from sqlalchemy import func, select
        from sqlalchemy.exc import DBAPIError

        from core.db import ConsumerOffset
        from learner.data.joiner import CONSUMER

        read = select(func.coalesce(func.sum(ConsumerOffset.next_offset), 0)).where(
            ConsumerOffset.consumer == CONSUMER
        )
        start = None
        while proc.alive() and not self.stop_all.is_set():
            with contextlib.suppress(DBAPIError), self.db.connect() as conn:
                offsets = conn.execute(read).scalar_one()
                if start is not None and offsets > start:
                    break
                start = offsets if start is None else start
            time.sleep(0.2)
        else:
            return
        time.sleep(random.Random(f"{self.seed}-life{life.n}").uniform(*SIGKILL_AFTER_S))
        if proc.alive():
            life.sigkilled, life.sigkill_at_s = True, round(time.time() - life.started, 1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ chaos
    def outage(self, what: str, down, up, seconds: float) -> None:
        w = Window(what, time.time())
        self.windows.append(w)
        down()
        time.sleep(seconds)
        up()
        w.end = time.time()
        w.recovered_s = self.wait_all_ready(w.end) - w.end

    def wait_all_ready(self, since: float, timeout_s: float = 120) -> float:
        """The first time after ``since`` when every replica answered ``/readyz`` 200 (a replica
        being restarted is left out: its own window ends when it is ready)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and not self.stop_all.is_set():
            restarting = {w.slot for w in self.windows if w.slot is not None and not w.end}
            with self.lock:
                after = [e for e in self.ready_log if e[0] >= since]
            ok_at = {}
            for t, slot, code, _ in after:
                if code == 200 and slot not in ok_at:
                    ok_at[slot] = t
            if set(range(len(self.replicas))) - restarting <= ok_at.keys():
                return max(ok_at.values(), default=since)
            time.sleep(0.2)
        raise TimeoutError(f"the replicas were not all ready within {timeout_s:.0f} s of {since:.1f}")

    def restart_replica(self, slot: int, db) -> None:
        from testing.replicas import metric

        old = self.replicas[slot]
        with contextlib.suppress(httpx.HTTPError):
            page = httpx.get(f"{old.url}/metrics", timeout=5).text
            self.swaps_before_restart[slot] = metric(page, "saoserve_policy_swaps_total", result="ok") or 0.0
        w = Window(f"replica {old.name} restart", time.time(), slot=slot)
        self.windows.append(w)
        if self.args.replica_stop == "kill":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.proc.pid, signal.SIGKILL)
        old.stop()
        self.dep.procs.remove(old)
        newest = newest_published_retrying(db)
        spawned, exits = time.time(), []
        while not self.stop_all.is_set():
            # An orchestrator's restart policy: a replica that exits while starting (its
            # migration at start needs the database) is started again.
            name = f"{old.name.split('-life')[0]}-life{len(self.restarts) + 2}-{len(exits)}"
            new = self.dep.serve(name, self._bind(slot))
            self.replicas[slot] = new
            try:
                self.dep.wait_ready([new], timeout_s=240)
                break
            except RuntimeError as exc:
                exits.append(str(exc).splitlines()[0])
                self.dep.procs.remove(new)
                time.sleep(1.0)
        w.end = time.time()
        w.recovered_s = self.wait_all_ready(w.end) - w.end
        self.restarts.append(
            {
                "slot": slot,
                "stopped": w.start,
                "spawned": spawned,
                "ready": w.end,
                "newest_at_spawn": newest,
                "failed_starts": exits,
            }
        )

    def _bind(self, slot: int) -> dict[str, str]:
        # One core per replica (vLLM binds every engine's worker to core 0 by default).
        return {"VLLM_CPU_OMP_THREADS_BIND": str(slot % (os.cpu_count() or 1))}

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds from the start of traffic, action), in time order: one replica restart per
        150 s of ``duration`` (at least one; slots in turn, the first 5 s in: a restart takes
        the longest), and pairs of a database outage and a broker pause in a seeded order, one
        pair per 75 s (at least one), spread evenly over the duration, none in its last 10 s.
        Restarts run beside the other actions, so their windows may overlap. The learner's
        SIGKILLs follow its lives, not the clock (``life_plans``)."""
        rng = random.Random(self.seed)
        d = self.args.duration
        restarts = max(1, int(d // 150))
        out = [(5.0 + k * d / restarts, f"replica:{k % self.args.replicas}") for k in range(restarts)]
        actions = []
        for _ in range(max(1, int(d // 75))):
            cycle = ["database", "broker"]
            rng.shuffle(cycle)
            actions += cycle
        gap = (d - 10) / (len(actions) + 1)
        out += [(gap * (k + 1) + rng.uniform(-0.2, 0.2) * gap, a) for k, a in enumerate(actions)]
        return sorted(out)


def kill_points(spec: str, seed: int, points: tuple[str, ...]) -> list[str]:
    """The kill points of the first learner lives, one life each: ``spec`` a comma-separated
    list of ``point:n`` (``SAOSERVE_FAULT_POINT`` values), or ``all``: every point once, from a
    seeded one on, each on its first or second pass."""
    if spec != "all":
        return [p for p in spec.split(",") if p]
    rng = random.Random(seed)
    first = rng.randrange(len(points))
    return [f"{points[(first + k) % len(points)]}:{rng.randint(1, 2)}" for k in range(len(points))]


def life_plans(points: list[str], sigkills: int) -> list[str]:
    """The first learner lives' plans: the armed ``points`` in their order with ``sigkills``
    SIGKILL lives among them, the first after one armed life (the first life starts before the
    traffic), the others spread evenly over the rest; ``life_plans(["a", "b", "c"], 2)`` is
    ``["a", SIGKILL, "b", SIGKILL, "c"]`` (after 1 + 0 * 2 // 2 = 1 and 1 + 1 * 2 // 2 = 2 armed
    lives)."""
    after = [min(len(points), 1 + i * max(0, len(points) - 1) // sigkills) for i in range(sigkills)]
    plans = list(points)
    for k in reversed(after):
        plans.insert(k, SIGKILL)
    return plans


def newest_published_retrying(db, timeout_s: float = 60) -> int:
    """The newest published version in the database, waiting out an outage."""
    from sqlalchemy import func, select
    from sqlalchemy.exc import OperationalError

    from core.db import PolicyVersion

    deadline = time.time() + timeout_s
    while True:
        try:
            with db.connect() as conn:
                return conn.execute(
                    select(func.coalesce(func.max(PolicyVersion.version), 0)).where(
                        PolicyVersion.status == "published"
                    )
                ).scalar_one()
        except OperationalError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)
