"""The engine's policies over a stand-in for vLLM (issue 20, server side; docs/tenants.md):
each policy swaps and serves its own versions over one adapter table, full weights are refused
while tenant policies are served, the watcher and a hold work on a tenant's view, and the
engine's close waits for the load in flight. No engine: ``StandInLLM`` records what vLLM was
asked; the adapters are the toy model's (``tests.test_adapter_serving``).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from core.records import SamplingRecord
from core.settings import SLOTS_PER_POLICY, AdapterServing
from core.weights import weights_sha256
from server.adapters import AdapterTable
from testing.adapters import toy_layout, write_toy_adapter
from testing.servers import make_settings


class StandInLLM:
    """The part of vLLM's ``AsyncLLM`` an adapter engine calls: ``add_lora`` / ``remove_lora``
    (recorded by name and id) and ``generate`` (two tokens, recording the LoRA name served).
    Anything else (a pause, a reload) fails on AttributeError."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.removed: list[int] = []
        self.served: list[str | None] = []

    async def add_lora(self, request) -> bool:
        self.added.append(request.lora_name)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True

    async def generate(self, prompt, params, request_id, lora_request=None):
        from types import SimpleNamespace

        self.served.append(None if lora_request is None else lora_request.lora_name)
        span = SimpleNamespace(version="0", start=0, end=2)
        out = SimpleNamespace(
            token_ids=[7, 8], logprobs=None, text="hi", finish_reason="length", weight_versions=[span]
        )
        yield SimpleNamespace(outputs=[out])


def standin_engine(tmp_path: Path, tenants: list[str]):
    """A LoRA ``PolicyEngine`` on the toy layout over ``StandInLLM``, serving ``tenants``."""
    from server.engine import PolicyEngine

    base = tmp_path / "base"
    work = tmp_path / "work"
    work.mkdir()
    slots = SLOTS_PER_POLICY * (len(tenants) + 1)
    settings = make_settings(
        tmp_path, adapter_serving=AdapterServing.ADAPTER, max_cpu_loras=slots, tenant_policies=tenants
    )
    return PolicyEngine(
        settings=settings,
        model_dir=base,
        engine=StandInLLM(),
        path=base,
        layout=toy_layout(),
        weights_path=base,
        adapters=AdapterTable(slots),
        work_dir=work,
    )


TWO_TOKENS = SamplingRecord(temperature=1.0, max_tokens=2)


async def served(view) -> tuple[int, list]:
    """One request through ``view``: the version its delta carries and its spans."""
    deltas = [d async for d in view.generate([1, 2], TWO_TOKENS)]
    return deltas[-1].version, deltas[-1].weight_versions


async def test_each_policy_swaps_and_serves_its_own_versions_over_one_table(tmp_path):
    from core.policies import GLOBAL
    from server.engine import SwapRefused, UnknownPolicy

    eng = standin_engine(tmp_path, ["acme", "beta"])
    llm = eng.engine
    x = write_toy_adapter(tmp_path / "x")
    y = write_toy_adapter(tmp_path / "y", alpha=8)
    sx, sy = weights_sha256(x), weights_sha256(y)
    acme, beta, glob = eng.view("acme"), eng.view("beta"), eng.view(GLOBAL)
    assert (acme.version, acme.path, acme.weights_version) == (0, eng.model_dir, 0)
    await eng.swap(3, x, sx)
    await acme.swap(1, y, sy)
    # Versions only go forward per policy: acme's 2 is below the global 3, and loads.
    await acme.swap(2, x, sx)
    with pytest.raises(SwapRefused, match="older than the adapter serving \\(version 2\\) of policy 'acme'"):
        await acme.swap(1, y, sy)
    await glob.swap(3, x, sx)  # the same version and checksum: nothing loads
    assert llm.added == ["policy-v3-1", "policy-acme-v1-2", "policy-acme-v2-3"]
    await eng.removals_done()
    assert llm.removed == [2]  # acme's version 1, unused; never the global current one
    assert (eng.version, eng.path, glob.version, glob.path) == (3, x, 3, x)
    assert (acme.version, acme.path, beta.version, beta.path) == (2, x, 0, eng.model_dir)
    assert glob.adapters.current is eng.adapters.current and acme.adapters.current.name == "policy-acme-v2-3"
    # Each policy's request gets its own adapter; beta has none: the base weights, version 0.
    assert await served(glob) == (3, [(3, 0, 2)])
    assert await served(acme) == (2, [(2, 0, 2)])
    assert await served(beta) == (0, [(0, 0, 2)])
    assert llm.served == ["policy-v3-1", "policy-acme-v2-3", None]
    # Dispatched at version 0 (a tenant's base), acme's request is served by the base.
    deltas = [d async for d in acme.generate([1], TWO_TOKENS, version=0)]
    assert deltas[-1].version == 0 and llm.served[-1] is None
    for call in (
        lambda: eng.view("zeta"),
        lambda: eng.pin(3, policy="zeta"),
        lambda: eng.version_of("zeta"),
    ):
        with pytest.raises(UnknownPolicy, match="no policy named 'zeta' \\(policies: global, acme, beta\\)"):
            call()
    with pytest.raises(UnknownPolicy):
        await eng.swap(1, x, sx, policy="zeta")
    with pytest.raises(UnknownPolicy):
        await anext(eng.generate([1], TWO_TOKENS, policy="zeta"))


class GatedLLM(StandInLLM):
    """A ``StandInLLM`` whose ``add_lora`` waits for ``gate`` (``entered`` set on arrival) and
    whose ``shutdown`` is recorded in order with the loads it saw finish."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.gate = asyncio.Event(), asyncio.Event()
        self.events: list[str] = []

    async def add_lora(self, request) -> bool:
        self.entered.set()
        await self.gate.wait()
        self.events.append(f"added {request.lora_name}")
        return await super().add_lora(request)

    def shutdown(self) -> None:
        self.events.append("shutdown")


async def test_close_waits_for_the_load_in_flight_and_refuses_later_ones(tmp_path):
    """The CI failure of 2026-12-03: a replica's lifespan shut vLLM down while a shielded swap
    (its watcher's, cancelled) was mid-reload, and the swap died on ``None.pause_generation``.
    ``close`` shuts down only once that load has ended; a load asked for after it is refused."""
    from server.engine import SwapRefused

    eng = standin_engine(tmp_path, ["acme"])
    llm = eng.engine = GatedLLM()
    x = write_toy_adapter(tmp_path / "x")
    caller = asyncio.create_task(eng.swap(1, x, weights_sha256(x)))
    await llm.entered.wait()
    caller.cancel()  # the watcher's task, cancelled at shutdown; the swap itself is shielded
    closing = asyncio.create_task(eng.close())
    await asyncio.sleep(0.05)
    assert llm.events == [] and not closing.done()
    llm.gate.set()
    await closing
    assert llm.events == ["added policy-v1-1", "shutdown"]
    assert eng.engine is None and not eng.work_dir.exists()
    with pytest.raises(SwapRefused, match="the engine is shutting down: no version is loaded"):
        await eng.swap(2, x, weights_sha256(x))


async def test_full_weights_are_refused_for_every_policy_while_tenant_policies_are_served(tmp_path):
    from server.engine import SwapRefused

    eng = standin_engine(tmp_path, ["acme"])
    full = tmp_path / "full"
    full.mkdir()
    save_file({"model.norm.weight": torch.ones(3)}, full / "model.safetensors")
    sha = weights_sha256(full)
    why = "holds no adapter: with tenant policies \\(acme\\) every policy's versions are LoRA adapters"
    with pytest.raises(SwapRefused, match=f"version 1 of policy 'global' at {full} {why}"):
        await eng.swap(1, full, sha)
    with pytest.raises(SwapRefused, match=f"version 1 of policy 'acme' at {full} {why}"):
        await eng.view("acme").swap(1, full, sha)
    with pytest.raises(SwapRefused, match="holds no adapter"):  # nothing there at all
        await eng.swap(1, tmp_path / "pruned", sha)
    # Refused before any pause or reload (the stand-in has neither) and nothing changed.
    assert (eng.version, eng.weights_path, eng.weights_version) == (0, eng.model_dir, 0)
    assert eng.engine.added == [] and eng.adapters.occupied() == 0


async def test_the_watcher_and_a_hold_work_unchanged_on_a_tenant_view(tmp_path):
    from core.records import PolicyEvent
    from server.metrics import ServerMetrics
    from server.policy_watch import PolicyWatcher

    eng = standin_engine(tmp_path, ["acme"])
    x = write_toy_adapter(tmp_path / "x")
    acme = eng.view("acme")
    watcher = PolicyWatcher(None, acme, ServerMetrics(), poll_s=1.0)
    event = PolicyEvent(version=4, path=str(x), sha256=weights_sha256(x), created_at=datetime.now(UTC))
    assert await watcher.apply(event) is True
    assert await watcher.apply(event) is False  # served already (same version and path)
    assert (acme.version, eng.version) == (4, 0)
    # A canary hold of acme's version 2 beside its current 4: pinned, never current; let go.
    await acme.hold(2, x, weights_sha256(x))
    held = acme.adapters.find(2)
    assert held.pinned and acme.adapters.current.version == 4 and eng.adapters.find(2) is None
    acme.pin(2, pinned=False)
    await acme.removals_done()
    assert eng.engine.removed == [held.lora_id] and acme.adapters.find(2) is None


async def test_a_tenant_policy_added_and_removed_at_run_time(tmp_path):
    """``add_policy``: served at version 0, the slots' shares recounted; ``remove_policy``: its
    view gone, its current adapter removed from vLLM, the shares recounted back."""
    from server.engine import UnknownPolicy

    eng = standin_engine(tmp_path, ["acme"])  # 6 slots
    x = write_toy_adapter(tmp_path / "x")
    await eng.add_policy("zeta")
    assert eng.policies == ["global", "acme", "zeta"] and eng.adapters.quota == 2  # 6 // 3
    zeta = eng.view("zeta")
    assert zeta.version == 0
    await zeta.swap(1, x, weights_sha256(x))
    assert eng.engine.added == ["policy-zeta-v1-1"] and zeta.version == 1
    await eng.remove_policy("zeta")
    await eng.removals_done()
    assert eng.engine.removed == [1] and eng.adapters.occupied() == 0
    assert eng.policies == ["global", "acme"] and eng.adapters.quota == 3
    with pytest.raises(UnknownPolicy, match="no policy named 'zeta'"):
        eng.view("zeta")
    # Added again, it starts at the base weights (its watcher catches up from its topic).
    await eng.add_policy("zeta")
    assert eng.view("zeta").version == 0
    with pytest.raises(UnknownPolicy, match="the global policy is always served"):
        await eng.remove_policy("global")


async def test_a_tenant_removed_while_its_swap_is_in_flight_leaves_no_adapter_behind(tmp_path):
    """The review's race: zeta's watcher is cancelled mid-load (the swap is shielded and goes on)
    and zeta removed; before the fix the load then made its adapter zeta's current one and put
    zeta's served version back, so the slot stayed taken for good. The removal now waits for
    the load in flight and then drops it: vLLM is asked to remove it (id 1), no slot is taken."""
    eng = standin_engine(tmp_path, ["acme"])  # 6 slots
    llm = eng.engine = GatedLLM()
    x = write_toy_adapter(tmp_path / "x")
    await eng.add_policy("zeta")
    caller = asyncio.create_task(eng.view("zeta").swap(1, x, weights_sha256(x)))
    await llm.entered.wait()
    caller.cancel()  # the watcher's task, cancelled by TenantPolicySync.close
    removal = asyncio.create_task(eng.remove_policy("zeta"))
    await asyncio.sleep(0.05)
    # Its requests and loads are refused from the call on; the table waits for the load.
    assert eng.policies == ["global", "acme"] and not removal.done()
    llm.gate.set()
    await removal
    await eng.removals_done()
    assert llm.added == ["policy-zeta-v1-1"] and llm.removed == [1]
    assert eng.adapters.occupied() == 0 and eng.adapters.current_of("zeta") is None
    assert "zeta" not in eng._tenant_served and eng.adapters.quota == 3  # 6 // 2 again
    # Added again, it starts from the base weights, its slots all free.
    await eng.add_policy("zeta")
    assert eng.view("zeta").version == 0 and eng.adapters.quota == 2


async def test_a_load_of_a_tenant_waiting_for_the_lock_when_it_is_removed_is_refused(tmp_path):
    """zeta's swap and canary hold wait behind the global policy's load; zeta is removed
    meanwhile: both find it gone under the lock (UnknownPolicy) and load nothing."""
    from server.engine import UnknownPolicy

    eng = standin_engine(tmp_path, ["acme"])
    llm = eng.engine = GatedLLM()
    x = write_toy_adapter(tmp_path / "x")
    sx = weights_sha256(x)
    await eng.add_policy("zeta")
    zeta = eng.view("zeta")
    first = asyncio.create_task(eng.swap(1, x, sx))
    await llm.entered.wait()
    swap = asyncio.create_task(zeta.swap(2, x, sx))
    hold = asyncio.create_task(zeta.hold(1, x, sx))
    removal = asyncio.create_task(eng.remove_policy("zeta"))
    await asyncio.sleep(0.05)
    llm.gate.set()
    await asyncio.gather(first, removal)
    for waiting in (swap, hold):
        with pytest.raises(UnknownPolicy, match="no policy named 'zeta' \\(policies: global, acme\\)"):
            await waiting
    await eng.removals_done()
    assert llm.added == ["policy-v1-1"] and llm.removed == [] and eng.adapters.occupied() == 1


async def test_no_tenant_policy_is_added_while_the_global_policy_serves_full_weights(tmp_path):
    """Review item 8: the global policy's full weights replace the base that tenant adapters
    apply to; a tenant added then would have its adapters refused and would refuse the global
    policy's next full version. ``add_policy`` refuses it, nothing changed; at the base it adds."""
    from server.engine import TenantPolicyRefused

    eng = standin_engine(tmp_path, ["acme"])  # 6 slots
    await eng.remove_policy("acme")  # no tenant policy: full weights may load
    assert eng.tenant_policy_refusal() is None
    full = tmp_path / "full"
    eng.weights_path, eng.weights_version = full, 5  # what a reload of version 5 leaves
    why = (
        f"the global policy serves the full weights of its version 5 ({full}), and tenant policies "
        "are LoRA adapters over the base weights; publish the global policy's versions as adapters "
        "(saoserve learn --policy lora), and once its newest version is one, restart the servers "
        "(they start at the base weights) and add the tenant policy"
    )
    assert eng.tenant_policy_refusal() == why
    with pytest.raises(TenantPolicyRefused) as refused:
        await eng.add_policy("zeta")
    assert str(refused.value) == why
    assert eng.policies == ["global"] and eng.adapters.quota == 6
    eng.weights_path = eng.model_dir
    await eng.add_policy("zeta")
    assert eng.policies == ["global", "zeta"] and eng.adapters.quota == 3  # 6 // 2
