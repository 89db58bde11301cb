"""Adapter slots that cannot be starved (issue 40 item 4): a request holds its adapter while vLLM
generates, not while the client reads; each policy has its share of the slots; a version refused
for lack of a slot is loaded once one frees, and ``/readyz``'s policy part recovers by itself.

The real ``PolicyEngine`` and ``PolicyWatcher`` over a stand-in for vLLM (what it was asked; two
tokens an answer) and the SQL-table log on SQLite (the real engine: issue 40's scenario in
tests/integration/test_rejected_serving.py).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from core.db import migrate
from core.logbus import open_log
from core.policy_store import ADAPTER_CONFIG, ADAPTER_FILE
from core.records import TOPIC_POLICY, PolicyEvent, SamplingRecord
from core.settings import AdapterServing
from core.weights import TensorSpec, WeightsLayout, weights_sha256
from server.adapters import AdapterTable, TableFull
from server.engine import PolicyEngine, SlotsTaken
from server.metrics import ServerMetrics
from server.policy_watch import PolicyWatcher
from testing.servers import make_settings

TWO_TOKENS = SamplingRecord(temperature=1.0, max_tokens=2)


class StandInLLM:
    """vLLM's ``add_lora`` / ``remove_lora`` (recorded) and ``generate``: two deltas of one
    token; while ``gate`` is clear, the second waits for it (a generation still running)."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.removed: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def add_lora(self, request) -> bool:
        self.added.append(request.lora_name)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True

    async def generate(self, prompt, params, request_id, lora_request=None):
        for n, token in enumerate((7, 8), start=1):
            if n == 2:
                await self.gate.wait()
            out = SimpleNamespace(
                token_ids=[token],
                logprobs=None,
                text="x",
                finish_reason="length" if n == 2 else None,
                weight_versions=[SimpleNamespace(version="0", start=0, end=n)] if n == 2 else None,
            )
            yield SimpleNamespace(outputs=[out])


def toy_adapter(folder: Path, alpha: int) -> tuple[Path, str]:
    """A rank-2 LoRA on the toy model's q_proj; ``alpha`` makes each folder's checksum its own."""
    folder.mkdir(parents=True)
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{pre}.lora_A.weight": torch.ones(2, 3), f"{pre}.lora_B.weight": torch.ones(4, 2)},
        folder / ADAPTER_FILE,
    )
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": alpha, "target_modules": ["q_proj"], "bias": "none"}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    return folder, weights_sha256(folder)


def engine_with(tmp_path: Path, slots: int) -> PolicyEngine:
    """A LoRA engine on a three-tensor toy layout with ``slots`` adapter slots, over ``StandInLLM``."""
    base, work = tmp_path / "base", tmp_path / "work"
    work.mkdir()
    layout = WeightsLayout(
        tensors={
            "model.layers.0.self_attn.q_proj.weight": TensorSpec("F32", (4, 3)),
            "model.layers.0.mlp.up_proj.weight": TensorSpec("F32", (5, 3)),
            "model.norm.weight": TensorSpec("F32", (3,)),
        },
        optional={},
        dtypes=frozenset({"F32"}),
    )
    settings = make_settings(
        tmp_path, adapter_serving=AdapterServing.ADAPTER, max_loras=1, max_cpu_loras=slots
    )
    return PolicyEngine(
        settings=settings,
        model_dir=base,
        engine=StandInLLM(),
        path=base,
        layout=layout,
        weights_path=base,
        adapters=AdapterTable(slots),
        work_dir=work,
    )


async def settle(engine: PolicyEngine) -> None:
    """Let the tasks already started run to their ends (the drain of a generation, removals)."""
    for _ in range(20):
        await asyncio.sleep(0)
    await engine.removals_done()


async def test_a_slow_reader_holds_no_slot(tmp_path):
    """Two slots. A client reads the first token of an answer by version 1 and then nothing
    more. Before the fix its request held version 1's adapter until the client read on, so with
    version 2 current both slots were taken and version 3 was refused ("all 2 adapter slots are
    taken"). Now the adapter is let go when vLLM has generated the answer: 1 is removed, 3 loads
    (slots: 2 and 3), and the reader still gets its second token."""
    eng = engine_with(tmp_path, slots=2)
    folders = {v: toy_adapter(tmp_path / f"v{v}", alpha=v + 1) for v in (1, 2, 3)}
    await eng.swap(1, *folders[1])
    reader = eng.generate([1, 2], TWO_TOKENS)
    first = await anext(reader)
    assert (first.token_ids, first.version) == ([7], 1)
    await settle(eng)
    assert eng.adapters.find(1).users == 0
    await eng.swap(2, *folders[2])
    await settle(eng)
    await eng.swap(3, *folders[3])
    assert (eng.version, sorted(a.version for a in eng.adapters.adapters.values())) == (3, [3])
    rest = [d async for d in reader]
    assert [d.token_ids for d in rest] == [[8]] and rest[-1].version == 1


async def test_a_reader_that_leaves_aborts_and_releases(tmp_path):
    """A client gone after the first token while vLLM still generates: the generation is
    cancelled (vLLM aborts it) and the adapter let go: users 0."""
    eng = engine_with(tmp_path, slots=2)
    await eng.swap(1, *toy_adapter(tmp_path / "v1", alpha=2))
    eng.engine.gate.clear()
    reader = eng.generate([1, 2], TWO_TOKENS)
    await anext(reader)
    assert eng.adapters.find(1).users == 1  # still generating
    await reader.aclose()
    await settle(eng)
    assert eng.adapters.find(1).users == 0


def test_each_policy_has_its_share_of_the_slots():
    """Six slots, two policies: 6 // 2 = 3 each. acme's fourth load is refused while slots are
    free, so the global policy still gets its three."""
    table = AdapterTable(6, policies=2)
    for _ in range(3):
        table.reserve("acme")
    with pytest.raises(TableFull, match="policy 'acme' has all its 3 of the 6 adapter slots taken"):
        table.reserve("acme")
    assert [table.reserve() for _ in range(3)] == [4, 5, 6]
    with pytest.raises(TableFull, match="all 6 adapter slots are taken"):
        table.reserve("beta")
    with pytest.raises(ValueError, match="at least one slot a policy, not 2 for 3 policies"):
        AdapterTable(2, policies=3)


async def test_a_version_refused_for_a_slot_loads_when_one_frees(tmp_path):
    """Two slots. Version 1 serves a request that is still generating; version 2 loads (slots:
    1 in use, 2 current); version 3 is refused for lack of a slot and /readyz's policy part says
    "behind". Before the fix it stayed so until another version was published. Now, once the
    request ends (1 is removed), the next poll loads 3 with no new event: "ok"."""
    eng = engine_with(tmp_path, slots=2)
    url = f"sqlite:///{tmp_path}/log.db"
    migrate(url)
    log = open_log(url)
    watcher = PolicyWatcher(log, eng, ServerMetrics(), poll_s=0.01)
    folders = {v: toy_adapter(tmp_path / "policies" / f"v{v}", alpha=v + 1) for v in (1, 2, 3)}

    def publish(v: int) -> None:
        path, sha = folders[v]
        event = PolicyEvent(
            version=v, path=str(path), sha256=sha, created_at=datetime.now(UTC), parent_version=v - 1
        )
        log.append(TOPIC_POLICY, "policy", event.to_json())

    await watcher.catch_up()
    publish(1)
    await watcher.poll()
    eng.engine.gate.clear()
    reader = eng.generate([1, 2], TWO_TOKENS)
    await anext(reader)  # in flight on version 1
    publish(2)
    await watcher.poll()
    publish(3)
    await watcher.poll()
    assert eng.version == 2
    assert watcher.readiness() == (
        "behind: serves version 2, the policy topic's newest is 3 (its swap was refused; see the server's log)"
    )
    await watcher.poll()  # a slot is still taken: refused again, quietly
    assert eng.version == 2
    eng.engine.gate.set()
    assert [d.token_ids async for d in reader] == [[8]]
    await settle(eng)
    await watcher.poll()
    assert (eng.version, watcher.readiness()) == (3, "ok")
    assert watcher.metrics.swaps.labels("refused")._value.get() == 1
    log.close()


def test_slots_taken_is_a_refusal():
    assert issubclass(SlotsTaken, Exception) and SlotsTaken.__mro__[1].__name__ == "SwapRefused"
