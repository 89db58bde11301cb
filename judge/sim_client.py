"""One request's round trip in the simulation (``judge.simulate``): pick a prompt (at random, round
robin over a pool, or by the uncertainty sampler), ask the server (whole or streamed), judge the
answer, rate it (the judge's reward, or an adversary's), post the feedback, and the record of
the judged answer. The traffic drivers (``judge.sim_lockstep``, ``judge.sim_openloop``) build on
``SimulationClient``.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable

import httpx

from core.evidence import uncertainty_weight
from judge.base import Judge, JudgeFailure, Judgement
from judge.chatstream import ChatStream, StreamError
from judge.sim_config import TRAFFIC_FIELDS, SimulationConfig
from judge.sim_result import SimulationResult
from judge.styles import system_prompt, writing_requests


class SimulationClient:
    """The server's client of one run: its config, judge, seeded draws, prompts, the requests in
    flight and the result being filled; ``on_step(step, records)`` is called as each step ends.
    Every failed request, judgement or feedback is counted in ``result``, never raised."""

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

    @property
    def _headers(self) -> dict[str, str]:
        """The ``/admin`` routes' header: the admin key as bearer (none without one)."""
        return {"Authorization": f"Bearer {self.config.admin_key}"} if self.config.admin_key else {}

    @property
    def _api_headers(self) -> dict[str, str]:
        """The chat, feedback and model-list header: the API key as bearer (none without one),
        so the server serves the key's policy and finds the answers it rates there."""
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def _admin_params(self, **params: object) -> dict[str, object]:
        """An admin read's query: ``params`` and, with a policy set, ``policy`` (the namespace
        the read is about)."""
        return params | {"policy": self.config.policy} if self.config.policy else params

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def _version(self, http: httpx.AsyncClient) -> int:
        """The version the key's policy serves: the model card's ``version`` (a server with a
        policy per tenant), else its ``policy_version``."""
        card = (await http.get("/v1/models", headers=self._api_headers)).json()["data"][0]
        return card.get("version", card["policy_version"])

    async def _weights(self, http: httpx.AsyncClient) -> list[float]:
        """Uncertainty sampler weights per request, from the evidence view (1 where unknown)."""
        r = await http.get(
            "/admin/evidence", params=self._admin_params(top=len(self.requests)), headers=self._headers
        )
        r.raise_for_status()
        by_id = {p["prompt_id"]: p["value"] for p in r.json()["prompts"]}
        return [uncertainty_weight(by_id.get(self._prompt_id(i), 0.5)) for i in range(len(self.requests))]

    def _prompt_id(self, i: int) -> str:
        """Request ``i``'s prompt id, in the server's own form (``p-`` + 32 hex digits), which
        the server stores as it is; any other id it stores as a keyed hash
        (``core.evidence_store.stored_prompt_id``), and the evidence view (``_weights``) would
        list the request under a name the simulation cannot match."""
        return "p-" + hashlib.sha256(f"sim-{i:04d}".encode()).hexdigest()[:32]

    def _draw_user(self) -> int:
        """The simulated user who sends the next request, uniform over the adversary's users, or
        without one over ``config.users`` honest ones: every request carries an identity, which
        the guard's identity cap counts when it binds every identity (``GuardConfig.vote_cap``
        ``identities``: then only identified senders vote; docs/guard.md "Who votes")."""
        adv = self.config.adversary
        return self.users_rng.randrange(self.config.users if adv is None else adv.users)

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
        r = await http.post("/v1/chat/completions", json=self._payload(i, user), headers=self._api_headers)
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
                "POST",
                "/v1/chat/completions",
                json=self._payload(i, user) | {"stream": True},
                headers=self._api_headers,
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
            headers=self._api_headers,
        )
        if fb.status_code != 202:
            self.result.request_failures += 1
            return False
        return True


def _user_name(user: int) -> str:
    """Simulated user ``user``'s identity, sent as the request's ``user`` field."""
    return f"sim-user-{user:02d}"
