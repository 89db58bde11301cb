"""The online preference-shift simulation (SAO §3.4, DESIGN §6): a real HTTP client.

Each step: ``batch_size`` writing requests go to the server with the SAO system prompt that
lets the policy choose among the schedule's styles; a judge scores each answer (reward =
quality × [style == the step's target]) and posts it as feedback with the completion's token.
One rollout per prompt; feedback per request. By default the client then waits for the
learner's next policy version, so a simulation step is a learner step (the report's x axis).

Options: concurrency, at most one in-flight request per prompt (SPO++ setting), the
uncertainty sampler (prompt weight sqrt(v̂(1−v̂) + 0.05) from the server's evidence view).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from core.evidence import uncertainty_weight
from judge.base import Judge, JudgeFailure
from judge.styles import Schedule, system_prompt, writing_requests


@dataclass
class SimulationConfig:
    """One simulation run. ``steps`` defaults to the schedule's length."""

    base_url: str
    schedule: Schedule
    batch_size: int = 8
    steps: int | None = None
    concurrency: int = 8
    max_tokens: int = 64
    temperature: float = 1.0
    seed: int = 0
    one_in_flight_per_prompt: bool = True
    uncertainty_sampler: bool = False
    wait_for_version: bool = True
    version_timeout_s: float = 600.0
    admin_key: str | None = None
    n_prompts: int | None = None


@dataclass
class SimulationResult:
    records: list[dict] = field(default_factory=list)
    judge_failures: int = 0
    request_failures: int = 0
    interrupted: bool = False


class Simulation:
    """Drives the server; ``run`` returns per-request records for ``judge.report``."""

    def __init__(
        self, config: SimulationConfig, judge: Judge, on_step: Callable[[int, list[dict]], None] | None = None
    ):
        self.config = config
        self.judge = judge
        self.on_step = on_step
        self.rng = random.Random(config.seed)
        requests = writing_requests()
        self.requests = requests[: config.n_prompts] if config.n_prompts else requests
        self.system = system_prompt(config.schedule.styles)
        self.in_flight: set[int] = set()
        self.result = SimulationResult()

    async def _version(self, http: httpx.AsyncClient) -> int:
        return (await http.get("/v1/models")).json()["data"][0]["policy_version"]

    async def _weights(self, http: httpx.AsyncClient) -> list[float]:
        """Uncertainty sampler weights per request, from the evidence view (1 where unknown)."""
        headers = {"Authorization": f"Bearer {self.config.admin_key}"}
        r = await http.get("/admin/evidence", params={"top": len(self.requests)}, headers=headers)
        r.raise_for_status()
        by_id = {p["prompt_id"]: p["value"] for p in r.json()["prompts"]}
        return [uncertainty_weight(by_id.get(self._prompt_id(i), 0.5)) for i in range(len(self.requests))]

    def _prompt_id(self, i: int) -> str:
        return f"sim-{i:04d}"

    async def _pick(self, http: httpx.AsyncClient, n: int) -> list[int]:
        free = [
            i
            for i in range(len(self.requests))
            if not (self.config.one_in_flight_per_prompt and i in self.in_flight)
        ]
        if self.config.uncertainty_sampler and self.config.admin_key:
            weights = await self._weights(http)
            picked: list[int] = []
            pool = list(free)
            while pool and len(picked) < n:
                j = self.rng.choices(range(len(pool)), weights=[weights[i] for i in pool])[0]
                picked.append(pool.pop(j))
            return picked
        return self.rng.sample(free, min(n, len(free)))

    async def _one(
        self, http: httpx.AsyncClient, sem: asyncio.Semaphore, step: int, i: int, target: str
    ) -> dict | None:
        cfg = self.config
        request = self.requests[i]
        async with sem:
            self.in_flight.add(i)
            try:
                r = await http.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [
                            {"role": "system", "content": self.system},
                            {"role": "user", "content": request},
                        ],
                        "max_tokens": cfg.max_tokens,
                        "temperature": cfg.temperature,
                        "prompt_id": self._prompt_id(i),
                    },
                )
                if r.status_code != 200:
                    self.result.request_failures += 1
                    return None
                body = r.json()
                answer = body["choices"][0]["message"]["content"]
                try:
                    j = (await asyncio.to_thread(self.judge.judge_many, [(request, answer, target)]))[0]
                except JudgeFailure:
                    self.result.judge_failures += 1
                    return None
                fb = await http.post(
                    "/v1/feedback",
                    json={
                        "id": body["id"],
                        "feedback_token": body["feedback_token"],
                        "reward": j.reward,
                        "source": "judge",
                    },
                )
                if fb.status_code != 202:
                    self.result.request_failures += 1
                    return None
            finally:
                self.in_flight.discard(i)
        return {
            "step": step,
            "target_style": target,
            "detected_style": j.style,
            "reward": j.reward,
            "quality": j.quality,
            "policy_version": body["policy_version"],
            "prompt_id": self._prompt_id(i),
            "request": request,
            "answer": answer,
        }

    async def run(self) -> SimulationResult:
        cfg = self.config
        steps = cfg.steps or cfg.schedule.total_steps
        sem = asyncio.Semaphore(cfg.concurrency)
        async with httpx.AsyncClient(base_url=cfg.base_url, timeout=600) as http:
            try:
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
            except asyncio.CancelledError:
                self.result.interrupted = True
        return self.result

    async def _await_version(self, http: httpx.AsyncClient, version: int) -> None:
        deadline = time.monotonic() + self.config.version_timeout_s
        while time.monotonic() < deadline:
            if await self._version(http) > version:
                return
            await asyncio.sleep(0.5)


def save_records(path: Path, records: list[dict]) -> None:
    """One JSON record per line (the report's input)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
