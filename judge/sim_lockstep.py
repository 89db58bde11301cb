"""The simulation's lockstep traffic (``mode="sync"``, ``judge.simulate``): each step sends
``batch_size`` requests, waits for their feedback, then waits for the learner's next policy
version, so a step is a learner step and every sample is on-policy.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from judge.sim_client import SimulationClient


class LockstepTraffic(SimulationClient):
    """``_run_sync``: the run's steps in lockstep with the learner."""

    async def _one(
        self, http: httpx.AsyncClient, sem: asyncio.Semaphore, step: int, i: int, target: str
    ) -> dict | None:
        """One lockstep request: ask, judge, post the feedback; its record, or None when the
        request, the judge or the feedback failed (counted). A transport error (a dropped
        connection, a read timeout) is one failed request, as in async mode, so one lost answer
        does not end the whole step's ``gather``."""
        request = self.requests[i]
        user = self._draw_user()
        async with sem:
            self.in_flight.add(i)
            try:
                body = await self._ask(http, i, user)
                if body is None:
                    return None
                answer = body["choices"][0]["message"]["content"]
                j = await self._judge(request, answer, target)
                if j is None:
                    return None
                reward, rating = self._rate(user, answer, j)
                if not await self._feedback(http, body, reward):
                    return None
            except httpx.HTTPError:
                self.result.request_failures += 1
                return None
            finally:
                self.in_flight.discard(i)
        return self._record(step, i, body, target, j, answer, reward, rating)

    async def _run_sync(self, http: httpx.AsyncClient) -> None:
        cfg = self.config
        steps = cfg.total_steps
        sem = asyncio.Semaphore(cfg.concurrency)
        for step in range(steps):
            target = cfg.schedule.target_at(step)
            version = await self._version(http)
            picks = await self._pick(http, cfg.batch_size)
            done = await asyncio.gather(*(self._one(http, sem, step, i, target) for i in picks))
            recs = [d for d in done if d is not None]
            self.result.records.extend(recs)
            if self.on_step:
                self.on_step(step, recs)
            if cfg.wait_for_version and step < steps - 1:
                await self._await_version(http, version)

    async def _await_version(self, http: httpx.AsyncClient, version: int) -> None:
        deadline = time.monotonic() + self.config.version_timeout_s
        while time.monotonic() < deadline:
            if await self._version(http) > version:
                return
            await asyncio.sleep(0.5)
