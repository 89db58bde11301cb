"""Full-weight swaps of the ``PolicyEngine``: a version of full weights, or an adapter merged
into the base weights, reloaded in place in the paused engine (docs/design.md §7), the old
weights restored when the reload fails."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from pathlib import Path

from core.weights import WeightsMismatch, weights_sha256
from server.adapter_files import merge
from server.engine.types import SwapRefused, SwapResult

log = logging.getLogger(__name__)


class FullWeights:
    """``PolicyEngine``'s swaps of the full weights (of a full version, or of the merge of an
    adapter ``W + scale·B·A`` in ``work_dir``): checked before the engine pauses, reloaded while
    it is paused, stamped, resumed whatever fails."""

    async def _swap_full(self, version: int, path: Path, sha256: str, policy: str) -> SwapResult:
        t0 = time.perf_counter()
        async with self._loading(policy):
            self._no_full_weights_beside_tenants(version, path, policy, "holds no adapter")
            await asyncio.to_thread(self._check_weights, path, sha256)
            t1 = time.perf_counter()
            await self._paused_reload(version, path, path)
            t2 = time.perf_counter()
            if self.adapters is not None:
                self._remove_later(self.adapters.clear_current())
        log.info("policy version %d loaded from %s in %.2fs", version, path, t2 - t0)
        return SwapResult(version=version, seconds=t2 - t0, paused_seconds=t2 - t1)

    async def _swap_merged(self, version: int, path: Path, sha256: str, policy: str) -> SwapResult:
        t0 = time.perf_counter()
        async with self._loading(policy):
            self._no_full_weights_beside_tenants(
                version, path, policy, "is an adapter, and adapters are merged here"
            )
            name = f"v{version}-{uuid.uuid4().hex[:8]}"
            staged, merged = self.work_dir / f"adapter-{name}", self.work_dir / f"merged-{name}"
            try:
                await asyncio.to_thread(self._stage_and_merge, path, sha256, staged, merged)
                t1 = time.perf_counter()
                await self._paused_reload(version, path, merged)
            except BaseException:
                shutil.rmtree(merged, ignore_errors=True)
                raise
            finally:
                shutil.rmtree(staged, ignore_errors=True)
            t2 = time.perf_counter()
        log.info("policy version %d (adapter %s) merged and loaded in %.2fs", version, path, t2 - t0)
        return SwapResult(version=version, seconds=t2 - t0, paused_seconds=t2 - t1)

    def _no_full_weights_beside_tenants(self, version: int, path: Path, policy: str, what: str) -> None:
        """Under the swap lock: SwapRefused, before anything is read or paused, while tenant
        policies are served (``what`` says what ``path`` is)."""
        if self.tenant_names:
            raise SwapRefused(
                f"version {version} of policy {policy!r} at {path} {what}: with tenant policies "
                f"({', '.join(self.tenant_names)}) every policy's versions are LoRA "
                "adapters over the base weights, which all policies share, so no full weights load"
            )

    def _stage_and_merge(self, path: Path, sha256: str, staged: Path, merged: Path) -> None:
        spec = self._stage_adapter(path, sha256, staged)
        try:
            merge(self.model_dir, staged, spec, merged, self.settings.dtype)
        except OSError as exc:  # a full disk, the base model unreadable
            raise SwapRefused(f"merging adapter version at {path} failed: {exc}") from exc

    def _check_weights(self, path: Path, sha256: str) -> None:
        """Raise SwapRefused unless ``path`` holds the serving model's tensors with checksum
        ``sha256``. Reads the headers first (kB) so a wrong layout is refused before hashing."""
        try:
            if self.layout is not None:
                self.layout.check(path)
            actual = weights_sha256(path)
        except WeightsMismatch as exc:
            raise SwapRefused(str(exc)) from exc
        except OSError as exc:  # FileNotFoundError, permissions, a directory named *.safetensors
            raise SwapRefused(f"cannot read weights at {path}: {exc}") from exc
        if actual != sha256:
            raise SwapRefused(f"checksum mismatch for {path}: expected {sha256}, found {actual}")

    async def _paused_reload(self, version: int, path: Path, weights: Path) -> None:
        try:
            await self.engine.pause_generation(mode="keep", clear_cache=True)
            await self._reload(version, path, weights)
        finally:
            await self.engine.resume_generation()

    async def _reload(self, version: int, path: Path, weights: Path) -> None:
        """Load the full weights in ``weights`` as ``version`` (published at ``path``) into the
        paused engine; on failure restore the serving version's weights and stamp, then raise
        SwapRefused (or the restore's own error)."""
        try:
            await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(weights)})
            await self.engine.update_weight_version(str(version))
        except Exception as exc:
            log.error(
                "reload of %s as version %d failed (%s); restoring version %d",
                weights,
                version,
                exc,
                self.version,
            )
            await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(self.weights_path)})
            await self.engine.update_weight_version(str(self.weights_version))
            raise SwapRefused(f"reload of {path} failed, version {self.version} serves on: {exc}") from exc
        old, self.version, self.path, self.weights_path = self.weights_path, version, path, weights
        self.weights_version = version
        if old is not None and old != weights and old.parent == self.work_dir:
            shutil.rmtree(old, ignore_errors=True)  # the merge of the adapter served until now
