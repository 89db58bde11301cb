"""Server + learner on the real model: feedback for one batch → a new version is served."""

from __future__ import annotations

import asyncio
import gc
import re
import time

import httpx
import pytest
import torch

from core.evidence_store import EvidenceStore
from core.records import TrajectoryRecord
from learner.process import Learner, LearnerConfig
from saoserve.model import weights_sha256
from testing.logs import read_topic
from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.engine


async def test_learner_publishes_a_version_the_server_serves(policy_engine, model_dir, tmp_path):
    settings = make_settings(tmp_path, model_dir=model_dir, policy_dir=tmp_path / "policies")
    config = LearnerConfig(batch_size=4, checkpoint_every=1, poll_s=0.1)
    try:
        async with (
            running_server(settings, policy_engine) as url,
            httpx.AsyncClient(base_url=url, timeout=300) as http,
        ):
            prompts = [f"Write a line about the number {i}." for i in range(4)]
            bodies = await asyncio.gather(
                *(
                    http.post(
                        "/v1/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": p}],
                            "max_tokens": 12,
                            "temperature": 1.0,
                        },
                    )
                    for p in prompts
                )
            )
            answers = [b.json() for b in bodies]
            # Evidence frozen at dispatch: unknown prompts get Jeffreys(0 of 0) = (8·0.5/1, 8 − 4) = (4, 4).
            rec0 = TrajectoryRecord.model_validate_json(
                (await http.get(f"/admin/trajectories/{answers[0]['id']}", headers=ADMIN)).content
            )
            assert rec0.baseline is not None and (rec0.baseline.alpha, rec0.baseline.beta) == (4.0, 4.0)
            learner = Learner(settings, config)
            await asyncio.to_thread(learner.load)
            # Feedback for three of four first: no batch yet.
            for a, r in zip(answers[:3], (1.0, 0.0, 1.0), strict=True):
                resp = await http.post(
                    "/v1/feedback", json={"id": a["id"], "feedback_token": a["feedback_token"], "reward": r}
                )
                assert resp.status_code == 202
            stats = await asyncio.to_thread(learner.poll_once)
            assert stats.samples == 3 and await asyncio.to_thread(learner.train_step) is None
            a = answers[3]
            completed_at = time.time()
            await http.post(
                "/v1/feedback", json={"id": a["id"], "feedback_token": a["feedback_token"], "reward": 0.0}
            )
            stats = await asyncio.to_thread(learner.poll_once)
            assert stats.samples == 1
            again = await asyncio.to_thread(learner.poll_once)
            assert again.samples == 0  # offsets moved with the samples
            metrics = await asyncio.to_thread(learner.train_step)
            assert metrics is not None and learner.version == 1
            assert metrics["reward_mean"] == pytest.approx(0.5)  # (1 + 0 + 1 + 0) / 4
            assert 0.0 <= metrics["kept_fraction"] <= 1.0 and metrics["staleness_max"] == 0
            assert learner.waiting_samples() == 0
            # Joined results entered the evidence at their dispatch version (0).
            ev = EvidenceStore(learner.db).get(answers[0]["prompt_id"])
            assert ev is not None and ev.n_results == 1 and ev.reward_sum == 1.0

            for _ in range(100):
                if (await http.get("/v1/models")).json()["data"][0]["policy_version"] == 1:
                    break
                await asyncio.sleep(0.2)
            r = await http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": prompts[0]}],
                    "max_tokens": 16,
                    "temperature": 0.8,
                },
            )
            assert r.json()["policy_version"] == 1
            # feedback→served (issue 10): from the join of the completing feedback to this answer.
            served_at = time.time()
            assert completed_at <= metrics["batch_completed_at"] <= served_at
            page = (await http.get("/metrics")).text
            count = float(re.search(r"^saoserve_feedback_to_served_seconds_count (\S+)$", page, re.M)[1])
            total = float(re.search(r"^saoserve_feedback_to_served_seconds_sum (\S+)$", page, re.M)[1])
            assert count == 1.0
            assert 0.0 < total <= served_at - metrics["batch_completed_at"]
            # feedback→swap, its part before the answer: observed once, and no longer.
            swap_count = float(re.search(r"^saoserve_feedback_to_swap_seconds_count (\S+)$", page, re.M)[1])
            swap_total = float(re.search(r"^saoserve_feedback_to_swap_seconds_sum (\S+)$", page, re.M)[1])
            assert swap_count == 1.0 and 0.0 < swap_total <= total
            rec = TrajectoryRecord.model_validate_json(
                (await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)).content
            )
            assert rec.token_versions == [(1, len(rec.response_token_ids))]
            # The learner's recomputation under the published weights equals the served logprobs.
            from transformers import AutoModelForCausalLM

            from learner.data.batch import policy_logprobs

            published = AutoModelForCausalLM.from_pretrained(
                tmp_path / "policies" / "v000001", dtype=torch.float32
            )
            ids = torch.tensor([rec.prompt_token_ids + rec.response_token_ids])
            with torch.no_grad():
                lp = policy_logprobs(published, ids, torch.ones_like(ids), torch.tensor([0.8]))
            mine = lp[0, len(rec.prompt_token_ids) :].tolist()
            diff = max(abs(a - b) for a, b in zip(mine, rec.rollout_logprobs, strict=True))
            assert diff < 0.02, diff
            events = read_topic(learner.log, "policy")
            assert [e.key for e in events] == ["policy"]

            # Restart: the learner resumes at version 1 from its checkpoint and the database.
            # Free the first learner's models first (policy, critic and Adam states: ~6 GB).
            learner.algorithm = None
            gc.collect()
            resumed = Learner(settings, config)
            await asyncio.to_thread(resumed.load)
            assert resumed.version == 1 and resumed.algorithm.steps == 1
    finally:
        await policy_engine.swap(0, model_dir, weights_sha256(model_dir))
