"""server.backpressure's limits on a clock of the test's (issue 42): hand-worked admissions and
refusals with their Retry-After, and the settings' error cases."""

from __future__ import annotations

import types

import limits.storage.memory
import pytest
from pydantic import ValidationError

from core.settings import Settings, TenantLimit
from server.backpressure import Backpressure, Limit, Throttled, describe_window, rate_items


class Clock:
    """Seconds since the epoch, moved by the test; ``limits``' memory storage reads it too."""

    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock(1000.0)
    monkeypatch.setattr(limits.storage.memory, "time", types.SimpleNamespace(time=c))
    return c


def settings(**kw) -> Settings:
    return Settings(**({"engine_queue_limit": 0} | kw))


def refusal(bp: Backpressure, key: str | None, tenant: str | None = None) -> tuple[Limit, int, str]:
    with pytest.raises(Throttled) as info:
        bp.admit(key, tenant)
    e = info.value
    assert (e.status, e.type) == (429, "rate_limit_error")
    return e.limit, e.retry_after_s, e.code


def test_a_keys_rate_over_a_moving_minute(clock):
    bp = Backpressure(settings(key_rate_limit="3/minute"), clock)
    for t in (1000.0, 1010.0, 1020.0):
        clock.t = t
        bp.admit("kA", "acme")
    clock.t = 1030.0
    # The window's oldest request came at 1000 s: it leaves the minute at 1060 s, 30 s from now.
    assert refusal(bp, "kA", "acme") == (Limit.KEY_RATE, 30, "rate_limit_exceeded")
    bp.admit("kB", "acme")  # another key of the same tenant has its own budget
    clock.t = 1059.2
    assert refusal(bp, "kA", "acme")[:2] == (Limit.KEY_RATE, 1)  # ceil(1060 - 1059.2) = 1
    clock.t = 1060.5  # 1000 s is out of the window; 1010 and 1020 s are in: one more fits
    bp.admit("kA", "acme")
    # Window now 1010, 1020, 1060.5: the next frees at 1010 + 60 = 1070 s, 9.5 s away → 10.
    assert refusal(bp, "kA", "acme")[:2] == (Limit.KEY_RATE, 10)


def test_two_rates_at_once_the_tighter_refuses(clock):
    bp = Backpressure(settings(key_rate_limit="2/second;3/minute"), clock)
    bp.admit("k", None)
    bp.admit("k", None)
    assert refusal(bp, "k")[:2] == (Limit.KEY_RATE, 1)  # 2 in this second: the first frees at 1001
    clock.t = 1001.5
    bp.admit("k", None)
    # 3 in the minute since 1000 s: the first leaves it at 1060 s → 58.5 s → 59.
    assert refusal(bp, "k")[:2] == (Limit.KEY_RATE, 59)


def test_a_keys_concurrency_frees_when_a_lease_is_released(clock):
    bp = Backpressure(settings(key_concurrency_limit=2, busy_retry_after_s=3), clock)
    a1, a2 = bp.admit("kA", None), bp.admit("kA", None)
    assert refusal(bp, "kA") == (Limit.KEY_CONCURRENCY, 3, "rate_limit_exceeded")
    assert bp.in_flight("key:kA") == 2
    bp.admit("kB", None).release()  # kB has its own two slots
    a1.release()
    a1.release()  # idempotent: the slot is given back once
    assert bp.in_flight("key:kA") == 1
    bp.admit("kA", None)
    assert refusal(bp, "kA")[0] is Limit.KEY_CONCURRENCY
    a2.release()


def test_a_tenants_limit_is_over_all_its_keys(clock):
    st = settings(key_concurrency_limit=2, tenant_limits={"acme": {"concurrency": 3}})
    bp = Backpressure(st, clock)
    bp.admit("k1", "acme"), bp.admit("k1", "acme")
    bp.admit("k2", "acme")  # 3 of acme's 3
    # k2 holds 1 of its 2 slots, but its tenant holds all 3 of its own.
    assert refusal(bp, "k2", "acme")[0] is Limit.TENANT_CONCURRENCY
    bp.admit("k3", "beta")  # a tenant without tenant limits: its key's alone


def test_a_tenants_rate(clock):
    bp = Backpressure(settings(tenant_limits={"acme": TenantLimit(rate="2/minute")}), clock)
    bp.admit("k1", "acme")
    clock.t = 1012.0
    bp.admit("k2", "acme")
    clock.t = 1015.0
    assert refusal(bp, "k3", "acme")[:2] == (Limit.TENANT_RATE, 45)  # 1000 + 60 - 1015


def test_anonymous_requests_share_one_budget(clock):
    bp = Backpressure(settings(anonymous_rate_limit="2/second", anonymous_concurrency_limit=5), clock)
    bp.admit(None, None), bp.admit(None, None)
    assert refusal(bp, None)[:2] == (Limit.ANONYMOUS_RATE, 1)
    assert bp.in_flight("anonymous") == 2  # the refused request holds no slot
    bp.admit("k", "acme")  # a key does not draw on the anonymous budget


def test_the_engine_queue_is_over_every_sender(clock):
    bp = Backpressure(settings(engine_queue_limit=3, busy_retry_after_s=2), clock)
    leases = [bp.admit("k1", None), bp.admit("k2", None), bp.admit(None, None)]
    assert refusal(bp, "k4") == (Limit.ENGINE_QUEUE, 2, "engine_queue_full")
    leases[0].release()
    bp.admit("k4", None)
    assert bp.in_flight("engine") == 3


def test_a_concurrency_refusal_uses_none_of_the_rate(clock):
    bp = Backpressure(settings(key_rate_limit="2/minute", key_concurrency_limit=1), clock)
    first = bp.admit("k", None)  # rate: 1 of 2
    assert refusal(bp, "k")[0] is Limit.KEY_CONCURRENCY  # not counted in the rate
    first.release()
    bp.admit("k", None).release()  # rate: 2 of 2
    assert refusal(bp, "k")[:2] == (Limit.KEY_RATE, 60)  # the first left at 1000 + 60
    assert bp.in_flight("key:k") == 0


def test_no_limits_admit_everything(clock):
    bp = Backpressure(settings(), clock)
    leases = [bp.admit(k, None) for k in ("a", "a", None, None)]
    assert bp.slots == {}  # nothing counted where nothing is limited
    for lease in leases:
        lease.release()


def test_the_429_answer_has_retry_after_and_the_openai_shape():
    r = Throttled(Limit.KEY_RATE, "API key k is over its rate limit", 7).response()
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    assert "x-should-retry" not in r.headers  # the SDKs retry a 429
    assert r.body == (
        b'{"error":{"message":"API key k is over its rate limit","type":"rate_limit_error",'
        b'"param":null,"code":"rate_limit_exceeded"}}'
    )


def test_windows_in_messages():
    assert [describe_window(i) for i in rate_items("5/minute;7/2 seconds")] == ["minute", "2 seconds"]
    assert rate_items("") == ()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"key_rate_limit": "3 per fortnight"}, "is not a rate limit"),
        ({"anonymous_rate_limit": "many"}, "is not a rate limit"),
        ({"key_concurrency_limit": -1}, "greater than or equal to 0"),
        ({"engine_queue_limit": -1}, "greater than or equal to 0"),
        ({"busy_retry_after_s": 0}, "greater than or equal to 1"),
        ({"tenant_limits": {"Not A Tenant": {}}}, "is not a valid name"),
        ({"tenant_limits": {"acme": {"rat": "1/second"}}}, "Extra inputs are not permitted"),
        ({"tenant_limits": {"acme": {"rate": "fast"}}}, "is not a rate limit"),
        ({"tenant_limits": '{"acme": '}, "tenant_limits is not JSON"),
    ],
)
def test_bad_limit_settings_are_refused(kw, message):
    with pytest.raises(ValidationError, match=message):
        Settings(**kw)


def test_limit_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("SAOSERVE_TENANT_LIMITS", '{"acme": {"rate": "600/minute", "concurrency": 16}}')
    monkeypatch.setenv("SAOSERVE_KEY_RATE_LIMIT", " 60/minute ")
    st = Settings()
    assert st.tenant_limits == {"acme": TenantLimit(rate="600/minute", concurrency=16)}
    assert st.key_rate_limit == "60/minute"
    assert Settings(tenant_limits="").tenant_limits == {}
