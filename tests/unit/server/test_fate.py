"""``server.fate.Fate``: each outcome of a chat request writes exactly one record, frees its
episode turn once when the client got no answer (aborted, failed, not recorded), counts its
metrics, and a second settlement is refused. A fake state stands in for ``ServerState`` (no log,
database or engine)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from core.logbus import LogUnavailable
from server.chat.serving import ChatStream
from server.fate import Fate
from testing.builders import rollout
from testing.fakes import FakeState


async def test_an_answer_is_written_once_and_counted_ok():
    s = FakeState()
    fate = Fate(s, rollout(), stream=False)
    rec = await fate.answered()
    await s.drained()
    assert [r.finish_reason for r in s.persisted] == ["stop"] and s.persisted == [rec]
    # 2 tokens, all at version 3: one run (3, 2).
    assert rec.response_token_ids == [5, 6] and rec.token_versions == [(3, 2)]
    assert s.released == []
    assert (s.count("false", "ok"), s.latencies()) == (1, 1)
    assert fate.outcome == "ok"


async def test_an_answer_the_log_refuses_frees_the_turn_and_raises():
    s = FakeState(refuse=LogUnavailable("log down"))
    fate = Fate(s, rollout(), stream=True)
    with pytest.raises(LogUnavailable):
        await fate.answered()
    await s.drained()
    assert (s.persisted, s.released) == ([], ["chatcmpl-1"])
    assert (s.count("true", "log_unavailable"), s.count("true", "ok"), s.latencies()) == (1, 0, 0)


async def test_another_write_failure_propagates_uncounted_and_keeps_the_turn():
    # The record may be in the log (logged, not indexed): the turn is not the client's to resend.
    s = FakeState(refuse=RuntimeError("index"))
    fate = Fate(s, rollout(), stream=False)
    with pytest.raises(RuntimeError, match="index"):
        await fate.answered()
    await s.drained()
    assert (s.persisted, s.released) == ([], [])
    assert (s.count("false", "ok"), s.count("false", "log_unavailable")) == (0, 0)
    assert fate.settled


async def test_an_abort_frees_the_turn_then_writes_the_tokens_so_far():
    # The client got no answer: it may send the turn again, and need not wait for the log.
    s = FakeState()
    Fate(s, rollout(tokens=2), stream=True).aborted()
    await s.drained()
    assert [(r.finish_reason, r.response_token_ids) for r in s.persisted] == [("abort", [5, 6])]
    assert s.released == ["chatcmpl-1"] and s.order == ["release", "persist"]
    assert s.count("true", "aborted") == 1


async def test_an_abort_outside_an_episode_frees_nothing():
    s = FakeState()
    Fate(s, rollout(tokens=2, episode=None), stream=False).aborted()
    await s.drained()
    assert ([r.finish_reason for r in s.persisted], s.released) == (["abort"], [])


async def test_an_abort_before_any_token_is_still_one_record():
    s = FakeState()
    Fate(s, rollout(tokens=0), stream=True).aborted()
    await s.drained()
    assert [(r.finish_reason, r.response_token_ids, r.token_versions) for r in s.persisted] == [
        ("abort", [], [])
    ]
    assert s.released == ["chatcmpl-1"]


async def test_an_engine_error_after_tokens_frees_the_turn_and_writes_an_error_record():
    s = FakeState()
    Fate(s, rollout(tokens=2), stream=False).failed()
    await s.drained()
    assert [r.finish_reason for r in s.persisted] == ["error"] and s.released == ["chatcmpl-1"]
    assert s.order == ["release", "persist"]
    assert (s.count("false", "engine_error"), s.refused_before_generation()) == (1, 0)


async def test_an_engine_error_before_any_token_frees_the_turn():
    s = FakeState()
    Fate(s, rollout(tokens=0), stream=True).failed()
    await s.drained()
    assert (s.persisted, s.released) == ([], ["chatcmpl-1"])
    assert (s.count("true", "engine_error"), s.refused_before_generation()) == (1, 1)


async def test_an_engine_error_before_any_token_outside_an_episode_writes_nothing():
    s = FakeState()
    Fate(s, rollout(tokens=0, episode=None), stream=False).failed()
    await s.drained()
    assert (s.persisted, s.released) == ([], [])
    assert (s.count("false", "engine_error"), s.refused_before_generation()) == (1, 1)


async def test_a_background_write_the_log_refuses_is_logged_and_the_turn_freed_once(caplog):
    s = FakeState(refuse=LogUnavailable("log down"))
    with caplog.at_level(logging.ERROR, logger="server.fate"):
        Fate(s, rollout(tokens=2), stream=True).aborted()
        await s.drained()
    assert (s.persisted, s.released) == ([], ["chatcmpl-1"])
    assert "could not persist trajectory chatcmpl-1" in caplog.text


@pytest.mark.parametrize("first", ["answered", "aborted", "failed"])
@pytest.mark.parametrize("second", ["answered", "aborted", "failed"])
async def test_a_second_settlement_is_refused_and_changes_nothing(first, second):
    s = FakeState()
    fate = Fate(s, rollout(), stream=False)

    async def settle(how: str) -> None:
        if how == "answered":
            await fate.answered()
        else:
            getattr(fate, how)()

    await settle(first)
    outcome = fate.outcome
    with pytest.raises(RuntimeError, match="chatcmpl-1 settled twice"):
        await settle(second)
    await s.drained()
    # One record (a whole answer, an abort or an error: 2 tokens were sampled), one count; the
    # turn freed once, unless the client got its answer.
    assert len(s.persisted) == 1 and s.released == ([] if first == "answered" else ["chatcmpl-1"])
    assert fate.outcome == outcome
    assert sum(s.count("false", o) for o in ("ok", "aborted", "engine_error", "log_unavailable")) == 1


async def test_leaving_unsettled_is_logged_and_recorded_as_aborted(caplog):
    s = FakeState()
    fate = Fate(s, rollout(tokens=1), stream=False)
    with caplog.at_level(logging.WARNING, logger="server.fate"):
        fate.left()
    await s.drained()
    assert "chat request chatcmpl-1 ended unsettled" in caplog.text
    assert [r.finish_reason for r in s.persisted] == ["abort"] and fate.outcome == "aborted"


async def test_leaving_settled_changes_nothing():
    s = FakeState()
    fate = Fate(s, rollout(), stream=False)
    await fate.answered()
    fate.left()
    await s.drained()
    assert len(s.persisted) == 1 and s.count("false", "aborted") == 0


async def test_a_stream_whose_client_left_before_its_first_chunk_is_recorded():
    # The client disconnects before the response starts: Starlette cancels the stream before
    # the generator runs a line, so only ChatStream's end can settle it.
    s = FakeState()
    fate = Fate(s, rollout(tokens=0), stream=True)
    began = []

    async def events():
        began.append(True)
        yield "data: [DONE]\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.Event().wait()  # the client never reads

    await ChatStream(fate, events(), headers={})({"type": "http", "asgi": {}}, receive, send)
    await s.drained()
    assert began == []
    assert [(r.finish_reason, r.response_token_ids) for r in s.persisted] == [("abort", [])]
    assert s.count("true", "aborted") == 1
