"""The asynchronous simulation (issue 10): traffic options, pacing, streamed answers, a tenant's
run (a few versions end to end against the real server and learner:
tests/integration/test_simulate_async.py; the arithmetic over its records:
tests/unit/judge/test_runstats.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from judge.base import Judgement
from judge.pacing import pace_gap
from judge.sim_config import SimulationConfig
from judge.simulate import Simulation
from judge.styles import schedule_from_spec, writing_requests
from testing.judge import SCHEDULE


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"mode": "lockstep"}, "unknown mode"),
        ({"rate": 0.0}, "rate must be > 0"),
        ({"feedback_delay_s": -1.0}, "feedback_delay_s"),
        ({"prompt_pool": 0}, "prompt_pool"),
        ({"pace": True}, "pace applies to async mode"),
        ({"pace": True, "mode": "async", "rate": 1.0}, "not with a rate"),
    ],
)
def test_config_errors(fields, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        SimulationConfig(base_url="http://127.0.0.1:9", schedule=SCHEDULE, **fields)


class _NoJudge:
    def judge_many(self, items):
        raise AssertionError("not called")


async def test_prompt_pool_cycles_in_order() -> None:
    cfg = SimulationConfig(base_url="http://127.0.0.1:9", schedule=SCHEDULE, prompt_pool=3)
    sim = Simulation(cfg, _NoJudge())
    assert len(sim.requests) == 3
    # Round robin 0, 1, 2, 0, ...; a prompt in flight is skipped and the cycle goes on after it.
    assert [(await sim._pick(None, 1))[0] for _ in range(4)] == [0, 1, 2, 0]
    sim.in_flight.add(1)
    assert await sim._pick(None, 2) == [2, 0]
    assert await sim._pick(None, 1) == [2]


def test_pace_gap_by_hand() -> None:
    # Versions 1..5 seen at 10, 30, 52, 70, 100 s: periods 20, 22, 18, 30; the last 3 are 22,
    # 18, 30 with median 22 s, so at batch 8 the gap is 0.9 × 22 / 8 = 2.475 s.
    assert pace_gap([(10.0, 1), (30.0, 2), (52.0, 3), (70.0, 4), (100.0, 5)], 8) == pytest.approx(2.475)
    assert pace_gap([(0.0, 1), (20.0, 2)], 16) == pytest.approx(0.9 * 20 / 16)  # one period: 1.125 s
    # A poll that missed version 2: v1 at 13 s, v3 at 39 s is two periods of 13 s, not one of
    # 26 s: 0.9 × 13 / 8 = 1.4625 s.
    assert pace_gap([(13.0, 1), (39.0, 3)], 8) == pytest.approx(1.4625)
    assert pace_gap([], 8) is None and pace_gap([(5.0, 1)], 8) is None  # no interval yet: unpaced
    with pytest.raises(ValueError, match="batch_size"):
        pace_gap([(0.0, 1), (1.0, 2)], 0)
    with pytest.raises(ValueError, match="versions must increase"):
        pace_gap([(0.0, 2), (1.0, 2)], 8)


async def test_pacing_spaces_admissions(monkeypatch) -> None:
    """Admissions take slots a gap apart; none once the schedule's last version serves."""
    cfg = SimulationConfig(
        base_url="http://127.0.0.1:9", schedule=SCHEDULE, mode="async", pace=True, batch_size=8
    )
    sim = Simulation(cfg, _NoJudge())
    sim._version_seen_at = [(0.0, 1), (10.0, 2), (20.0, 3)]  # period 10 s: gap 0.9 × 10 / 8 = 1.125 s
    clock, slept = [20.0], []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(sim, "_now", lambda: clock[0])
    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    for _ in range(3):
        await sim._admit()
    assert slept == [pytest.approx(1.125), pytest.approx(2.25)]  # slots 20, 21.125, 22.25
    clock[0] = 30.0  # past the reserved slots: the next one goes at once
    await sim._admit()
    assert len(slept) == 2
    sim._version_now = SCHEDULE.total_steps - 1  # the last version serves: never paced
    for _ in range(3):
        await sim._admit()
    assert len(slept) == 2


def test_compare_seeds_and_traffic_reach_the_runs(monkeypatch, tmp_path) -> None:
    """compare --seeds 2 runs each method per seed, interleaved, with the async traffic options;
    the async defaults fill what is not given (8 in flight, a backlog cap of 2 batches, not paced)."""
    from typer.testing import CliRunner

    import saoserve.demo
    import saoserve.model
    from judge.sim_result import SimulationResult
    from saoserve.cli import app

    seen: list[tuple[str, str, int, dict]] = []

    def fake_run_method(method, schedule, judge, out, **kw):
        seen.append((method, kw["name"], kw["seed"], kw["traffic"]))
        return SimulationResult()

    monkeypatch.setattr(saoserve.demo, "run_method", fake_run_method)
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    args = ["compare", "--out", str(tmp_path / "r"), "--schedule", "cute:1", "--batch-size", "4"]
    result = CliRunner().invoke(
        app, [*args, "--seeds", "2", "--seed", "5", "--feedback-delay-s", "1.5", "--prompt-pool", "12"]
    )
    assert result.exit_code == 2 and "no step completed" in result.output
    traffic = {
        "mode": "async",
        "concurrency": 8,
        "feedback_delay_s": 1.5,
        "max_backlog": 8,  # 2 batches of 4
        "prompt_pool": 12,
        "pace": False,
    }
    assert seen == [
        ("sao", "sao-s5", 5, traffic),
        ("running_mean", "running_mean-s5", 5, traffic),
        ("sao", "sao-s6", 6, traffic),
        ("running_mean", "running_mean-s6", 6, traffic),
    ]
    seen.clear()
    result = CliRunner().invoke(
        app, ["demo", "--out", str(tmp_path / "d"), "--schedule", "cute:1", "--mode", "sync"]
    )
    # Lockstep: a step's 16 requests in one batch, as before.
    assert seen == [
        ("sao", "sao", 0, {"mode": "sync", "concurrency": 16, "feedback_delay_s": 0.0, "pace": False})
    ]
    seen.clear()
    result = CliRunner().invoke(
        app, ["demo", "--out", str(tmp_path / "e"), "--schedule", "cute:1", "--rate", "0.5"]
    )
    # A rate sets the arrivals: no pacing by default.
    assert seen[0][3]["pace"] is False and seen[0][3]["rate"] == 0.5


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--mode", "lockstep"], "unknown mode 'lockstep'"),
        (["--mode", "sync", "--rate", "2"], "apply to --mode async"),
        (["--mode", "sync", "--feedback-delay-s", "3"], "apply to --mode async"),
        (["--mode", "async", "--rate", "0"], "--rate must be > 0"),
        (["--mode", "sync", "--pace"], "--pace applies to --mode async"),
        (["--mode", "async", "--rate", "1", "--pace"], "not with --rate"),
    ],
)
def test_traffic_option_errors(args, needle) -> None:
    from typer.testing import CliRunner

    from saoserve.cli import app

    result = CliRunner().invoke(app, ["simulate", "--schedule", "cute:1", *args])
    assert result.exit_code == 2 and needle in result.output, result.output


async def test_a_paced_request_waits_again_if_the_cap_binds_by_its_slot(monkeypatch) -> None:
    """Slots given out before the cap bound must not overshoot it: after its slot, a request
    held by the cap waits for the cap and then for a fresh slot."""
    cfg = SimulationConfig(
        base_url="http://127.0.0.1:9", schedule=SCHEDULE, mode="async", pace=True, batch_size=8, max_backlog=4
    )
    sim = Simulation(cfg, _NoJudge())
    sim._version_seen_at = [(0.0, 1), (8.0, 2)]  # gap 0.9 × 8 / 8 = 0.9 s
    clock, slept = [8.0], []

    async def fake_sleep(s: float) -> None:
        slept.append(round(s, 6))
        if len(slept) == 1:  # during the slot's sleep, the answers in flight reach the cap
            sim._outstanding = 4
        elif s == 0.2:  # a cap poll: the learner publishes, the backlog drains
            sim._outstanding = 0
        clock[0] += s

    monkeypatch.setattr(sim, "_now", lambda: clock[0])
    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    sim._next_slot = 8.9  # a slot was given out at 8.0
    sim._outstanding = 3  # below max_backlog 4: admitted to the slot queue
    await sim._admit()
    # Slot at 8.9 (sleep 0.9); the cap holds: one 0.2 s poll drains it (9.1); the next slot,
    # 9.8, is 0.7 s later; then free.
    assert slept == [0.9, 0.2, 0.7]
    assert sim.result.held_s == pytest.approx(0.2)


def _sse(*chunks: object) -> bytes:
    """SSE as server.chat.serving.sse writes it (ensure_ascii=False)."""
    return b"".join(
        f"data: {c if isinstance(c, str) else json.dumps(c, ensure_ascii=False)}\n\n".encode() for c in chunks
    )


async def test_streamed_answer_is_assembled_with_its_first_token_time(monkeypatch) -> None:
    """The async simulation streams: text from the deltas, the id, version and feedback token
    from the finish chunk, and the run-clock time of the first chunk with text."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}
    finish = {
        **base,
        "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}],
        "policy_version": 3,
        "prompt_id": "sim-0000",
        "feedback_token": "tok",
    }
    stream = _sse(
        {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
        {**base, "choices": [{"index": 0, "delta": {"content": "Ahoy"}, "finish_reason": None}]},
        # The server's JSON keeps U+2028 raw: it must not split the SSE line.
        {**base, "choices": [{"index": 0, "delta": {"content": " mat\u2028ey"}, "finish_reason": None}]},
        finish,
        "[DONE]",
    )
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    cfg = SimulationConfig(base_url="http://sim", schedule=SCHEDULE, mode="async", max_tokens=5)
    sim = Simulation(cfg, _NoJudge())
    ticks = iter([1.5, 2.5, 3.5])
    monkeypatch.setattr(sim, "_now", lambda: next(ticks))
    async with httpx.AsyncClient(base_url="http://sim", transport=httpx.MockTransport(handler)) as http:
        body, first = await sim._ask_streaming(http, 0)
    assert (
        seen[0]["stream"] is True and seen[0]["max_tokens"] == 5 and seen[0]["prompt_id"] == sim._prompt_id(0)
    )
    assert first == 1.5  # the clock read once, at "Ahoy" (the role chunk has no text)
    assert body == {
        "id": "chatcmpl-1",
        "policy_version": 3,
        "feedback_token": "tok",
        "choices": [
            {"message": {"role": "assistant", "content": "Ahoy mat\u2028ey!"}, "finish_reason": "length"}
        ],
    }
    assert sim.result.request_failures == 0


@pytest.mark.parametrize(
    ("status", "content"),
    [
        (503, b'{"error": {"message": "storage unavailable"}}'),
        (200, _sse({"error": {"message": "trajectory log unavailable"}})),
        (
            200,
            _sse({"id": "x", "choices": [{"index": 0, "delta": {"content": "cut"}, "finish_reason": None}]}),
        ),
    ],
    ids=["status-503", "error-chunk", "no-finish-chunk"],
)
async def test_a_failed_stream_counts_as_a_request_failure(status, content) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=content)

    sim = Simulation(SimulationConfig(base_url="http://sim", schedule=SCHEDULE, mode="async"), _NoJudge())
    async with httpx.AsyncClient(base_url="http://sim", transport=httpx.MockTransport(handler)) as http:
        assert await sim._ask_streaming(http, 0) == (None, None)
    assert sim.result.request_failures == 1


class _DroppedStream(httpx.AsyncByteStream):
    """One text chunk, then the connection drops (what a server that dies mid-answer does)."""

    async def __aiter__(self):
        yield _sse(
            {"id": "x", "choices": [{"index": 0, "delta": {"content": "Ahoy"}, "finish_reason": None}]}
        )
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


async def test_a_dropped_stream_is_a_failure_and_the_worker_goes_on(monkeypatch) -> None:
    """A transport error mid-stream is one counted failure; the worker backs off and keeps sending."""
    monkeypatch.setattr("judge.sim_openloop.FAILURE_BACKOFF_S", 0.01)
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(200, stream=_DroppedStream())

    cfg = SimulationConfig(base_url="http://sim", schedule=SCHEDULE, mode="async", concurrency=1)
    sim = Simulation(cfg, _NoJudge())
    async with httpx.AsyncClient(base_url="http://sim", transport=httpx.MockTransport(handler)) as http:
        assert await sim._ask_streaming(http, 0) == (None, None)
        worker = asyncio.create_task(sim._worker(http, set()))
        while len(calls) < 4:
            await asyncio.sleep(0.01)
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    assert sim.result.request_failures >= 4 and sim.result.records == []
    assert sim._outstanding == 0 and sim._requests_open == 0


class _OneJudge:
    """Judges every answer pirate (reward 1 when pirate is the target)."""

    def judge_many(self, items):
        return [
            Judgement(quality=1, style="pirate", style_score=1.0, scores={"pirate": 1.0}, target_style=t)
            for _, _, t in items
        ]


@pytest.mark.parametrize("fails_at", ["/v1/chat/completions", "/v1/feedback"])
async def test_a_lockstep_transport_error_is_one_failed_request(fails_at) -> None:
    """In sync mode a timeout or a dropped connection, at the answer or at the feedback, is one
    counted failure and no record, not an exception that ends the step's gather."""
    answer = {
        "id": "chatcmpl-1",
        "policy_version": 0,
        "feedback_token": "tok",
        "choices": [{"message": {"role": "assistant", "content": "Ahoy"}, "finish_reason": "stop"}],
    }

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == fails_at:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json=answer)

    sim = Simulation(SimulationConfig(base_url="http://sim", schedule=SCHEDULE), _OneJudge())
    async with httpx.AsyncClient(base_url="http://sim", transport=httpx.MockTransport(handler)) as http:
        assert await sim._one(http, asyncio.Semaphore(1), 0, 0, "pirate") is None
    assert sim.result.request_failures == 1 and sim.in_flight == set()


# ------------------------------------------------------------------ a tenant's run: keys and policy
class _KeyedServer:
    """A server double for every route a run calls; it records each request's path, bearer
    (None without an ``Authorization`` header) and query."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, dict[str, str]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.seen.append((path, request.headers.get("authorization"), dict(request.url.params)))
        answer = {
            "id": "chatcmpl-1",
            "policy_version": 0,
            "prompt_id": "sim-0000",
            "feedback_token": "tok",
        }
        if path == "/v1/chat/completions" and json.loads(request.content).get("stream"):
            finish = answer | {
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": "Ahoy"}, "finish_reason": "stop"}],
            }
            return httpx.Response(
                200, content=_sse(finish, "[DONE]"), headers={"content-type": "text/event-stream"}
            )
        bodies = {
            "/v1/chat/completions": answer
            | {"choices": [{"message": {"role": "assistant", "content": "Ahoy"}, "finish_reason": "stop"}]},
            "/v1/models": {"data": [{"policy_version": 0}]},
            "/admin/trajectories/chatcmpl-1": {"token_versions": [[0, 0]], "arm": None},
            "/admin/evidence": {"prompts": []},
            "/admin/learner": {"steps": []},
            "/admin/lifecycle": {"events": []},
            "/dashboard/state": {"guard": {"verdict": None}},
        }
        if path == "/v1/feedback":
            return httpx.Response(202, json={"accepted": True})
        return httpx.Response(200, json=bodies[path])


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("keyed", [True, False], ids=["tenant", "plain"])
async def test_a_tenant_run_sends_its_key_to_the_api_and_its_policy_to_the_admin_routes(
    monkeypatch, mode, keyed
) -> None:
    """With ``api_key`` and ``policy``: chat, feedback and the model list carry the API key; every
    ``/admin`` read carries the admin key and ``policy=acme``; ``/dashboard/state`` no key and
    the policy.
    Without them, as before: no bearer on the API routes and no ``policy`` anywhere."""
    server = _KeyedServer()
    real = httpx.AsyncClient
    monkeypatch.setattr(
        "judge.simulate.httpx.AsyncClient", lambda **kw: real(transport=httpx.MockTransport(server), **kw)
    )
    tenant = {"api_key": "sao-kacme.secret", "policy": "acme"} if keyed else {}
    cfg = SimulationConfig(
        base_url="http://sim",
        schedule=schedule_from_spec("pirate:1"),
        batch_size=2,
        concurrency=1,
        mode=mode,
        max_seconds=0.3,
        uncertainty_sampler=True,
        admin_key="adm",
        **tenant,
    )
    result = await Simulation(cfg, _OneJudge()).run()
    assert result.records and result.request_failures == 0
    paths = {p for p, _, _ in server.seen}
    # Both modes: the sampler's evidence read, models, chat, feedback, and the learner's steps and
    # the lifecycle at the end; async also reads each answer's spans; the last verdict is the
    # dashboard's (of the run's policy).
    spans = {"/admin/trajectories/chatcmpl-1"} if mode == "async" else set()
    assert paths == spans | {
        "/dashboard/state",
        "/admin/evidence",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/feedback",
        "/admin/learner",
        "/admin/lifecycle",
    }
    assert result.lifecycle is not None and result.lifecycle["last_verdict"] is None
    for path, auth, params in server.seen:
        if path.startswith("/v1/"):
            assert (auth, "policy" in params) == ("Bearer sao-kacme.secret" if keyed else None, False), path
        elif path.startswith("/admin/"):
            assert (auth, params.get("policy")) == ("Bearer adm", "acme" if keyed else None), path
        else:
            assert (auth, params) == (None, {"policy": "acme"} if keyed else {}), path
    # The reads keep their own parameters beside the policy.
    learner = next(params for p, _, params in server.seen if p == "/admin/learner")
    assert learner == {"limit": "1000"} | ({"policy": "acme"} if keyed else {})
    evidence = next(params for p, _, params in server.seen if p == "/admin/evidence")
    assert evidence["top"] == str(len(writing_requests()))


@pytest.mark.parametrize(
    ("card", "expected"),
    [({"policy_version": 7, "policy": "acme", "version": 2}, 2), ({"policy_version": 7}, 7)],
    ids=["per-tenant-card", "global-card"],
)
async def test_the_served_version_is_the_key_policys(card, expected) -> None:
    """A server with a policy per tenant lists the key's policy's ``version`` beside
    ``policy_version``; the run follows the former, and the latter where there is no other."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"object": "list", "data": [card]})

    sim = Simulation(
        SimulationConfig(base_url="http://sim", schedule=SCHEDULE, api_key="sao-k1.x"), _NoJudge()
    )
    async with httpx.AsyncClient(base_url="http://sim", transport=httpx.MockTransport(handler)) as http:
        assert await sim._version(http) == expected


@pytest.mark.parametrize("policy", ["Acme", "", "-acme", "a" * 65])
def test_a_policy_that_is_not_a_tenant_name_is_refused(policy) -> None:
    with pytest.raises(ValueError, match="is not a valid name"):
        SimulationConfig(base_url="http://sim", schedule=SCHEDULE, policy=policy)
