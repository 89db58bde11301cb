"""Hot-swap on the real engine: a perturbed copy of every weight (embeddings included);
weights that do not match the model are refused before pausing; a fault during a swap leaves
the old version serving."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from core.records import TrajectoryRecord
from core.weights import weights_sha256
from testing.fakes import record_versions
from testing.hotswap import LOGPROB_BOUND, learner_logprobs, perturb_model
from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.engine


def logprob_gap(model_dir, rec: TrajectoryRecord, temperature: float, precision: str) -> float:
    """Max |served − learner| over the record's answer tokens (nats)."""
    ref = learner_logprobs(model_dir, rec.prompt_token_ids, rec.response_token_ids, temperature, precision)
    return max(abs(a - b) for a, b in zip(ref, rec.rollout_logprobs, strict=True))


@pytest.fixture(scope="module")
def perturbed_model(model_dir, tmp_path_factory):
    return perturb_model(model_dir, tmp_path_factory.mktemp("perturbed") / "v1")


async def test_swap_keeps_in_flight_requests_and_serves_new_weights(
    policy_engine, model_dir, perturbed_model, tmp_path
):
    settings = make_settings(tmp_path)
    base_sha = weights_sha256(model_dir)
    new_sha = weights_sha256(perturbed_model)
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        # The server serves recorded versions only (the learner records each it publishes).
        record_versions(settings, {1: new_sha})
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            try:
                # A checksum other than the recorded one is refused and version 0 keeps serving.
                r = await http.post(
                    "/admin/load_policy",
                    headers=ADMIN,
                    json={"version": 1, "path": str(perturbed_model), "sha256": base_sha},
                )
                assert r.status_code == 422 and "recorded checksum" in r.json()["error"]["message"]
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
                # The served logprobs are the new weights', for the learner in each precision.
                served = policy_engine.settings.dtype
                for precision in ("float32", "bf16"):
                    diff = logprob_gap(perturbed_model, rec, 0.9, precision)
                    assert diff < LOGPROB_BOUND[(served, precision)], (precision, diff)
            finally:
                # Versions only go forward through the server (409 for version 0 now); the
                # session's shared engine goes back to version 0 directly.
                await policy_engine.swap(0, model_dir, base_sha)


def write_variant(model_dir, out, change) -> str:
    """A version directory whose weights are ``change(weights of model_dir)``; its sha256."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    save_file(change(load_file(model_dir / "model.safetensors")), out / "model.safetensors")
    return weights_sha256(out)


def _drop(w):
    return {k: v for k, v in w.items() if k != "model.norm.weight"}


def _extra(w):
    return {**w, "model.layers.30.mlp.extra.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}


def _reshape(w):
    return {**w, "model.norm.weight": torch.ones(575, dtype=w["model.norm.weight"].dtype)}


def _retype(w):
    return {**w, "model.norm.weight": w["model.norm.weight"].to(torch.float16)}


MISMATCHED = [
    (_drop, "missing tensor 'model.norm.weight'"),
    (_extra, "unexpected tensor 'model.layers.30.mlp.extra.weight'"),
    (_reshape, "tensor 'model.norm.weight' has shape [575], the model [576]"),
    (_retype, "tensor 'model.norm.weight' has dtype F16, expected one of ['BF16', 'F32']"),
]


async def served_matches(http, model_dir, served: str) -> None:
    """A request is answered at version 0 with the logprobs of the weights in ``model_dir``
    (engine dtype ``served``; the float32 learner's recomputation)."""
    r = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Name a bird."}], "max_tokens": 12, "seed": 2},
    )
    assert r.status_code == 200 and r.json()["policy_version"] == 0
    rec = TrajectoryRecord.model_validate_json(
        (await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)).content
    )
    assert rec.token_versions == [(0, len(rec.response_token_ids))]
    # Perturbed weights differ from these by far more than the bound.
    diff = logprob_gap(model_dir, rec, 1.0, "float32")
    assert diff < LOGPROB_BOUND[(served, "float32")], diff


async def test_weights_that_do_not_match_the_model_are_refused(policy_engine, model_dir, tmp_path):
    """Each directory has the right checksum for its file; the tensor layout refuses it
    before the engine pauses, and version 0 keeps serving its own weights."""
    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            for i, (change, message) in enumerate(MISMATCHED):
                out = tmp_path / f"v{i + 1}"
                sha = write_variant(model_dir, out, change)
                record_versions(settings, {i + 1: sha})
                r = await http.post(
                    "/admin/load_policy",
                    headers=ADMIN,
                    json={"version": i + 1, "path": str(out), "sha256": sha},
                )
                assert r.status_code == 422, r.text
                assert r.json()["error"]["code"] == "swap_refused" and message in r.json()["error"]["message"]
                shutil.rmtree(out)
            assert (await http.get("/v1/models")).json()["data"][0]["policy_version"] == 0
            await served_matches(http, model_dir, policy_engine.settings.dtype)


async def test_a_fault_during_the_swap_restores_the_old_version(
    policy_engine, model_dir, perturbed_model, tmp_path, monkeypatch
):
    """The new weights are loaded, then stamping the version fails (an injected fault): the
    swap reloads version 0's weights, resumes the engine and answers 422; requests are then
    served at version 0 with version 0's logprobs (the LM head restored too)."""
    stamp = policy_engine.engine.update_weight_version

    async def failing_stamp(version: str) -> None:
        if version == "1":
            raise RuntimeError("injected fault")
        await stamp(version)

    monkeypatch.setattr(policy_engine.engine, "update_weight_version", failing_stamp)
    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        record_versions(settings, {1: weights_sha256(perturbed_model)})
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            r = await http.post(
                "/admin/load_policy",
                headers=ADMIN,
                json={"version": 1, "path": str(perturbed_model), "sha256": weights_sha256(perturbed_model)},
            )
            assert r.status_code == 422, r.text
            assert "injected fault" in r.json()["error"]["message"]
            assert "version 0 serves on" in r.json()["error"]["message"]
            assert policy_engine.version == 0 and policy_engine.path == model_dir
            await served_matches(http, model_dir, policy_engine.settings.dtype)
