"""An episode turn whose client left mid-answer (``server.fate.Fate.aborted``) frees its turn
number: the client sends the turn again, rates the episode, and the learner trains one sample
made of the retried turn; the aborted record is logged once and is no turn of the episode.

The real app under uvicorn on SQLite with a scripted engine (no vLLM engine), then the
learner's join and one step of the tiny random Llama (testing/learner.py) on the same
database and SQL-table log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field

import httpx
import pytest
from sqlalchemy import func, select

from core.db import LearnerSample, LogRecord, TrajectoryIndex, make_engine
from core.logbus import SqlLog
from core.records import TOPIC_TRAJECTORIES, utcnow
from learner.data.joiner import Joiner
from server.engine import GenerationDelta
from server.errors import ApiError
from server.feedback.serving import accept_feedback
from server.store import plan_turn
from testing.builders import record
from testing.edges import episode_token, feedback, feedback_state
from testing.fakes import TIMEOUT_S, ScriptedEngine
from testing.learner import in_process, run_until, trained_ids, wait_for
from testing.servers import ADMIN, make_settings, running_server

USER = {"role": "user", "content": "hello"}
ANSWER = {"role": "assistant", "content": "hi!"}


@dataclass
class TurnEngine(ScriptedEngine):
    """Renders a user message as the tokens 1, 2, 3 and an assistant's as 7, 8 (the answer's
    tokens), so a later turn's prompt holds the earlier turns; answers 7, 8 (``stop``). While
    ``hang`` is set it samples the token 9 and then nothing more, until the request is aborted."""

    hang: bool = False
    hung: threading.Event = field(default_factory=threading.Event)

    def render(self, messages: list[dict]) -> list[int]:
        return [t for m in messages for t in ([1, 2, 3] if m["role"] == "user" else [7, 8])]

    async def generate(self, prompt_ids, sampling, request_id=None, top_logprobs=0, **kw):
        if self.hang:
            yield GenerationDelta([9], [-0.125], "wa", self.version)
            self.hung.set()
            await asyncio.Event().wait()
        async for d in super().generate(prompt_ids, sampling, request_id, top_logprobs, **kw):
            yield d


def aborted_ids(db) -> list[str]:
    with db.connect() as conn:
        return list(
            conn.execute(select(TrajectoryIndex.id).where(TrajectoryIndex.finish_reason == "abort")).scalars()
        )


async def test_an_aborted_turn_is_sent_again_and_the_episode_trains_with_the_retry(tmp_path):
    settings = make_settings(tmp_path)
    engine = TurnEngine()
    db = make_engine(settings.resolved_database_url)
    async with running_server(settings, engine, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            turn0 = await http.post(
                "/v1/chat/completions", json={"messages": [USER], "episode_id": "ep", "max_tokens": 4}
            )
            assert turn0.status_code == 200, turn0.text
            token = turn0.json()["episode_feedback_token"]
            turn1 = {
                "messages": [USER, ANSWER, USER],
                "episode_id": "ep",
                "episode_token": token,
                "turn": 1,
                "max_tokens": 4,
            }
            # The client leaves mid-answer (it gives up and closes the connection).
            engine.hang = True
            leaving = asyncio.create_task(http.post("/v1/chat/completions", json=turn1))
            assert await asyncio.to_thread(engine.hung.wait, 30.0)
            leaving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leaving
            assert await asyncio.to_thread(wait_for, lambda: aborted_ids(db), 30.0)
            (aborted,) = aborted_ids(db)
            engine.hang = False
            # Its number is free: the same turn again is answered, not 409 duplicate_turn.
            retry = await http.post("/v1/chat/completions", json=turn1)
            assert retry.status_code == 200, retry.text
            rated = await http.post(
                "/v1/feedback", json={"episode_id": "ep", "reward": 1.0, "feedback_token": token}
            )
            assert rated.status_code == 202, rated.text
            # A second answer, rated, so that the learner's batch of 2 fills.
            single = await http.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 4})
            body = single.json()
            assert (
                await http.post(
                    "/v1/feedback",
                    json={"id": body["id"], "reward": 0.0, "feedback_token": body["feedback_token"]},
                )
            ).status_code == 202
            record = (await http.get(f"/admin/trajectories/{aborted}", headers=ADMIN)).json()
    assert (record["episode_id"], record["turn"], record["response_token_ids"]) == ("ep", 1, [9])
    with db.connect() as conn:
        logged = conn.execute(
            select(func.count()).select_from(LogRecord).where(LogRecord.topic == TOPIC_TRAJECTORIES)
        ).scalar_one()
    assert logged == 4  # turn 0, the aborted turn (once), its retry, the single answer

    log = SqlLog(settings.resolved_log_url)
    stats = await asyncio.to_thread(Joiner(log, db, expire_s=3600).poll_once)
    log.close()
    assert stats.samples == 2 and stats.counters == {"void_episode_turns": 1}
    with db.connect() as conn:
        payload = conn.execute(select(LearnerSample.payload).where(LearnerSample.id == "e:ep")).scalar_one()
    sample = json.loads(payload)
    # Turn 0 then the retried turn 1: both answers are actions; the aborted token 9 is nowhere.
    assert sample["input_ids"] == [1, 2, 3, 7, 8, 1, 2, 3, 7, 8]
    assert sample["actions"] == [[3, 5], [8, 10]]
    assert sample["rollout_logprobs"] == [-0.5, -0.25, -0.5, -0.25]
    assert sample["reward"] == 1.0

    learner = await asyncio.to_thread(in_process, tmp_path / "learner", settings.resolved_database_url)
    assert await asyncio.to_thread(run_until, learner, lambda: sum(trained_ids(learner).values()) >= 2)
    assert trained_ids(learner) == {"e:ep": 1, body["id"]: 1}
    db.dispose()


def aborted_first_turn(tmp_path):
    """A server state whose episode ``ep`` had one turn, 0, aborted after tokens: ``Fate`` freed
    it, then its record (prompt ``P-aborted``) was indexed."""
    s = feedback_state(tmp_path)
    s.store.start_episode_turn("ep", "a0", token_ok=False, turn=0)
    s.store.release_turn("a0")
    s.store.index_trajectory(record("a0", "ep", "abort").model_copy(update={"prompt_id": "P-aborted"}), 0, 0)
    return s


async def test_an_episode_whose_only_turn_was_aborted_has_nothing_to_rate(tmp_path):
    s = aborted_first_turn(tmp_path)
    # The aborted record is no turn: the episode has no answered turn, so it is unknown (404),
    # not an episode whose feedback is taken with no turns (and then set aside by the learner).
    assert s.store.episode_prompt_id("ep") is None
    with pytest.raises(ApiError) as err:
        await accept_feedback(s, feedback(episode_id="ep", feedback_token=episode_token("ep")))
    assert (err.value.status, err.value.param) == (404, "episode_id")
    assert s.metrics.feedback.labels("unknown")._value.get() == 1


def test_the_episode_prompt_is_its_answered_turns_not_the_aborted_one(tmp_path):
    s = aborted_first_turn(tmp_path)
    # The client sends turn 0 again with an edited first message: another prompt id.
    assert s.store.start_episode_turn("ep", "r0", token_ok=False, turn=0).turn == 0
    s.store.index_trajectory(record("r0", "ep", "stop").model_copy(update={"prompt_id": "P-retry"}), 0, 1)
    state = s.store.episode_state("ep")
    assert (s.store.episode_prompt_id("ep"), state.prompt_id, state.turn_ids) == (
        "P-retry",
        "P-retry",
        ("r0",),
    )


def test_a_retry_racing_the_release_of_the_only_turn_keeps_the_episode_its_own(tmp_path):
    """The race, step by step: the retry of turn 0 (with its token) has passed its check while
    the episode row still stood; the release of the aborted turn 0 then forgets the episode;
    the retry takes turn 0. The episode is written again with it, so a request without the
    token is still refused, and the turn is the episode's."""
    s = feedback_state(tmp_path)
    s.store.start_episode_turn("ep", "a0", token_ok=False, turn=0)
    s.store.release_turn("a0")  # the only turn: the episode row goes too
    now = utcnow()
    assert s.store._take("ep", "r0", plan_turn(s.store._slots("ep"), 0, now), now)
    assert s.store.start_episode_turn("ep", "x", token_ok=False).outcome == "not_yours"
    assert [slot.trajectory_id for slot in s.store._slots("ep")] == ["r0"]
