"""The online preference-shift simulation (SAO §3.4, docs/design.md §6): a real HTTP client.

Writing requests go to the server with the SAO system prompt that lets the policy choose among
the schedule's styles; a judge scores each answer (reward = quality × [style == the target])
and posts it as feedback with the completion's token. One rollout per prompt; feedback per
request. Two modes:

- ``sync`` (lockstep): each step sends ``batch_size`` requests, waits for their feedback, then
  waits for the learner's next policy version, so a step is a learner step and every sample is
  on-policy.
- ``async`` (open loop, SAO's setting): requests keep flowing at a fixed number in flight
  (``concurrency``) or at a rate (``rate`` requests/s, Poisson arrivals) and never wait for the
  learner; each answer is judged when it comes back and its feedback posted after an optional
  exponential delay (``feedback_delay_s``, the mean). The learner trains whenever a batch is
  ready and the server swaps versions while requests are in flight. An answer counts once,
  toward the version that generated its first token (the trajectory record's spans, read from
  ``GET /admin/trajectories/{id}``; the dispatch version without an admin key): its step is
  that version minus the version served at the start, and the schedule's target is the target
  at that step. The run ends when the last step of the schedule holds ``batch_size`` answers,
  or after ``max_seconds``.

Options: at most one in-flight request per prompt (SPO++ setting), the uncertainty sampler
(prompt weight sqrt(v̂(1−v̂) + 0.05) from the server's evidence view), a prompt pool of K
requests cycled in order (every prompt recurs every K requests), in async mode a backlog
cap and pacing to the learner (``judge.pacing``), and an adversarial cohort of raters
(``judge.adversary``: each request then comes from one of several simulated users, named in its
``user`` field, and a share of them rate by their own rule).

With an admin key the result also says what the version lifecycle did with the versions the run
trained (``judge.guardstats.lifecycle_summary``), and with an adversary the cohort's figures
(``attack_summary``); docs/guard.md, "Simulated attacks and faults".

The run is ``Simulation`` (``run``); the settings are ``judge.sim_config``, the result and its
records ``judge.sim_result``, one request's round trip ``judge.sim_client``, and the two traffic
drivers ``judge.sim_lockstep`` and ``judge.sim_openloop``.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from judge.guardstats import attack_summary, lifecycle_summary
from judge.sim_lockstep import LockstepTraffic
from judge.sim_openloop import OpenLoopTraffic
from judge.sim_result import SimulationResult


class Simulation(LockstepTraffic, OpenLoopTraffic):
    """Drives the server; ``run`` returns per-request records for ``judge.report``."""

    async def run(self) -> SimulationResult:
        """Send the traffic of ``config.mode`` until the schedule is done (or ``max_seconds``
        passed, or the task is cancelled: ``interrupted``), then read the learner's steps and what
        the lifecycle did (with an admin key) and the adversary's figures; the result, also kept
        in ``self.result`` as it fills. Raises httpx.HTTPError when the served version (``GET
        /v1/models``) cannot be read at the start."""
        cfg = self.config
        self._t0, self._t0_wall = time.monotonic(), time.time()
        self.result.t0_wall = self._t0_wall
        async with httpx.AsyncClient(base_url=cfg.base_url, timeout=600) as http:
            self.result.start_version = self._version_now = await self._version(http)
            try:
                if cfg.mode == "async":
                    await self._run_async(http)
                else:
                    await self._run_sync(http)
            except asyncio.CancelledError:
                self.result.interrupted = True
            self.result.wall_s = self._now()
            if cfg.admin_key:
                self.result.learner_steps = await self._learner_steps(http)
                events = await self._lifecycle_events(http)
                if events is not None:
                    summary = lifecycle_summary(
                        self.result.records, events, self._t0_wall, self.result.start_version
                    )
                    self.result.lifecycle = summary | {"last_verdict": await self._last_verdict(http)}
        if cfg.adversary is not None:
            self.result.attack = attack_summary(self.result.records, cfg.adversary)
        return self.result

    async def _lifecycle_events(self, http: httpx.AsyncClient) -> list[dict] | None:
        """The lifecycle's transitions, oldest first (admin view, the newest 1000); None when
        they cannot be read."""
        try:
            r = await http.get(
                "/admin/lifecycle", params=self._admin_params(limit=1000), headers=self._headers
            )
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        return list(reversed(r.json()["events"]))

    async def _last_verdict(self, http: httpx.AsyncClient) -> dict | None:
        """The learner's last verdict on the lineage still under watch (``GET /dashboard/state``,
        ``guard.verdict``: the bounds on Δ, each arm's ratings and mean, the decision); None when
        there is none or it cannot be read; the run's policy's (``?policy=``)."""
        try:
            r = await http.get("/dashboard/state", params=self._admin_params())
        except httpx.HTTPError:
            return None
        return r.json()["guard"]["verdict"] if r.status_code == 200 else None

    async def _learner_steps(self, http: httpx.AsyncClient) -> list[dict]:
        """The learner's step metrics for the versions this run trained (admin view)."""
        try:
            r = await http.get("/admin/learner", params=self._admin_params(limit=1000), headers=self._headers)
        except httpx.HTTPError:
            return []
        if r.status_code != 200:
            return []
        return [s for s in r.json()["steps"] if s["version"] > self.result.start_version]
