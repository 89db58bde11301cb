"""Hot-swap on the real engine: a perturbed copy of every weight (embeddings included)."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from core.records import TrajectoryRecord
from saoserve.model import weights_sha256
from tests.conftest import ADMIN, make_settings, running_server
from tests.test_server import hf_logprobs

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def perturbed_model(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("perturbed") / "v1"
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    noisy = {
        k: (v.float() * (1 + 0.05 * torch.randn(v.shape, generator=gen))).to(v.dtype)
        for k, v in weights.items()
    }
    assert "model.embed_tokens.weight" in noisy  # tied: the LM head is the embedding
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out


async def test_swap_keeps_in_flight_requests_and_serves_new_weights(
    policy_engine, model_dir, perturbed_model, tmp_path
):
    settings = make_settings(tmp_path)
    base_sha = weights_sha256(model_dir)
    new_sha = weights_sha256(perturbed_model)
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            try:
                # A checksum mismatch is refused and version 0 keeps serving.
                r = await http.post(
                    "/admin/load_policy",
                    headers=ADMIN,
                    json={"version": 1, "path": str(perturbed_model), "sha256": base_sha},
                )
                assert r.status_code == 422 and "checksum mismatch" in r.json()["error"]["message"]
                r = await http.post(
                    "/admin/load_policy",
                    headers=ADMIN,
                    json={"version": 1, "path": str(tmp_path / "missing"), "sha256": new_sha},
                )
                assert r.status_code == 422
                assert (await http.get("/v1/models")).json()["data"][0]["policy_version"] == 0

                long_req = asyncio.create_task(
                    http.post(
                        "/v1/chat/completions",
                        json={
                            "messages": [
                                {"role": "user", "content": "Tell a long story about a lighthouse."}
                            ],
                            "max_tokens": 160,
                            "temperature": 1.0,
                            "seed": 3,
                        },
                    )
                )
                await asyncio.sleep(2.0)
                r = await http.post(
                    "/admin/load_policy",
                    headers=ADMIN,
                    json={"version": 1, "path": str(perturbed_model), "sha256": new_sha},
                )
                assert r.status_code == 200 and r.json()["policy_version"] == 1
                r_long = await long_req
                assert r_long.status_code == 200
                rec = TrajectoryRecord.model_validate_json(
                    (await http.get(f"/admin/trajectories/{r_long.json()['id']}", headers=ADMIN)).content
                )
                assert rec.dispatch_version == 0
                assert [v for v, _ in rec.token_versions] == [0, 1], rec.token_versions

                r = await http.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "Name three colours."}],
                        "max_tokens": 24,
                        "temperature": 0.9,
                        "seed": 5,
                    },
                )
                assert r.json()["policy_version"] == 1
                rec = TrajectoryRecord.model_validate_json(
                    (await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)).content
                )
                assert rec.token_versions == [(1, len(rec.response_token_ids))]
                ref = hf_logprobs(perturbed_model, rec.prompt_token_ids, rec.response_token_ids, 0.9)
                diff = max(abs(a - b) for a, b in zip(ref, rec.rollout_logprobs, strict=True))
                # Measured ≈ 3e-5 nats (float32 engine); a stale LM head gives > 1 nat.
                assert diff < 0.02, diff
            finally:
                r = await http.post(
                    "/admin/load_policy",
                    headers=ADMIN,
                    json={"version": 0, "path": str(model_dir), "sha256": base_sha},
                )
                assert r.status_code == 200
