"""The asynchronous simulation (issue 10) for a few versions end to end against the real server
and learner. Its options, pacing and streams: tests/unit/judge/test_simulate_async.py."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from judge.runstats import unix_s
from judge.sim_config import SimulationConfig
from judge.simulate import Simulation
from testing.judge import SCHEDULE


@pytest.fixture(scope="module")
def offline_judge():
    from judge.offline import OfflineJudge

    return OfflineJudge()


@pytest.mark.engine
async def test_async_run_against_server_and_learner(policy_engine, model_dir, tmp_path, offline_judge):
    """Open-loop traffic over three versions: the learner swaps while requests are in flight,
    each answer counts toward its first token's version, and the report's new fields are filled."""
    from judge.report import write_report
    from learner.process import Learner, LearnerConfig
    from saoserve.model import weights_sha256
    from testing.servers import ADMIN, make_settings, running_server

    settings = make_settings(tmp_path, model_dir=model_dir, policy_dir=tmp_path / "policies")
    stop = threading.Event()
    thread = threading.Thread()
    try:
        async with running_server(settings, policy_engine) as url:
            learner = Learner(
                settings, LearnerConfig(batch_size=2, poll_s=0.2, checkpoint_every=100, max_steps=2)
            )
            await asyncio.to_thread(learner.load)
            thread = threading.Thread(target=learner.run, args=(stop,), daemon=True)
            thread.start()
            cfg = SimulationConfig(
                base_url=url,
                schedule=SCHEDULE,
                batch_size=2,
                max_tokens=24,
                concurrency=4,
                seed=3,
                n_prompts=8,
                admin_key=settings.admin_key,
                mode="async",
                max_seconds=400,
            )
            result = await Simulation(cfg, offline_judge).run()
            recs = result.records
            assert result.request_failures == 0 and result.judge_failures == 0 and not result.interrupted
            # The run ended because the schedule's last step (version 2) holds a batch of answers.
            assert result.start_version == 0 and sum(r["step"] == 2 for r in recs) >= 2
            # Each answer counts toward the version of its first token, and its target is that step's.
            assert all(r["step"] == r["first_version"] for r in recs)
            assert all(r["target_style"] == SCHEDULE.target_at(r["step"]) for r in recs)
            # Streamed: each answer's first text arrived after it was sent and before it ended.
            # (An answer whose first token ends it has no text and no first-token time.)
            timed = [r for r in recs if r["t_first_token"] is not None]
            assert len(timed) >= len(recs) // 2
            assert all(r["t_sent"] < r["t_first_token"] <= r["t_answer"] for r in timed)
            assert all(r["finish_reason"] in ("stop", "length") for r in recs)
            async with httpx.AsyncClient(base_url=url) as http:
                one = recs[-1]
                spans = (await http.get(f"/admin/trajectories/{one['id']}", headers=ADMIN)).json()
            assert spans["token_versions"][0][0] == one["first_version"]
            assert spans["token_versions"][-1][0] == one["last_version"]
            # Requests were in flight while the server swapped: some answer was dispatched
            # under an older version than the one that finished it (or started it).
            overlapped = [r for r in recs if r["policy_version"] < r["last_version"]]
            assert overlapped, [(r["policy_version"], r["first_version"], r["last_version"]) for r in recs]
            # The learner's two steps with their token staleness (from the spans) and the sample
            # that completed each batch, which is one of this run's answers.
            assert [s["version"] for s in result.learner_steps] == [1, 2]
            ids = {r["id"] for r in recs}
            assert all(s["completing_sample"] in ids for s in result.learner_steps)
            assert max(x["version"] for x in result.timeline) == 2
            # The times that put each step between its feedback and its answers (one clock, Unix
            # s): the batch was joined after the run began, the step started after its join and
            # ended before its commit (bench/bench_feedback_latency.py's parts of the way).
            for s in result.learner_steps:
                start, end = s["step_started_at"], s["step_started_at"] + s["step_time_s"]
                assert result.t0_wall < s["batch_completed_at"] <= start < end <= unix_s(s["created_at"])
            assert result.details()["t0_wall"] == result.t0_wall
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 120)
        await policy_engine.swap(0, model_dir, weights_sha256(model_dir))
    metrics = write_report(tmp_path / "report", SCHEDULE, {"sao": recs}, details={"sao": result.details()})[
        "methods"
    ]["sao"]
    hist = metrics["staleness"]["histogram"]
    assert metrics["staleness"]["tokens"] == sum(hist.values()) > 0
    assert len(metrics["dis_kept_fraction"]) == 2 and metrics["mode"] == "async"
    assert metrics["feedback_to_served_s"]["n"] >= 1 and metrics["feedback_to_served_s"]["p50"] > 0
    assert metrics["feedback_to_first_token_s"]["n"] >= 1
    assert (tmp_path / "report" / "staleness.png").is_file() and (
        tmp_path / "report" / "wallclock.png"
    ).is_file()
