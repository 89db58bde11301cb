"""The whole loop with a 2-rank learner (issue 38): the real server (vLLM, the 135M model) logs
answers and feedback, a learner of 2 gloo ranks under torchrun (``learner.distributed``, FSDP2)
joins them, trains a step and publishes a version; the server swaps to it and serves answers
whose logged logprobs equal the learner's recomputation under the published weights (the check of
tests/integration/test_learner_e2e.py, which runs one learner in process). Run under the engine lock."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
import torch

from core.records import TrajectoryRecord
from learner.config import LearnerConfig
from saoserve.model import weights_sha256
from testing import ROOT
from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.engine

LAUNCHER = """
import sys
from core.settings import Settings
from learner.config import LearnerConfig
from learner.distributed import run_ranked

run_ranked(Settings(), LearnerConfig.model_validate_json(open(sys.argv[1]).read()))
"""


async def test_a_two_rank_learner_publishes_what_the_server_serves(policy_engine, model_dir, tmp_path):
    settings = make_settings(tmp_path, model_dir=model_dir, policy_dir=tmp_path / "policies")
    # The server's dtype (float32 in tests) is the published one; the learner trains in float32.
    config = LearnerConfig(batch_size=4, max_steps=1, checkpoint_every=1, poll_s=0.1, device="cpu")
    (tmp_path / "learner.json").write_text(config.to_json())
    (tmp_path / "launch.py").write_text(LAUNCHER)
    try:
        async with (
            running_server(settings, policy_engine) as url,
            httpx.AsyncClient(base_url=url, timeout=300) as http,
        ):
            chat = {"max_tokens": 12, "temperature": 1.0}
            bodies = await asyncio.gather(
                *(
                    http.post(
                        "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": f"A line about {i}."}]} | chat,
                    )
                    for i in range(4)
                )
            )
            for body, reward in zip(bodies, (1.0, 0.0, 1.0, 0.0), strict=True):
                a = body.json()
                resp = await http.post(
                    "/v1/feedback",
                    json={"id": a["id"], "feedback_token": a["feedback_token"], "reward": reward},
                )
                assert resp.status_code == 202
            env = os.environ | {
                "PYTHONPATH": str(ROOT),
                "SAOSERVE_HOME": str(tmp_path),
                "SAOSERVE_DATABASE_URL": settings.resolved_database_url,
                "SAOSERVE_LOG_URL": settings.resolved_log_url,
                "SAOSERVE_MODEL_DIR": str(model_dir),
                "SAOSERVE_POLICY_DIR": str(tmp_path / "policies"),
                "OMP_NUM_THREADS": "1",
            }
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            command += [str(tmp_path / "launch.py"), str(tmp_path / "learner.json")]
            done = await asyncio.to_thread(
                subprocess.run, command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, done.stderr[-4000:]
            for _ in range(300):
                if (await http.get("/v1/models")).json()["data"][0]["policy_version"] == 1:
                    break
                await asyncio.sleep(0.2)
            r = await http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "A line about 0."}], "max_tokens": 16}
                | {"temperature": 0.8},
            )
            assert r.json()["policy_version"] == 1
            rec = TrajectoryRecord.model_validate_json(
                (await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)).content
            )
            assert rec.token_versions == [(1, len(rec.response_token_ids))]
            # Both ranks' shards went into the published weights: the recomputation under them
            # equals what the server logged (tolerance as tests/integration/test_learner_e2e.py).
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
            # And the version moved away from the base: the step trained.
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            moved = max(
                (p - q).abs().max().item()
                for p, q in zip(published.parameters(), base.parameters(), strict=True)
            )
            assert moved > 0
    finally:
        await policy_engine.swap(0, model_dir, weights_sha256(model_dir))
