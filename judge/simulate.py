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
from judge.adversary import Adversary
from judge.base import Judge, JudgeFailure, Judgement
from judge.chatstream import ChatStream, StreamError
from judge.guardstats import attack_summary, lifecycle_summary
from judge.pacing import pace_gap
from judge.styles import Schedule, system_prompt, writing_requests

MODES = ("sync", "async")

# Seconds a worker waits after a failed request before its next one.
FAILURE_BACKOFF_S = 0.5
# The settings a report states with its numbers (``SimulationResult.traffic``).
TRAFFIC_FIELDS = (
    "mode",
    "batch_size",
    "concurrency",
    "rate",
    "feedback_delay_s",
    "max_backlog",
    "pace",
    "prompt_pool",
    "max_tokens",
    "temperature",
    "seed",
)


@dataclass
class SimulationConfig:
    """One simulation run. ``steps`` defaults to the schedule's length (in learner versions).

    ``rate`` (requests/s) and ``feedback_delay_s`` (seconds, mean of an exponential; 0 = at
    once), ``max_seconds`` and ``max_backlog`` (new requests are held while the samples
    waiting for the learner, estimated as feedback posted minus ``batch_size`` per new version,
    plus the answers still on their way to feedback reach it; None = never held) and ``pace``
    (space admissions by ``pace_gap``; with a fixed number in flight, not with ``rate``) apply
    to ``mode="async"``. ``prompt_pool``: cycle the first K
    writing requests in order instead of sampling all of them. ``adversary``: the cohort of
    raters that rate by their own rule (``judge.adversary``; None: every rater is honest and
    requests carry no ``user``).
    """

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
    mode: str = "sync"
    rate: float | None = None
    feedback_delay_s: float = 0.0
    max_seconds: float | None = None
    max_backlog: int | None = None
    prompt_pool: int | None = None
    pace: bool = False
    adversary: Adversary | None = None

    @property
    def total_steps(self) -> int:
        """Learner steps (versions) the run covers: ``steps``, or the schedule's length."""
        return self.steps or self.schedule.total_steps

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: choose sync or async")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.feedback_delay_s < 0:
            raise ValueError(f"feedback_delay_s must be >= 0, got {self.feedback_delay_s}")
        if self.prompt_pool is not None and self.prompt_pool < 1:
            raise ValueError(f"prompt_pool must be >= 1, got {self.prompt_pool}")
        if self.pace and (self.mode != "async" or self.rate is not None):
            raise ValueError("pace applies to async mode with a fixed number in flight, not with a rate")


@dataclass
class SimulationResult:
    """Records (one per judged answer), the learner's step metrics of the run (``GET
    /admin/learner``, versions after ``start_version``; empty without an admin key), and in
    async mode a timeline sampled about once a second: ``{"t": s since start, "version",
    "backlog": samples waiting (estimate), "in_flight": requests}``. ``traffic``: the config's
    ``TRAFFIC_FIELDS``, the settings to state with the run's numbers. ``attack``: the adversary's
    figures (``attack_summary``; None without one); ``lifecycle``: what the lifecycle did with
    the run's versions (``lifecycle_summary``, plus ``last_verdict``: the learner's last verdict
    on the lineage still under watch at the end, or None; None without an admin key or when it
    could not be read)."""

    records: list[dict] = field(default_factory=list)
    judge_failures: int = 0
    request_failures: int = 0
    interrupted: bool = False
    stopped_by: str | None = None
    mode: str = "sync"
    start_version: int = 0
    wall_s: float = 0.0
    held_s: float = 0.0
    learner_steps: list[dict] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    traffic: dict = field(default_factory=dict)
    attack: dict | None = None
    lifecycle: dict | None = None

    def details(self) -> dict:
        """What ``judge.report.write_report`` reads besides the records."""
        return {
            "mode": self.mode,
            "traffic": self.traffic,
            "start_version": self.start_version,
            "wall_s": self.wall_s,
            "held_s": self.held_s,
            "learner_steps": self.learner_steps,
            "timeline": self.timeline,
            "request_failures": self.request_failures,
            "judge_failures": self.judge_failures,
            "stopped_by": self.stopped_by,
            "attack": self.attack,
            "lifecycle": self.lifecycle,
        }


class Simulation:
    """Drives the server; ``run`` returns per-request records for ``judge.report``."""

    def __init__(
        self, config: SimulationConfig, judge: Judge, on_step: Callable[[int, list[dict]], None] | None = None
    ):
        self.config = config
        self.judge = judge
        self.on_step = on_step
        self.rng = random.Random(config.seed)
        # Its own stream, so that an adversary leaves the prompt order of a seed unchanged.
        self.users_rng = random.Random(f"{config.seed}:users")
        requests = writing_requests()
        n = config.prompt_pool or config.n_prompts
        self.requests = requests[:n] if n else requests
        self.system = system_prompt(config.schedule.styles)
        self.in_flight: set[int] = set()
        self.result = SimulationResult(
            mode=config.mode, traffic={k: getattr(config, k) for k in TRAFFIC_FIELDS}
        )
        self._cursor = 0
        self._t0 = time.monotonic()
        self._t0_wall = time.time()
        self._version_now = 0
        self._feedback_posted = 0
        self._requests_open = 0
        self._outstanding = 0
        self._holding = 0
        self._hold_started = 0.0
        self._per_step: dict[int, int] = {}
        self._version_seen_at: list[tuple[float, int]] = []
        self._next_slot = 0.0

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.admin_key}"} if self.config.admin_key else {}

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def _version(self, http: httpx.AsyncClient) -> int:
        return (await http.get("/v1/models")).json()["data"][0]["policy_version"]

    async def _weights(self, http: httpx.AsyncClient) -> list[float]:
        """Uncertainty sampler weights per request, from the evidence view (1 where unknown)."""
        r = await http.get("/admin/evidence", params={"top": len(self.requests)}, headers=self._headers)
        r.raise_for_status()
        by_id = {p["prompt_id"]: p["value"] for p in r.json()["prompts"]}
        return [uncertainty_weight(by_id.get(self._prompt_id(i), 0.5)) for i in range(len(self.requests))]

    def _prompt_id(self, i: int) -> str:
        return f"sim-{i:04d}"

    def _draw_user(self) -> int | None:
        """The simulated user who sends the next request (uniform); None without an adversary."""
        adv = self.config.adversary
        return None if adv is None else self.users_rng.randrange(adv.users)

    def _rate(self, user: int | None, answer: str, j: Judgement) -> tuple[float, dict]:
        """The reward ``user`` posts for ``answer`` and the record's rating fields: the judge's
        reward from an honest rater, the cohort's (``Adversary.reward``) from an adversary.
        Without an adversary: the judge's reward and no fields."""
        adv = self.config.adversary
        if adv is None or user is None:
            return j.reward, {}
        hostile = adv.is_adversary(user)
        reward = adv.reward(answer) if hostile else j.reward
        return reward, {
            "user": _user_name(user),
            "rater": "adversary" if hostile else "honest",
            "judge_reward": j.reward,
            "carries": adv.carries(answer),
        }

    def _record(
        self,
        step: int,
        i: int,
        body: dict,
        target: str,
        j: Judgement,
        answer: str,
        reward: float,
        rating: dict,
        versions: dict | None = None,
        times: dict | None = None,
    ) -> dict:
        """The record of request ``i``'s judged answer (``SimulationResult.records``) with the
        ``reward`` posted and ``rating``'s fields (``_rate``); ``versions`` (first and last
        token's) and ``times`` are async mode's."""
        return {
            "step": step,
            "id": body["id"],
            "target_style": target,
            "detected_style": j.style,
            "reward": reward,
            **rating,
            "quality": j.quality,
            "policy_version": body["policy_version"],
            **(versions or {}),
            "finish_reason": body["choices"][0]["finish_reason"],
            **(times or {}),
            "prompt_id": self._prompt_id(i),
            "request": self.requests[i],
            "answer": answer,
        }

    async def _pick(self, http: httpx.AsyncClient, n: int) -> list[int]:
        free = [
            i
            for i in range(len(self.requests))
            if not (self.config.one_in_flight_per_prompt and i in self.in_flight)
        ]
        if self.config.prompt_pool:
            # Round robin over the pool from where the last pick stopped, skipping busy prompts.
            k = len(self.requests)
            order = [(self._cursor + j) % k for j in range(k)]
            picked = [i for i in order if i in set(free)][:n]
            if picked:
                self._cursor = (picked[-1] + 1) % k
            return picked
        if self.config.uncertainty_sampler and self.config.admin_key:
            weights = await self._weights(http)
            picked: list[int] = []
            pool = list(free)
            while pool and len(picked) < n:
                j = self.rng.choices(range(len(pool)), weights=[weights[i] for i in pool])[0]
                picked.append(pool.pop(j))
            return picked
        return self.rng.sample(free, min(n, len(free)))

    def _payload(self, i: int, user: int | None = None) -> dict:
        """The chat request body of request ``i``: the style system prompt, the writing request,
        the config's token limit and temperature, the prompt id the evidence is kept under, and
        the simulated ``user``'s name when there is one (``_draw_user``)."""
        body = {
            "messages": [
                {"role": "system", "content": self.system},
                {"role": "user", "content": self.requests[i]},
            ],
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
            "prompt_id": self._prompt_id(i),
        }
        return body if user is None else body | {"user": _user_name(user)}

    async def _ask(self, http: httpx.AsyncClient, i: int, user: int | None = None) -> dict | None:
        """Send request ``i`` (from ``user``); the response body, or None (counted) on a non-200."""
        r = await http.post("/v1/chat/completions", json=self._payload(i, user))
        if r.status_code != 200:
            self.result.request_failures += 1
            return None
        return r.json()

    async def _ask_streaming(
        self, http: httpx.AsyncClient, i: int, user: int | None = None
    ) -> tuple[dict | None, float | None]:
        """Send request ``i`` (from ``user``) as a stream; ``(body, t_first_token)``: the body in the non-streaming
        shape (``ChatStream.close``) and the run-clock second at which the first chunk with text
        arrived (None if none had text). ``(None, None)``, counted in ``request_failures``, on a
        non-200, an error chunk, a stream without a finish chunk, a transport error or a chunk
        that is not JSON."""
        stream = ChatStream(self._now)
        try:
            async with http.stream(
                "POST", "/v1/chat/completions", json=self._payload(i, user) | {"stream": True}
            ) as r:
                if r.status_code != 200:
                    await r.aread()
                    self.result.request_failures += 1
                    return None, None
                async for text in r.aiter_text():
                    stream.feed(text)
            body = stream.close()
        except (httpx.HTTPError, StreamError):
            # A dropped connection, a read timeout, an error chunk or a chunk cut short.
            body = None
        if body is None:
            self.result.request_failures += 1
            return None, None
        return body, stream.first_text_at

    async def _judge(self, request: str, answer: str, target: str):
        try:
            return (await asyncio.to_thread(self.judge.judge_many, [(request, answer, target)]))[0]
        except JudgeFailure:
            self.result.judge_failures += 1
            return None

    async def _feedback(self, http: httpx.AsyncClient, body: dict, reward: float) -> bool:
        fb = await http.post(
            "/v1/feedback",
            json={
                "id": body["id"],
                "feedback_token": body["feedback_token"],
                "reward": reward,
                "source": "judge",
            },
        )
        if fb.status_code != 202:
            self.result.request_failures += 1
            return False
        return True

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

    async def run(self) -> SimulationResult:
        cfg = self.config
        self._t0, self._t0_wall = time.monotonic(), time.time()
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
            r = await http.get("/admin/lifecycle", params={"limit": 1000}, headers=self._headers)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        return list(reversed(r.json()["events"]))

    async def _last_verdict(self, http: httpx.AsyncClient) -> dict | None:
        """The learner's last verdict on the lineage still under watch (``GET /dashboard/state``,
        ``guard.verdict``: the bounds on Δ, each arm's ratings and mean, the decision); None when
        there is none or it cannot be read."""
        try:
            r = await http.get("/dashboard/state")
        except httpx.HTTPError:
            return None
        return r.json()["guard"]["verdict"] if r.status_code == 200 else None

    async def _learner_steps(self, http: httpx.AsyncClient) -> list[dict]:
        """The learner's step metrics for the versions this run trained (admin view)."""
        try:
            r = await http.get("/admin/learner", params={"limit": 1000}, headers=self._headers)
        except httpx.HTTPError:
            return []
        if r.status_code != 200:
            return []
        return [s for s in r.json()["steps"] if s["version"] > self.result.start_version]

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

    # ------------------------------------------------------------------ async mode
    def _backlog(self) -> int:
        """Samples waiting for the learner: feedback posted minus a batch per new version."""
        trained = (self._version_now - self.result.start_version) * self.config.batch_size
        return max(0, self._feedback_posted - trained)

    def _done(self) -> bool:
        steps = self.config.total_steps
        past = self._version_now - self.result.start_version >= steps
        return past or self._per_step.get(steps - 1, 0) >= self.config.batch_size

    async def _spans(self, http: httpx.AsyncClient, body: dict) -> tuple[int, int, str | None]:
        """(first, last) token versions of the answer from its trajectory record, and the canary
        arm it was routed to (None outside a canary split); the dispatch version for both and no
        arm without an admin key or when the record cannot be read."""
        v = body["policy_version"]
        if not self.config.admin_key:
            return v, v, None
        r = await http.get(f"/admin/trajectories/{body['id']}", headers=self._headers)
        if r.status_code != 200:
            return v, v, None
        record = r.json()
        spans = record.get("token_versions") or [[v, 0]]
        return spans[0][0], spans[-1][0], record.get("arm")

    async def _one_async(self, http: httpx.AsyncClient, i: int, pending: set[asyncio.Task]) -> None:
        self._outstanding += 1
        handed_on = False
        try:
            handed_on = await self._answer(http, i, pending)
        except httpx.HTTPError:
            # The spans read failed (the server went away): counted, and the worker goes on.
            self.result.request_failures += 1
        finally:
            if not handed_on:
                self._outstanding -= 1

    async def _answer(self, http: httpx.AsyncClient, i: int, pending: set[asyncio.Task]) -> bool:
        """Ask, read the spans, judge and schedule the feedback; True once the feedback task
        owns the answer (it then leaves ``_outstanding`` when its feedback is posted)."""
        cfg = self.config
        request = self.requests[i]
        user = self._draw_user()
        self.in_flight.add(i)
        self._requests_open += 1
        try:
            sent = self._now()
            body, first_token = await self._ask_streaming(http, i, user)
            if body is None:
                return False
            answered = self._now()
            first, last, arm = await self._spans(http, body)
        finally:
            self.in_flight.discard(i)
            self._requests_open -= 1
        step = first - self.result.start_version
        if step >= cfg.total_steps:
            return False  # generated by a version past the schedule: not part of the run
        target = cfg.schedule.target_at(step)
        answer = body["choices"][0]["message"]["content"]
        j = await self._judge(request, answer, target)
        if j is None:
            return False
        reward, rating = self._rate(user, answer, j)
        rec = self._record(
            step,
            i,
            body,
            target,
            j,
            answer,
            reward,
            rating,
            versions={"first_version": first, "last_version": last, "arm": arm},
            times={"t_sent": sent, "t_first_token": first_token, "t_answer": answered, "t_feedback": None},
        )
        self.result.records.append(rec)
        self._per_step[step] = self._per_step.get(step, 0) + 1
        task = asyncio.create_task(self._late_feedback(http, body, rec))
        pending.add(task)
        task.add_done_callback(pending.discard)
        return True

    async def _late_feedback(self, http: httpx.AsyncClient, body: dict, rec: dict) -> None:
        try:
            delay = self.config.feedback_delay_s
            if delay > 0:
                await asyncio.sleep(self.rng.expovariate(1.0 / delay))
            try:
                posted = await self._feedback(http, body, rec["reward"])
            except httpx.HTTPError:
                self.result.request_failures += 1
                posted = False
            if posted:
                rec["t_feedback"] = self._now()
                self._feedback_posted += 1
        finally:
            self._outstanding -= 1

    def _must_hold(self) -> bool:
        """The backlog cap: samples waiting plus answers that will become samples (requests in
        flight, being judged, or waiting to post their feedback) reach ``max_backlog``. Counting
        the outstanding ones keeps a burst of in-flight answers from overshooting the cap (with
        only the waiting samples counted, a short run overshot by the 8 in flight, the learner
        trained two batches back to back, and a version served no new request). Never once the
        schedule's last version is served: the learner trains no further, and the run still
        needs a batch of that version's answers to end."""
        cap = self.config.max_backlog
        return cap is not None and self._backlog() + self._outstanding >= cap and not self._serving_last()

    def _serving_last(self) -> bool:
        """The schedule's last version is served: the learner trains no further, so neither the
        cap nor pacing holds a request back."""
        return self._version_now - self.result.start_version >= self.config.total_steps - 1

    async def _admit(self) -> None:
        """Wait while ``_must_hold``, then for this request's pacing slot; if the cap binds by
        the slot (the slots already given out dispatched meanwhile), wait for both again."""
        while True:
            await self._wait_for_cap()
            if not await self._wait_for_slot() or not self._must_hold():
                return

    async def _wait_for_cap(self) -> None:
        """Wait while ``_must_hold``; ``held_s`` counts the wall seconds during which at least
        one new request was held by the cap."""
        if not self._must_hold():
            return
        if self._holding == 0:
            self._hold_started = self._now()
        self._holding += 1
        try:
            while self._must_hold():
                await asyncio.sleep(0.2)
        finally:
            self._holding -= 1
            if self._holding == 0:
                self.result.held_s += self._now() - self._hold_started

    async def _wait_for_slot(self) -> bool:
        """With ``pace``, take the next slot (``pace_gap`` after the last one given out) and
        sleep until it; True if it slept. Never once the schedule's last version serves, like
        the cap."""
        gap = pace_gap(self._version_seen_at, self.config.batch_size) if self.config.pace else None
        if gap is None or self._serving_last():
            return False
        now = self._now()
        slot = max(now, self._next_slot)
        self._next_slot = slot + gap
        if slot <= now:
            return False
        await asyncio.sleep(slot - now)
        return True

    async def _worker(self, http: httpx.AsyncClient, pending: set[asyncio.Task]) -> None:
        while True:
            await self._admit()
            picks = await self._pick(http, 1)
            if not picks:
                await asyncio.sleep(0.1)
                continue
            failures = self.result.request_failures
            await self._one_async(http, picks[0], pending)
            if self.result.request_failures > failures:
                # A server that refuses or drops requests at once is not hammered in a tight loop.
                await asyncio.sleep(FAILURE_BACKOFF_S)

    async def _arrivals(self, http: httpx.AsyncClient, pending: set[asyncio.Task]) -> None:
        assert self.config.rate is not None
        while True:
            await asyncio.sleep(self.rng.expovariate(self.config.rate))
            await self._admit()
            picks = await self._pick(http, 1)
            if not picks:
                continue  # every prompt of the pool is in flight: this arrival is dropped
            self.in_flight.add(picks[0])
            task = asyncio.create_task(self._one_async(http, picks[0], pending))
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def _monitor(self, http: httpx.AsyncClient) -> None:
        """Follow the served version (for the backlog), sample the timeline, report progress."""
        cfg = self.config
        while not self._done() and (cfg.max_seconds is None or self._now() < cfg.max_seconds):
            try:
                version = await self._version(http)
            except httpx.HTTPError:
                version = self._version_now
            if version > self._version_now:
                self._version_seen_at.append((self._now(), version))
            for v in range(self._version_now, version):
                step = v - self.result.start_version
                if self.on_step:
                    self.on_step(step, [r for r in self.result.records if r["step"] == step])
            self._version_now = max(self._version_now, version)
            self.result.timeline.append(
                {
                    "t": round(self._now(), 3),
                    "version": self._version_now,
                    "backlog": self._backlog(),
                    "in_flight": self._requests_open,
                }
            )
            await asyncio.sleep(1.0)
        if self.on_step:
            step = self._version_now - self.result.start_version
            self.on_step(step, [r for r in self.result.records if r["step"] == step])

    async def _run_async(self, http: httpx.AsyncClient) -> None:
        cfg = self.config
        pending: set[asyncio.Task] = set()
        if cfg.rate is None:
            drivers = [asyncio.create_task(self._worker(http, pending)) for _ in range(cfg.concurrency)]
        else:
            drivers = [asyncio.create_task(self._arrivals(http, pending))]
        try:
            await self._monitor(http)
        finally:
            # Requests and feedback still out belong to versions the run has finished with.
            for t in [*drivers, *pending]:
                t.cancel()
            await asyncio.gather(*drivers, *pending, return_exceptions=True)


def _user_name(user: int) -> str:
    """Simulated user ``user``'s identity, sent as the request's ``user`` field."""
    return f"sim-user-{user:02d}"


def save_records(path: Path, records: list[dict]) -> None:
    """One JSON record per line (the report's input)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
