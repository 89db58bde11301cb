"""Policy versions as LoRA adapters (issue 20, server side; docs/serving_adapters.md).

One LoRA-enabled vLLM engine for this module (``AdapterServing.ADAPTER``, 3 slots, max rank 16)
against transformers + PEFT on the same adapter files; merged mode on the session's shared engine.
Without an engine: the adapter table's rules and the adapter folder's check, copy and merge in
``tests/unit/server/test_adapter_serving.py``, the engine's policies over a stand-in for vLLM in
``tests/unit/server/test_engine_policies.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import torch

from core.policy_store import ADAPTER_CONFIG, ADAPTER_FILE, version_dir
from core.records import SamplingRecord
from core.settings import AdapterServing
from core.weights import weights_sha256
from testing.adapters import ALL_MODULES, PROMPT, write_adapters
from testing.servers import ADMIN, make_settings, running_server

# ---------------------------------------------------------------- the adapter table (pure)


# ------------------------------------------------ adapter folders (pure, a 2-layer toy model)


# ------------------------------------------------------------------ on the real engine


def peft_logprobs(
    model_dir: Path, adapter: Path | None, prompt: list[int], response: list[int]
) -> list[float]:
    """Teacher-forced log softmax of each response token under transformers (+ PEFT), fp32, T=1."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Published version folders ``name → (folder, sha256)``: a, b, c (rank 8, all seven
    projections), r32 (rank 32), corrupt (a's files, cut short)."""
    root = tmp_path_factory.mktemp("adapters")
    names = ["a", "b", "c"]
    write_adapters(model_dir, [root / n for n in names], seed=1)
    write_adapters(model_dir, [root / "r32"], rank=32, seed=2)
    shutil.copytree(root / "a", root / "corrupt")
    f = root / "corrupt" / ADAPTER_FILE
    f.write_bytes(f.read_bytes()[:-4096])
    return {n: (root / n, weights_sha256(root / n)) for n in [*names, "r32", "corrupt"]}


@pytest.fixture(scope="module")
async def lora_engine(model_dir, tmp_path_factory):
    """The one LoRA-enabled engine of this module: 3 adapter slots, 2 per batch, rank ≤ 16."""
    from core.settings import Settings
    from server.engine import PolicyEngine

    settings = Settings(
        home=tmp_path_factory.mktemp("lora-engine"),
        model_dir=model_dir,
        kv_cache_gib=1.0,
        adapter_serving=AdapterServing.ADAPTER,
        max_loras=2,
        max_lora_rank=16,
        max_cpu_loras=3,
    )
    engine = await PolicyEngine.start(settings, model_dir)
    yield engine
    engine.shutdown()


async def answer(engine, seed: int, max_tokens: int = 24, version: int | None = None, started=None):
    """One request at temperature 1: ``(token ids, logprobs, spans)``; ``started`` is set at its
    first delta."""
    ids, lps, spans = [], [], None
    prompt = engine.render(PROMPT)
    sampling = SamplingRecord(temperature=1.0, max_tokens=max_tokens, seed=seed)
    async for d in engine.generate(prompt, sampling, version=version, ignore_eos=True):
        ids += d.token_ids
        lps += d.logprobs
        spans = d.weight_versions or spans
        if started is not None:
            started.set()
    return ids, lps, spans


def max_gap(x: list[float], y: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(x, y, strict=True))


@pytest.mark.engine
async def test_served_logprobs_under_an_adapter_equal_peft(lora_engine, adapters, model_dir, record_property):
    eng = lora_engine
    prompt = eng.render(PROMPT)
    base_ids, base_lps, base_spans = await answer(eng, seed=5)
    assert base_spans == [(0, 0, 24)]
    path, sha = adapters["a"]
    res = await eng.swap(1, path, sha)
    assert res.paused_seconds == 0.0 and eng.version == 1 and eng.path == path
    ids, lps, spans = await answer(eng, seed=5)
    assert spans == [(1, 0, 24)]
    ref = peft_logprobs(model_dir, path, prompt, ids)
    record_property("adapter_vs_peft_nats", max_gap(lps, ref))
    assert max_gap(lps, ref) < 1e-4
    # The adapter changes the model: the base's logprobs of these tokens differ.
    assert max_gap(peft_logprobs(model_dir, None, prompt, ids), ref) > 1e-2
    assert max_gap(peft_logprobs(model_dir, None, prompt, base_ids), base_lps) < 1e-4


@pytest.mark.engine
async def test_a_new_version_is_served_on_the_next_request_after_its_event(
    lora_engine, adapters, model_dir, tmp_path
):
    from core.logbus import open_log
    from core.records import TOPIC_POLICY, PolicyEvent

    eng = lora_engine
    settings = make_settings(tmp_path, policy_poll_s=0.05)
    v = eng.version + 1
    folder = version_dir(tmp_path / "policies", v)
    shutil.copytree(adapters["b"][0], folder)
    async with running_server(settings, eng) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        log = open_log(settings.resolved_log_url)
        event = PolicyEvent(
            version=v,
            path=str(folder),
            sha256=adapters["b"][1],
            created_at=datetime.now(UTC),
            parent_version=v - 1,
        )
        await asyncio.to_thread(log.append, TOPIC_POLICY, "policy", event.to_json())
        for _ in range(200):
            if (await http.get("/v1/models")).json()["data"][0]["policy_version"] == v:
                break
            await asyncio.sleep(0.05)
        body = {"messages": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 9, "logprobs": True}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["policy_version"] == v
        rec = (await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)).json()
    n = len(rec["response_token_ids"])
    assert rec["token_versions"] == [[v, n]] and rec["dispatch_version"] == v
    ref = peft_logprobs(model_dir, folder, rec["prompt_token_ids"], rec["response_token_ids"])
    assert max_gap(rec["rollout_logprobs"], ref) < 1e-4


@pytest.mark.engine
async def test_in_flight_requests_keep_their_adapter_while_others_load_and_unload(lora_engine, adapters):
    eng = lora_engine
    v = eng.version + 1
    await eng.swap(v, *adapters["a"])
    seeds = [11, 12]
    calm = [await answer(eng, seed=s, max_tokens=40) for s in seeds]
    started = [asyncio.Event() for _ in seeds]
    runs = [asyncio.create_task(answer(eng, s, 40, started=e)) for s, e in zip(seeds, started, strict=True)]
    await asyncio.gather(*(e.wait() for e in started))
    churned = 0
    while not all(t.done() for t in runs):
        # b and c in turn as new versions: each load makes the one before it removable.
        churned += 1
        await eng.swap(v + churned, *adapters["b" if churned % 2 else "c"])
        await eng.removals_done()
    stormy = [t.result() for t in runs]
    assert churned >= 2
    for (ids, lps, spans), (ids2, lps2, spans2) in zip(calm, stormy, strict=True):
        assert ids2 == ids and spans == spans2 == [(v, 0, 40)]
        assert max_gap(lps, lps2) < 1e-4
    await eng.removals_done()
    # Only the current adapter is left: the in-flight ones' went when they ended.
    assert eng.adapters.occupied() == 1 and eng.adapters.current.version == v + churned


@pytest.mark.engine
async def test_bad_adapters_are_refused_and_the_old_one_serves_on(lora_engine, adapters, model_dir, tmp_path):
    from core.records import PolicyEvent
    from server.engine import SwapRefused
    from server.metrics import ServerMetrics
    from server.policy_watch import PolicyWatcher

    eng = lora_engine
    v = eng.version
    before = await answer(eng, seed=21)
    occupied = eng.adapters.occupied()
    watcher = PolicyWatcher(None, eng, ServerMetrics(), poll_s=1.0)
    cases = {
        "corrupt": (*adapters["corrupt"], "tensors cover"),
        "r32": (*adapters["r32"], "rank 32 is above max_lora_rank 16"),
        "checksum": (adapters["b"][0], "0" * 64, "checksum mismatch"),
    }
    wrong = tmp_path / "wrong-target"
    shutil.copytree(adapters["b"][0], wrong)
    cfg = json.loads((wrong / ADAPTER_CONFIG).read_text())
    (wrong / ADAPTER_CONFIG).write_text(json.dumps({**cfg, "target_modules": [*ALL_MODULES, "lm_head"]}))
    cases["target"] = (wrong, weights_sha256(wrong), "target modules \\['lm_head'\\] are not served")
    for i, (path, sha, message) in enumerate(cases.values(), start=1):
        with pytest.raises(SwapRefused, match=message):
            await eng.swap(v + i, path, sha)
        event = PolicyEvent(version=v + i, path=str(path), sha256=sha, created_at=datetime.now(UTC))
        assert await watcher.apply(event) is False
    assert watcher.metrics.swaps.labels("refused")._value.get() == len(cases)
    assert eng.version == v and eng.adapters.occupied() == occupied
    after = await answer(eng, seed=21)
    assert after[0] == before[0] and after[2] == before[2] == [(v, 0, 24)]


@pytest.mark.engine
async def test_same_version_reload_full_table_and_racing_loads(lora_engine, adapters):
    from server.engine import SwapRefused

    eng = lora_engine
    table = eng.adapters
    v = eng.version + 1
    await eng.swap(v, *adapters["a"])
    await eng.removals_done()
    first = table.current
    await eng.swap(v, *adapters["a"])  # the same version, same checksum: nothing to load
    assert table.current is first and table.occupied() == 1
    await eng.swap(v, *adapters["b"])  # the same version republished with other files
    await eng.removals_done()
    assert table.current.lora_id > first.lora_id and table.current.sha256 == adapters["b"][1]
    assert table.occupied() == 1
    # Racing loads: both load in call order, the newer stays current.
    await asyncio.gather(eng.swap(v + 1, *adapters["a"]), eng.swap(v + 2, *adapters["c"]))
    await eng.removals_done()
    assert eng.version == v + 2 and table.occupied() == 1
    results = await asyncio.gather(
        eng.swap(v + 4, *adapters["a"]), eng.swap(v + 3, *adapters["b"]), return_exceptions=True
    )
    assert isinstance(results[1], SwapRefused) and "older than the adapter serving" in str(results[1])
    assert eng.version == v + 4
    await eng.removals_done()
    # A full table: two pinned versions and the current one fill the 3 slots.
    eng.pin(v + 4)
    await eng.swap(v + 5, *adapters["b"])
    eng.pin(v + 5)
    await eng.swap(v + 6, *adapters["c"])
    with pytest.raises(SwapRefused, match="all 3 adapter slots are taken"):
        await eng.swap(v + 7, *adapters["a"])
    assert eng.version == v + 6 and table.occupied() == 3
    ids, _, spans = await answer(eng, seed=3, max_tokens=8)
    assert spans == [(v + 6, 0, 8)]
    eng.pin(v + 4, pinned=False)
    eng.pin(v + 5, pinned=False)
    await eng.removals_done()
    assert table.occupied() == 1
    await eng.swap(v + 7, *adapters["a"])
    assert eng.version == v + 7


# Merged mode (W + scale·B·A swapped in as full weights) against the LoRA path, same adapter,
# same tokens: the gap measured on this machine is in docs/log/2026-12-06-serving-adapters-checks.md.
MERGED_VS_ADAPTER_NATS = 1e-4


@pytest.mark.engine
async def test_merged_mode_serves_the_adapters_logprobs(
    policy_engine, lora_engine, adapters, model_dir, record_property
):
    assert policy_engine.settings.adapter_serving is AdapterServing.MERGED and policy_engine.adapters is None
    path, sha = adapters["c"]
    v = lora_engine.version + 1
    await lora_engine.swap(v, path, sha)
    lora_ids, lora_lps, _ = await answer(lora_engine, seed=31)
    base_sha = weights_sha256(model_dir)
    try:
        res = await policy_engine.swap(1, path, sha)
        assert res.paused_seconds > 0 and policy_engine.path == path
        merged_ids, merged_lps, spans = await answer(policy_engine, seed=31)
    finally:
        await policy_engine.swap(0, model_dir, base_sha)
    assert policy_engine.weights_path == model_dir and not list(policy_engine.work_dir.iterdir())
    assert spans == [(1, 0, 24)] and merged_ids == lora_ids
    record_property("merged_vs_adapter_nats", max_gap(merged_lps, lora_lps))
    assert max_gap(merged_lps, lora_lps) < MERGED_VS_ADAPTER_NATS


@pytest.mark.engine
async def test_a_canary_split_serves_the_lineage_and_the_promoted_adapter_side_by_side(
    lora_engine, adapters, model_dir, tmp_path
):
    """The canary share on the real engine (docs/guard.md, "The canary share"): the promoted
    version's adapter is held beside the lineage's, each request is served wholly by its arm's
    version and logged with its arm; once the lineage is promoted every request gets it."""
    from sqlalchemy import insert, select

    from core.db import PolicyVersion, make_engine
    from core.logbus import open_log
    from core.records import TOPIC_POLICY, PolicyEvent, utcnow

    eng = lora_engine
    await eng.removals_done()
    settings = make_settings(tmp_path, policy_poll_s=0.05)
    promoted_v, canary_v = eng.version + 1, eng.version + 2
    folders = {}
    for v, name in ((promoted_v, "a"), (canary_v, "b")):
        folders[v] = version_dir(tmp_path / "policies", v)
        shutil.copytree(adapters[name][0], folders[v])
    async with running_server(settings, eng) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        db = make_engine(settings.resolved_database_url)
        with db.begin() as conn:
            known = set(conn.execute(select(PolicyVersion.version)).scalars())
            rows = [(0, model_dir, weights_sha256(model_dir), "promoted")] * (0 not in known) + [
                (promoted_v, folders[promoted_v], adapters["a"][1], "promoted"),
                (canary_v, folders[canary_v], adapters["b"][1], "canary"),
            ]
            for v, path, sha, stage in rows:
                conn.execute(
                    insert(PolicyVersion).values(
                        version=v,
                        path=str(path),
                        sha256=sha,
                        status="published",
                        created_at=utcnow(),
                        lifecycle=stage,
                    )
                )
        db.dispose()
        event = PolicyEvent(
            version=canary_v,
            path=str(folders[canary_v]),
            sha256=adapters["b"][1],
            created_at=datetime.now(UTC),
            parent_version=promoted_v,
            lifecycle="canary",
        )
        await asyncio.to_thread(
            open_log(settings.resolved_log_url).append, TOPIC_POLICY, "policy", event.to_json()
        )
        r = await http.post("/admin/lifecycle/canary", json={"share": 0.5}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["applied"] and r.json()["mode"] == "canary"
        for _ in range(400):
            split = (await http.get("/admin/lifecycle", headers=ADMIN)).json()["split"]
            if split is not None and eng.version == canary_v:
                break
            await asyncio.sleep(0.05)
        assert split == {"lineage": [canary_v], "control": promoted_v, "share": 0.5}
        body = {"messages": PROMPT, "max_tokens": 4, "temperature": 1.0, "logprobs": True}
        served = []
        for i in range(40):
            # 40 users: the arm is sticky per user (core.lifecycle.arm_key), Binomial over users.
            r = await http.post("/v1/chat/completions", json=body | {"seed": i, "user": f"u{i}"})
            assert r.status_code == 200
            rec = (await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)).json()
            served.append((r.json()["policy_version"], rec["arm"], rec["token_versions"], rec))
        # Each answer is wholly its arm's version: canary ↔ the lineage, control ↔ the promoted.
        for version, arm, token_versions, _ in served:
            assert (version, arm) in {(canary_v, "canary"), (promoted_v, "control")}
            assert token_versions == [[version, 4]]
        n_canary = sum(1 for _, arm, _, _ in served if arm == "canary")
        assert 8 <= n_canary <= 32  # Binomial(40, 0.5): mean 20, σ ≈ 3.2
        # A control answer's logprobs are the promoted adapter's, not the lineage's.
        rec = next(rec for _, arm, _, rec in served if arm == "control")
        ref = peft_logprobs(
            model_dir, folders[promoted_v], rec["prompt_token_ids"], rec["response_token_ids"]
        )
        assert max_gap(rec["rollout_logprobs"], ref) < 1e-4
        metrics = (await http.get("/metrics")).text
        assert f'saoserve_canary_requests_total{{arm="canary"}} {float(n_canary)}' in metrics
        # The lineage is promoted: the split ends and the held adapter is let go.
        r = await http.post("/admin/lifecycle/promote", json={"version": canary_v}, headers=ADMIN)
        assert r.status_code == 200
        for _ in range(400):
            if (await http.get("/admin/lifecycle", headers=ADMIN)).json()["split"] is None:
                break
            await asyncio.sleep(0.05)
        r = await http.post("/v1/chat/completions", json=body | {"seed": 99})
        rec = (await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)).json()
        assert (r.json()["policy_version"], rec["arm"]) == (canary_v, None)
        await eng.removals_done()
        assert eng.adapters.find(promoted_v) is None


@contextlib.contextmanager
def serving_tenants(eng, tenants: list[str]):
    """The module's engine serving tenant policies ``tenants`` for one test: its
    ``tenant_names`` set (unchecked: its 3 slots are fewer than two a policy, enough here; not
    ``add_policy``, which would recount the slots' shares), and, after, every tenant adapter
    removed and the tenants' served versions forgotten, so the tests after it find the engine
    as before."""
    old = eng.tenant_names
    eng.tenant_names = list(tenants)
    try:
        yield
    finally:
        eng.tenant_names = old
        for t in tenants:
            # The table's own removal, as the shares were never recounted.
            eng._remove_later(eng.adapters.clear_current(t))
            eng._tenant_served.pop(t, None)
            eng._views.pop(t, None)


@pytest.mark.engine
async def test_two_policies_in_one_batch_are_each_served_by_their_own_adapter(
    lora_engine, adapters, model_dir
):
    eng = lora_engine
    with serving_tenants(eng, ["acme"]):
        acme = eng.view("acme")
        v = eng.version + 1
        await eng.swap(v, *adapters["a"])
        await acme.swap(1, *adapters["b"])  # below the global version: a lineage of its own
        await eng.removals_done()
        assert (eng.version, acme.version) == (v, 1) and eng.adapters.occupied() == 2
        seeds = [51, 52]
        alone = [await answer(eng, s) for s in seeds] + [await answer(acme, s) for s in seeds]
        started = [asyncio.Event() for _ in range(4)]
        views = [eng, eng, acme, acme]
        runs = [
            asyncio.create_task(answer(view, s, started=e))
            for view, s, e in zip(views, seeds + seeds, started, strict=True)
        ]
        await asyncio.gather(*(e.wait() for e in started))
        assert not any(t.done() for t in runs)  # all four in flight at once: batched together
        together = await asyncio.gather(*runs)
        for i, ((ids, lps, spans), (ids2, lps2, spans2)) in enumerate(zip(alone, together, strict=True)):
            version = v if i < 2 else 1
            assert ids2 == ids and spans == spans2 == [(version, 0, 24)]
            assert max_gap(lps, lps2) < 1e-4
        # acme's answer is adapter b's (PEFT on b's files), not the global a's.
        prompt = eng.render(PROMPT)
        ids, lps, _ = together[2]
        assert max_gap(lps, peft_logprobs(model_dir, adapters["b"][0], prompt, ids)) < 1e-4
        assert max_gap(lps, peft_logprobs(model_dir, adapters["a"][0], prompt, ids)) > 1e-2
    await eng.removals_done()
    assert eng.adapters.occupied() == 1 and eng.adapters.current.version == v


@pytest.mark.engine
async def test_a_tenant_without_an_adapter_gets_the_base_and_full_weights_are_refused(lora_engine, model_dir):
    from server.engine import SwapRefused

    eng = lora_engine
    v = eng.version
    with serving_tenants(eng, ["beta"]):
        beta = eng.view("beta")
        assert (beta.version, beta.path, beta.weights_version) == (0, model_dir, 0)
        prompt = beta.render(PROMPT)
        sampling = SamplingRecord(temperature=1.0, max_tokens=16, seed=61)
        deltas = [d async for d in beta.generate(prompt, sampling, ignore_eos=True)]
        ids = [t for d in deltas for t in d.token_ids]
        lps = [x for d in deltas for x in d.logprobs]
        assert {d.version for d in deltas} == {0} and deltas[-1].weight_versions == [(0, 0, 16)]
        assert max_gap(lps, peft_logprobs(model_dir, None, prompt, ids)) < 1e-4
        # The base model as a new global version: full weights, refused with tenants served.
        with pytest.raises(SwapRefused, match="holds no adapter: with tenant policies \\(beta\\)"):
            await eng.swap(v + 1, model_dir, weights_sha256(model_dir))
        assert eng.version == v and eng.weights_path == model_dir
        _, _, spans = await answer(eng, seed=3, max_tokens=8)
        assert spans == [(v, 0, 8)]  # the global adapter serves on
