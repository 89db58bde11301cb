"""Holds and pins of the ``PolicyEngine``'s adapters: an adapter kept loaded beside its policy's
current one without being current (the control arm of a canary split, ``server.canary``), or
kept loaded when unused."""

from __future__ import annotations

import logging
from pathlib import Path

from core.policies import GLOBAL

log = logging.getLogger(__name__)


class HoldsAndPins:
    """``PolicyEngine``'s ``hold`` and ``pin`` (adapters served as LoRA only)."""

    async def hold(self, version: int, path: Path, sha256: str, policy: str = GLOBAL) -> None:
        """Keep the adapter of ``policy``'s ``version`` (published at ``path`` with checksum
        ``sha256``) loaded and pinned beside ``policy``'s current one, loading it if it is not
        registered, without making it current: the control arm of a canary split
        (``server.canary``). Raises SwapRefused (nothing held) if it cannot be loaded,
        RuntimeError without adapter serving, UnknownPolicy for a policy not served.
        """
        self.check_policy(policy)
        if self.adapters is None:
            raise RuntimeError("adapters are not served as LoRA by this engine")
        async with self._loading(policy):
            if self.adapters.find(version, policy) is not None:
                self._remove_later(self.adapters.pin(version, policy=policy))
                return
            await self._load_adapter(version, path, sha256, hold=True, policy=policy)
        log.info("policy %s version %d (adapter %s) held beside the current version", policy, version, path)

    def pin(self, version: int, pinned: bool = True, policy: str = GLOBAL) -> None:
        """Keep the adapter of ``policy``'s ``version`` loaded even when it is not current and
        unused (or let it go). Raises KeyError if it is not loaded, RuntimeError without adapter
        serving, UnknownPolicy for a policy not served."""
        self.check_policy(policy)
        if self.adapters is None:
            raise RuntimeError("adapters are not served as LoRA by this engine")
        self._remove_later(self.adapters.pin(version, pinned, policy=policy))
