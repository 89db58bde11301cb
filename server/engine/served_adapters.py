"""Adapters served as LoRA by the ``PolicyEngine`` (``AdapterServing.ADAPTER``): the slots of
the adapter table (``server.adapters``), each load staged and checked in ``work_dir`` and added
to vLLM with no pause, the adapter a starting request is served with, and the removals of the
adapters no longer used (docs/serving_adapters.md)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from core.policies import GLOBAL
from server.adapter_files import AdapterMismatch, AdapterSpec, check_adapter, stage
from server.adapters import Adapter, TableFull
from server.engine.types import SlotsTaken, SwapRefused, SwapResult
from server.grouped_lora import LoraOp

log = logging.getLogger(__name__)


class ServedAdapters:
    """``PolicyEngine``'s adapters served as LoRA: loads, the adapter a request is served with,
    removals, and the LoRA op of a CPU engine."""

    async def use_lora_op(self, op: LoraOp) -> LoraOp:
        """Serve LoRA with ``op`` from the engine's next step on (``server.grouped_lora``; the
        engine starts with ``GROUPED`` on CPUs; tests and benchmarks compare it with ``STOCK``).
        Returns the op in effect: vLLM's own, with a warning saying why, where the worker
        refuses the grouped one (a vLLM other than the pinned one, not a CPU engine;
        ``server.worker_ext``). Raises RuntimeError when adapters are not served as LoRA."""
        if self.adapters is None:
            raise RuntimeError("adapters are not served as LoRA by this engine")
        results = await self.engine.collective_rpc("use_lora_op", args=(op.value,))
        in_effect, why = results[0]
        self.lora_op = LoraOp(in_effect)
        if why:
            log.warning("LoRA is served by vLLM's own op, not the %s one: %s", op.value, why)
        else:
            log.info("LoRA is served by the %s op", self.lora_op.value)
        return self.lora_op

    def _acquire(self, version: int | None, policy: str) -> Adapter | None:
        """The adapter a starting request of ``policy`` dispatched at ``version`` is served with
        (None: the full weights), counted as used until ``release``."""
        if self.adapters is None:
            return None
        if version == self.weights_version_of(policy) and self.adapters.find(version, policy) is None:
            return None
        return self.adapters.acquire(version, policy)

    async def _add_adapter(self, version: int, path: Path, sha256: str, policy: str) -> SwapResult:
        t0 = time.perf_counter()
        async with self._loading(policy):
            cur = self.adapters.current_of(policy)
            if cur is not None and version < cur.version:
                raise SwapRefused(
                    f"version {version} is older than the adapter serving (version {cur.version})"
                    + ("" if policy == GLOBAL else f" of policy {policy!r}")
                )
            if cur is not None and cur.version == version and cur.sha256 == sha256:
                self._serve(policy, version, path)
                return SwapResult(version=version, seconds=time.perf_counter() - t0, paused_seconds=0.0)
            lora_id = await self._load_adapter(version, path, sha256, hold=False, policy=policy)
            t1 = time.perf_counter()
        log.info(
            "policy %s version %d (adapter %s) added as LoRA %d in %.3fs",
            policy,
            version,
            path,
            lora_id,
            t1 - t0,
        )
        return SwapResult(version=version, seconds=t1 - t0, paused_seconds=0.0)

    async def _load_adapter(self, version: int, path: Path, sha256: str, hold: bool, policy: str) -> int:
        """Stage, check and add the adapter of ``policy``'s ``version`` to vLLM under the swap
        lock; returns its vLLM id. ``hold``: pinned and never current (``hold``), else
        ``policy``'s current one unless a higher version of it is. Raises SwapRefused with its
        slot given back."""
        table = self.adapters
        if self.weights_path != self.model_dir:
            raise SwapRefused(
                f"adapter version {version} applies to the base model, and the engine serves the "
                f"full weights of {self.weights_path}"
            )
        if table.occupied() >= table.capacity or table.occupied(policy) >= table.quota:
            await self.removals_done()  # a slot being given back is a slot
        try:
            lora_id = table.reserve(policy)
        except TableFull as exc:
            raise SlotsTaken(f"adapter version {version} not loaded: {exc}") from exc
        staged = self.work_dir / f"adapter-{policy}-v{version}-{lora_id}"
        try:
            await asyncio.to_thread(self._stage_adapter, path, sha256, staged)
            request = lora_request(Adapter(version, lora_id, staged, sha256, policy=policy))
            try:
                added = await self.engine.add_lora(request)
            except Exception as exc:  # vLLM's own checks (PEFTHelper, shapes), raised back by its core
                raise SwapRefused(f"vLLM refused adapter version {version} at {path}: {exc}") from exc
            if not added:
                raise SwapRefused(f"vLLM did not add adapter version {version} (id {lora_id})")
        except BaseException:
            table.cancel(lora_id)
            shutil.rmtree(staged, ignore_errors=True)
            raise
        adapter, removable = table.loaded(lora_id, version, staged, sha256, hold=hold, policy=policy)
        if table.current_of(policy) is adapter:
            self._serve(policy, version, path)
        self._remove_later(removable)
        return lora_id

    def _stage_adapter(self, path: Path, sha256: str, staged: Path) -> AdapterSpec:
        """Copy the adapter at ``path`` to ``staged`` and check the copy (SwapRefused, nothing
        left behind, if it cannot be served)."""
        try:
            stage(path, staged, sha256)
            return check_adapter(staged, self.layout, self.settings.max_lora_rank)
        except AdapterMismatch as exc:
            shutil.rmtree(staged, ignore_errors=True)
            raise SwapRefused(str(exc)) from exc

    def _remove_later(self, adapters: list[Adapter]) -> None:
        """Remove ``adapters`` (already out of the table's use) from vLLM in a task of their own:
        a request's end, which frees them, may be a cancellation."""
        if adapters:
            task = asyncio.ensure_future(self._remove(adapters))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def _remove(self, adapters: list[Adapter]) -> None:
        for a in adapters:
            try:
                await self.engine.remove_lora(a.lora_id)
            except Exception:
                log.exception("removing adapter %s from vLLM failed", a.name)
            finally:
                shutil.rmtree(a.path, ignore_errors=True)
                self.adapters.removed(a.lora_id)
            log.info("adapter %s removed", a.name)

    async def removals_done(self) -> None:
        """Wait until every adapter removal under way has ended (tests, benchmarks, shutdown)."""
        while self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)


def lora_request(adapter: Adapter | None):
    """vLLM's ``LoRARequest`` for ``adapter`` (None for the base weights)."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.lora_id, str(adapter.path))
