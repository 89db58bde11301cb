"""Backpressure on chat (issue 42; docs/deploy.md, "Backpressure"): rate and concurrency limits per
API key, per tenant and for anonymous traffic, and a limit on the requests this replica's engine
holds, checked before anything is generated or logged.

A request over a limit is answered 429 in OpenAI's error shape (type ``rate_limit_error``, code
``rate_limit_exceeded``, or ``engine_queue_full`` for the engine's limit) with ``Retry-After``,
which the OpenAI SDKs, LiteLLM and LangChain honour before they retry. It is refused before
``ChatHandler.prepare``, so it has no trajectory, no prompt id and no dispatch: the learner never
sees it. Each refusal is counted in ``saoserve_requests_throttled_total{tenant, limit}`` (the
tenant from the key registry, ``-`` without a key) and in
``saoserve_requests_failed_before_generation_total{reason="throttled"}``.

The limits (``core.settings.Settings``):

- ``key_rate_limit`` and ``key_concurrency_limit``: each API key's own;
- ``tenant_limits``: a tenant's over all its keys together (a request passes both its key's and
  its tenant's);
- ``anonymous_rate_limit`` and ``anonymous_concurrency_limit``: every request without a key,
  together (one budget: behind a load balancer the client address says nothing);
- ``engine_queue_limit``: the chat requests this replica holds at once (generating or waiting for
  an engine slot), whoever sent them.

Rate limits are counted over a moving window by the ``limits`` library (``MovingWindowRateLimiter``
on its in-memory storage). Why ``limits``: it is the well-kept rate-limit library under
Flask-Limiter and slowapi, it parses the ``60/minute`` notation that operators know from them,
its moving window has no burst at a window's edge (a fixed window lets through twice the rate
across one), and its window statistics give the time at which the next request fits, which is
the ``Retry-After`` of a rate refusal. Its storages also reach Redis, the way to one budget over
several replicas; here each replica counts its own (docs/deploy.md). Concurrency is not what
``limits`` does (it counts hits, not leases): the slots are counted here, released when the
answer's last byte is sent or the client leaves (``Held``), and their ``Retry-After`` is
``busy_retry_after_s``, since no clock says when a request in flight ends.

Every check and every count runs in the event loop's thread without an await between them, so
two requests cannot both take the last slot.
"""

from __future__ import annotations

import enum
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from limits import RateLimitItem, parse_many
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from starlette.types import Receive, Scope, Send

from core.settings import Settings
from server.errors import ApiError

THROTTLED = "throttled"
"""The ``reason`` of a 429 in ``saoserve_requests_failed_before_generation_total``."""


class Limit(enum.StrEnum):
    """Which limit refused a request: the ``limit`` label of ``saoserve_requests_throttled_total``."""

    KEY_RATE = "key_rate"
    KEY_CONCURRENCY = "key_concurrency"
    TENANT_RATE = "tenant_rate"
    TENANT_CONCURRENCY = "tenant_concurrency"
    ANONYMOUS_RATE = "anonymous_rate"
    ANONYMOUS_CONCURRENCY = "anonymous_concurrency"
    ENGINE_QUEUE = "engine_queue"


class Throttled(ApiError):
    """A 429: ``limit`` refused the request; ``retry_after_s`` (whole seconds, at least 1) goes in
    ``Retry-After``. The OpenAI SDKs retry a 429 after that many seconds (up to their own cap)."""

    def __init__(self, limit: Limit, message: str, retry_after_s: int):
        code = "engine_queue_full" if limit is Limit.ENGINE_QUEUE else "rate_limit_exceeded"
        super().__init__(429, message, "rate_limit_error", code=code)
        self.limit, self.retry_after_s = limit, retry_after_s

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=429, headers={"Retry-After": str(self.retry_after_s)})


@dataclass(frozen=True)
class Budget:
    """One budget a request draws on: ``name`` (for the messages: ``API key k…``, ``tenant acme``,
    ``anonymous requests``), its ``slots`` key, its rate limits (``limits`` items, all of which
    must pass) and concurrency (0: none), and the ``Limit`` of each."""

    name: str
    key: str
    rates: tuple[RateLimitItem, ...]
    concurrency: int
    rate_limit: Limit
    concurrency_limit: Limit


def rate_items(text: str) -> tuple[RateLimitItem, ...]:
    """The ``limits`` items of a ``core.settings.RateLimit`` (empty: none)."""
    return tuple(parse_many(text)) if text else ()


class Lease:
    """The slots one admitted request holds; ``release`` (idempotent) gives them back."""

    def __init__(self, slots: Counter, keys: list[str]):
        self._slots, self._keys = slots, keys

    def release(self) -> None:
        for k in self._keys:
            self._slots[k] -= 1
            if self._slots[k] <= 0:
                del self._slots[k]
        self._keys = []

    def hold(self, response: Response) -> Response:
        """``response``, whose sending ends by releasing this lease (``Held``)."""
        return Held(response, self)


class Held(Response):
    """A response that releases its request's ``Lease`` once it has been sent, or once sending
    it failed or was cancelled (the client left a stream): the slot is held for as long as the
    engine works on the request, however the response ends."""

    def __init__(self, inner: Response, lease: Lease):
        self.inner, self.lease = inner, lease
        self.background = None
        self.status_code = inner.status_code

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # FastAPI hands its background tasks to the response it is given: this one.
        if self.inner.background is None:
            self.inner.background = self.background
        try:
            await self.inner(scope, receive, send)
        finally:
            self.lease.release()


class Backpressure:
    """The limits of one replica (module docstring), built from ``settings``; ``clock``
    (seconds, ``time.time``'s scale: the ``limits`` storage's) turns a window's reset time
    into ``Retry-After``."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time):
        self.settings, self.clock = settings, clock
        self.limiter = MovingWindowRateLimiter(MemoryStorage())
        self.slots: Counter = Counter()
        self.key_rates = rate_items(settings.key_rate_limit)
        self.anonymous_rates = rate_items(settings.anonymous_rate_limit)
        self.tenant_rates = {t: rate_items(lim.rate) for t, lim in settings.tenant_limits.items()}

    def scopes(self, key_id: str | None, tenant: str | None) -> list[Budget]:
        """The budgets a request from ``key_id`` of ``tenant`` (both None: anonymous) draws on."""
        st = self.settings
        if key_id is None:
            return [
                Budget(
                    "anonymous requests",
                    "anonymous",
                    self.anonymous_rates,
                    st.anonymous_concurrency_limit,
                    Limit.ANONYMOUS_RATE,
                    Limit.ANONYMOUS_CONCURRENCY,
                )
            ]
        out = [
            Budget(
                f"API key {key_id}",
                f"key:{key_id}",
                self.key_rates,
                st.key_concurrency_limit,
                Limit.KEY_RATE,
                Limit.KEY_CONCURRENCY,
            )
        ]
        if tenant in st.tenant_limits:
            out.append(
                Budget(
                    f"tenant {tenant}",
                    f"tenant:{tenant}",
                    self.tenant_rates[tenant],
                    st.tenant_limits[tenant].concurrency,
                    Limit.TENANT_RATE,
                    Limit.TENANT_CONCURRENCY,
                )
            )
        return out

    def admit(self, key_id: str | None, tenant: str | None) -> Lease:
        """Take a slot in every budget of the request (``scopes``) and in the engine's queue, and
        count it in every rate limit; the ``Lease`` gives the slots back.

        Checked in this order, nothing taken unless all pass: each budget's concurrency, the
        engine's queue, each budget's rates. So a request refused for concurrency uses up none
        of its rate, and a rate refusal holds no slot.

        Raises:
            Throttled: the first limit the request does not fit, with its Retry-After: for a rate
                limit, the seconds until its moving window lets one more through (rounded up, at
                least 1); for concurrency and the engine's queue, ``busy_retry_after_s``.
        """
        st = self.settings
        scopes = self.scopes(key_id, tenant)
        busy = st.busy_retry_after_s
        for s in scopes:
            if s.concurrency and self.slots[s.key] >= s.concurrency:
                raise Throttled(
                    s.concurrency_limit,
                    f"{s.name} has {self.slots[s.key]} chat requests in flight, its limit: retry "
                    "once one has been answered",
                    busy,
                )
        if st.engine_queue_limit and self.slots["engine"] >= st.engine_queue_limit:
            raise Throttled(
                Limit.ENGINE_QUEUE,
                f"the engine holds {self.slots['engine']} chat requests, its limit on this server: "
                "retry shortly",
                busy,
            )
        for s in scopes:
            for item in s.rates:
                if not self.limiter.test(item, s.key):
                    raise Throttled(
                        s.rate_limit,
                        f"{s.name} is over its rate limit of {item.amount} requests per "
                        f"{describe_window(item)}: retry after the Retry-After header's seconds",
                        self.retry_after_s(item, s.key),
                    )
        for s in scopes:
            for item in s.rates:
                self.limiter.hit(item, s.key)
        keys = [s.key for s in scopes if s.concurrency] + (["engine"] if st.engine_queue_limit else [])
        for k in keys:
            self.slots[k] += 1
        return Lease(self.slots, keys)

    def retry_after_s(self, item: RateLimitItem, key: str) -> int:
        """Whole seconds until ``item``'s moving window for ``key`` frees a request: the oldest
        request in the window leaves it one window after it came (``limits``' reset time)."""
        reset = self.limiter.get_window_stats(item, key).reset_time
        return max(1, math.ceil(reset - self.clock()))

    def in_flight(self, key: str) -> int:
        """Slots held now under ``key`` (``key:<id>``, ``tenant:<name>``, ``anonymous``, ``engine``)."""
        return self.slots[key]


def describe_window(item: RateLimitItem) -> str:
    """``item``'s window as a message says it: ``minute``, ``10 seconds``."""
    unit = item.GRANULARITY.name
    return unit if item.multiples == 1 else f"{item.multiples} {unit}s"
