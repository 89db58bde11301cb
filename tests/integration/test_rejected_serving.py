"""On the real engine serving LoRA adapters (issue 40 items 3 and 4): a rejected version never
gets a new request, with no learner running; rejecting a promoted version takes its descendants
and serves the newest promoted version left; a slow reader keeps no adapter slot and the next
version loads. On the session's engine of full weights (adapters merged): a rejected version is
left at once for the newest not rejected, with no learner running.

One LoRA-enabled vLLM engine for the module (3 slots, 2 per batch, rank ≤ 16), the real app on
PostgreSQL, adapters written with PEFT on the real model. Run under the machine-wide lock:
``flock /tmp/saoserve-engine.lock pytest tests/integration/test_rejected_serving.py``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import insert, select

from core.db import PolicyVersion, make_engine
from core.logbus import open_log
from core.policy_store import version_dir
from core.records import TOPIC_POLICY, PolicyEvent, utcnow
from core.settings import AdapterServing
from core.weights import weights_sha256
from testing.servers import ADMIN, make_settings, running_server

pytestmark = [pytest.mark.integration, pytest.mark.engine]

PROMPT = [{"role": "user", "content": "Write two sentences about the sea."}]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> list[tuple[Path, str]]:
    """Four rank-8 PEFT adapters on the real model (A, B random, B ≠ 0): (folder, sha256)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(MODULES)))
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(4):
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        peft.save_pretrained(root / f"a{i}")
        out.append((root / f"a{i}", weights_sha256(root / f"a{i}")))
    return out


@pytest.fixture(scope="module")
async def lora_engine(model_dir, tmp_path_factory):
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


def record(url: str, rows: list[tuple[int, Path, str, str, int | None]]) -> None:
    """``policy_versions`` rows (version, folder, sha256, stage, parent), as the learner writes them."""
    db = make_engine(url)
    with db.begin() as conn:
        known = set(conn.execute(select(PolicyVersion.version)).scalars())
        for v, path, sha, stage, parent in rows:
            if v in known:
                continue
            conn.execute(
                insert(PolicyVersion).values(
                    version=v,
                    path=str(path),
                    sha256=sha,
                    status="published",
                    parent_version=parent,
                    metrics={},
                    created_at=utcnow(),
                    lifecycle=stage,
                )
            )
    db.dispose()


async def publish(settings, v: int, folder: Path, sha: str, parent: int, stage: str = "canary") -> None:
    event = PolicyEvent(
        version=v,
        path=str(folder),
        sha256=sha,
        created_at=datetime.now(UTC),
        parent_version=parent,
        lifecycle=stage,
    )
    log = open_log(settings.resolved_log_url)
    await asyncio.to_thread(log.append, TOPIC_POLICY, "policy", event.to_json())
    log.close()


async def until(check, what: str, tries: int = 600) -> None:
    """Wait (0.05 s a try) until ``check()`` is true; fail naming ``what`` otherwise."""
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"never: {what}")


async def served_versions(http: httpx.AsyncClient, n: int, tag: str) -> list[tuple[int, str | None]]:
    """``n`` chats from ``n`` users: each answer's (policy_version, arm)."""
    out = []
    for i in range(n):
        body = {"messages": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": i, "user": f"{tag}{i}"}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        rec = (await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)).json()
        out.append((r.json()["policy_version"], rec["arm"]))
    return out


async def test_rejections_with_no_learner_send_every_request_to_the_promoted_version_left(
    lora_engine, adapters, model_dir, tmp_path, pg_url
):
    """Versions P1, P2 promoted (P2 trained from P1), C on canary (trained from P2), share 0.5,
    no learner. (1) Rejecting C: 50 of 50 requests go to P2, none to C (before: 50 of 50 to C,
    ``split: null``). (2) Rejecting promoted P2 rejects C with it (its descendant) and makes P1
    the control: 30 of 30 requests go to P1 (before: 30 of 30 to the newest descendant)."""
    eng = lora_engine
    await eng.removals_done()
    settings = make_settings(tmp_path, database_url=pg_url, policy_poll_s=0.05)
    p1, p2, c = eng.version + 1, eng.version + 2, eng.version + 3
    folders = {}
    for v, (src, _) in zip((p1, p2, c), adapters, strict=False):
        folders[v] = version_dir(tmp_path / "policies", v)
        shutil.copytree(src, folders[v])
    shas = {v: adapters[i][1] for i, v in enumerate((p1, p2, c))}
    async with running_server(settings, eng) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        record(
            settings.resolved_database_url,
            [
                (0, model_dir, weights_sha256(model_dir), "promoted", None),
                (p1, folders[p1], shas[p1], "promoted", 0),
                (p2, folders[p2], shas[p2], "promoted", p1),
                (c, folders[c], shas[c], "canary", p2),
            ],
        )
        await publish(settings, c, folders[c], shas[c], p2)
        r = await http.post("/admin/lifecycle/canary", json={"share": 0.5}, headers=ADMIN)
        assert r.status_code == 200

        async def split_on() -> bool:
            split = (await http.get("/admin/lifecycle", headers=ADMIN)).json()["split"]
            return split == {"lineage": [c], "control": p2, "share": 0.5} and eng.version == c

        await until(split_on, "the split of C against P2")
        before = await served_versions(http, 20, "a")
        assert {a for _, a in before} == {"canary", "control"}

        r = await http.post(
            "/admin/lifecycle/reject", json={"version": c}, headers=ADMIN | {"X-Operator": "alice"}
        )
        assert r.status_code == 200 and r.json()["versions"] == [c]
        assert await served_versions(http, 50, "b") == [(p2, None)] * 50

        r = await http.post("/admin/lifecycle/reject", json={"version": p2}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["versions"] == [p2]  # C is rejected already
        assert await served_versions(http, 30, "c") == [(p1, None)] * 30
        state = (await http.get("/admin/lifecycle", headers=ADMIN)).json()
        assert (state["promoted"], state["lineage"], state["split"]) == (p1, [], None)


async def slow_reader(url: str, body: dict) -> asyncio.StreamWriter:
    """Send a streamed chat on a connection that then stops reading after the first bytes of the
    answer: a 4 KiB socket buffer and a 1 KiB stream buffer, so once about 100 KiB are in
    flight (those buffers and the server's) the server cannot write more. Returns the writer
    (closing it ends the connection)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    await reader.read(256)  # the first bytes of the stream, then nothing more
    return writer


async def test_slow_readers_hold_no_slot_and_the_next_version_loads(lora_engine, adapters, tmp_path, pg_url):
    """Three slots. Two streams (256 tokens, 20 top logprobs a token: about 400 KiB of events)
    are opened on two versions by clients that stop reading after the first bytes; two more
    versions are published: the newest serves and /readyz is 200 while both clients still read
    nothing. On this machine this passes before the fix too: the server's socket send buffer
    (autotuned up to 4 MiB on loopback, ``net.ipv4.tcp_wmem``) takes the whole answer, so the
    generation ends whatever the client reads. The case the fix is for, a reader that holds the
    generator back, is tests/unit/server/test_slots.py's (it fails before the fix)."""
    eng = lora_engine
    await eng.removals_done()
    settings = make_settings(tmp_path, database_url=pg_url, policy_poll_s=0.05)
    base = eng.version
    vs = [base + 1 + i for i in range(4)]
    folders = {}
    for v, (src, sha) in zip(vs, adapters, strict=True):
        folders[v] = (version_dir(tmp_path / "policies", v), sha)
        shutil.copytree(src, folders[v][0])
    body = {
        "messages": PROMPT,
        "max_tokens": 256,
        "temperature": 1.0,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,
    }
    async with running_server(settings, eng) as url, httpx.AsyncClient(base_url=url, timeout=300) as http:
        clients = []
        for i, v in enumerate(vs[:2]):
            await publish(settings, v, *folders[v], v - 1)

            async def serves(v: int = v) -> bool:
                return eng.version == v

            await until(serves, f"version {v} loaded")
            clients.append(await slow_reader(url, body | {"seed": i}))
        for v in vs[2:]:
            await publish(settings, v, *folders[v], v - 1)

            async def loaded(v: int = v) -> bool:
                ready = await http.get("/readyz")
                return eng.version == v and ready.status_code == 200

            await until(loaded, f"version {v} loaded and /readyz 200", tries=2400)
        assert eng.version == vs[-1]
        for writer in clients:
            writer.close()


async def test_a_version_refused_for_a_slot_loads_once_generations_end(
    lora_engine, adapters, tmp_path, pg_url
):
    """Three slots. Two generations of 512 tokens run on versions 1 and 2 (the engine's own
    ``generate`` with ``ignore_eos``: both run to 512 tokens, over 10 s on these CPUs); 3 loads
    (slots: 1, 2 in use, 3 current) and 4 is refused for lack of a slot (counted once). Before
    the fix /readyz then stayed 503 "behind" until another version was published; now the
    watcher tries 4 again at every poll: once both generations end, 4 serves and /readyz is 200
    with nothing published."""
    from core.records import SamplingRecord

    eng = lora_engine
    await eng.removals_done()
    settings = make_settings(tmp_path, database_url=pg_url, policy_poll_s=0.05)
    vs = [eng.version + 1 + i for i in range(4)]
    folders = {}
    for v, (src, sha) in zip(vs, adapters, strict=True):
        folders[v] = (version_dir(tmp_path / "policies", v), sha)
        shutil.copytree(src, folders[v][0])
    long = SamplingRecord(temperature=1.0, max_tokens=512, seed=1)

    async def generate(v: int) -> int:
        n = 0
        async for d in eng.generate(eng.render(PROMPT), long, version=v, ignore_eos=True):
            n += len(d.token_ids)
        return n

    async with running_server(settings, eng) as url, httpx.AsyncClient(base_url=url, timeout=300) as http:
        running = []
        for v in vs[:2]:
            await publish(settings, v, *folders[v], v - 1)

            async def serves(v: int = v) -> bool:
                return eng.version == v

            await until(serves, f"version {v} loaded")
            running.append(asyncio.ensure_future(generate(v)))
        await publish(settings, vs[2], *folders[vs[2]], vs[1])

        async def third() -> bool:
            return eng.version == vs[2]

        await until(third, f"version {vs[2]} loaded")
        await publish(settings, vs[3], *folders[vs[3]], vs[2])

        async def refused() -> bool:
            return 'saoserve_policy_swaps_total{result="refused"} 1.0' in (await http.get("/metrics")).text

        await until(refused, f"version {vs[3]} refused for lack of a slot")
        assert not any(t.done() for t in running)  # refused while both still generate
        assert (await http.get("/readyz")).status_code == 503
        assert await asyncio.gather(*running) == [512, 512]

        async def recovered() -> bool:
            return eng.version == vs[3] and (await http.get("/readyz")).status_code == 200

        await until(recovered, f"version {vs[3]} loaded and /readyz 200 with nothing published", tries=1200)
        metrics = (await http.get("/metrics")).text
        assert 'saoserve_policy_swaps_total{result="refused"} 1.0' in metrics


async def test_a_full_weight_replica_leaves_a_rejected_version_with_no_learner(
    policy_engine, adapters, model_dir, tmp_path, pg_url
):
    """The session's engine of full weights (adapters merged, the default): versions P promoted,
    C1 and C2 on probation (no split: full weights), C2 serving, no learner. (1) The operator
    rejects C1, C2 with it (its descendant): the replica swaps back to P, the newest version not
    rejected (the control), within a poll and a swap, and 20 of 20 chats then answer P (before: C2 served until
    a learner published the restore). (2) Rejecting P too: the base weights (version 0) serve,
    20 of 20; /readyz 200 throughout. The engine ends on the base weights it started from."""
    eng = policy_engine
    settings = make_settings(tmp_path, database_url=pg_url, policy_poll_s=0.05)
    p, c1, c2 = eng.version + 1, eng.version + 2, eng.version + 3
    folders, shas = {}, {}
    for v, (src, sha) in zip((p, c1, c2), adapters, strict=False):
        folders[v], shas[v] = version_dir(tmp_path / "policies", v), sha
        shutil.copytree(src, folders[v])
    async with running_server(settings, eng) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        record(
            settings.resolved_database_url,
            [
                (0, model_dir, weights_sha256(model_dir), "promoted", None),
                (p, folders[p], shas[p], "promoted", 0),
                (c1, folders[c1], shas[c1], "canary", p),
                (c2, folders[c2], shas[c2], "canary", c1),
            ],
        )
        for v, parent, stage in ((p, 0, "promoted"), (c1, p, "canary"), (c2, c1, "canary")):
            await publish(settings, v, folders[v], shas[v], parent, stage)

        def serves(version: int):
            async def check() -> bool:
                return eng.version == version

            return check

        await until(serves(c2), "C2 serving")
        assert {v for v, _ in await served_versions(http, 5, "a")} == {c2}

        r = await http.post("/admin/lifecycle/reject", json={"version": c1}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["versions"] == [c1, c2]
        await until(serves(p), "P serving after C1 and C2 were rejected")
        assert await served_versions(http, 20, "b") == [(p, None)] * 20
        assert (await http.get("/readyz")).status_code == 200

        r = await http.post("/admin/lifecycle/reject", json={"version": p}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["versions"] == [p]
        await until(serves(0), "the base weights serving after P was rejected")
        assert await served_versions(http, 20, "c") == [(0, None)] * 20
        assert (await http.get("/readyz")).status_code == 200
    assert eng.version == 0 and eng.path == model_dir
