"""The adapter table of an engine serving policy versions as LoRA adapters (pure, no I/O).

One table holds the adapters of every policy the engine serves (the global one and each tenant
policy, ``core.policies``), keyed by ``(policy, version)``: the slots are vLLM's, so all policies
share them, while each policy has its own **current** adapter.

vLLM keeps at most ``max_cpu_loras`` adapters registered; one more would make it evict the
least recently used, which may be the one requests are being served with. The table is the
server's own account of those slots, so it never asks vLLM for more than it has:

- a load first **reserves** a slot (``reserve``), refused with ``TableFull`` when every slot is
  loaded, loading or being removed, or when its policy already has its share of the slots
  (``capacity // policies``, issue 40: one policy's adapters in use never starve another's
  loads); a load that fails gives its slot back (``cancel``), so a refused version never takes
  one;
- a loaded adapter becomes its policy's **current** one (what that policy's new requests are
  served with) unless a higher version of that policy already is; a policy with no current
  adapter is served by the base weights (its version 0);
- a request **acquires** an adapter when it starts and **releases** it when it ends, so it is
  served by one adapter from its first token to its last (one version per answer);
- an adapter is **removable** once no request uses it and it is neither its policy's current
  one nor pinned (another policy's current adapter never keeps it, nor makes it go);
  every call that can make one removable returns those it made so, already marked as
  being removed (their slots stay taken until ``removed``), and the caller removes them from
  vLLM.

Each load gets a fresh vLLM id and name (``lora_id``, ``name``), never reused: vLLM skips an
``add_lora`` of an id it holds, and its prefix cache keys blocks by adapter name, so a version
published twice with other files must never share either with the first load. The name holds
the policy too (``policy-acme-v3-7``), so the logs say whose adapter it is.
docs/serving_adapters.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.policies import GLOBAL


class TableFull(RuntimeError):
    """Every adapter slot (shared by all policies) is taken by an adapter in use, current,
    pinned, loading or being removed; the load is refused and the current adapters serve on."""


@dataclass
class Adapter:
    """One adapter registered in vLLM: version ``version`` of policy ``policy``.

    ``path`` is the server's own copy of the version's files (what vLLM reads, then and on any
    reload), ``sha256`` its checksum (``core.weights.weights_sha256``), ``users`` the requests
    being served with it.
    """

    version: int
    lora_id: int
    path: Path
    sha256: str
    users: int = 0
    pinned: bool = False
    policy: str = GLOBAL

    @property
    def name(self) -> str:
        """vLLM's name of this load: ``policy-v<version>-<id>`` for the global policy,
        ``policy-<tenant>-v<version>-<id>`` for a tenant's (unique: the id is never reused)."""
        if self.policy == GLOBAL:
            return f"policy-v{self.version}-{self.lora_id}"
        return f"policy-{self.policy}-v{self.version}-{self.lora_id}"


class AdapterTable:
    """The adapters of one engine, every policy's, in at most ``capacity`` slots (``max_cpu_loras``).

    Every method that names a version takes ``policy`` (default the global one): version 3 of
    ``acme`` and version 3 of the global policy are two adapters. ``current`` is the global
    policy's current adapter; ``current_of(policy)`` any policy's.
    """

    def __init__(self, capacity: int, policies: int = 1) -> None:
        if capacity < 1 or policies < 1 or capacity < policies:
            raise ValueError(
                f"an adapter table has at least one slot a policy, not {capacity} for {policies} policies"
            )
        self.capacity = capacity
        # Each policy's share of the slots: its loads are refused beyond it.
        self.quota = capacity // policies
        self.adapters: dict[int, Adapter] = {}  # lora_id → loaded adapter
        self.loading: set[int] = set()
        self.removing: set[int] = set()
        self._owners: dict[int, str] = {}  # lora_id → its policy, from its reservation to its removal
        self.currents: dict[str, Adapter] = {}  # policy → its current adapter (absent: the base)
        self._next_id = 1

    @property
    def current(self) -> Adapter | None:
        """The global policy's current adapter (None: the base weights serve it)."""
        return self.currents.get(GLOBAL)

    def current_of(self, policy: str = GLOBAL) -> Adapter | None:
        """``policy``'s current adapter, or None (its requests get the base weights)."""
        return self.currents.get(policy)

    def of(self, policy: str = GLOBAL) -> PolicyAdapters:
        """This table as seen by ``policy`` alone (``PolicyAdapters``)."""
        return PolicyAdapters(self, policy)

    def occupied(self, policy: str | None = None) -> int:
        """Slots taken (loaded, loading and being removed): by all policies, or by ``policy``."""
        if policy is None:
            return len(self.adapters) + len(self.loading) + len(self.removing)
        return sum(1 for owner in self._owners.values() if owner == policy)

    def reserve(self, policy: str = GLOBAL) -> int:
        """A slot for a load of ``policy``; returns the vLLM id it will have (ids start at 1,
        vLLM's lowest).

        Raises:
            TableFull: no slot is free, or ``policy`` has its share (``quota``) taken.
        """
        why = "an adapter is removed only once no request generates with it and it is neither its policy's current one nor pinned"
        if self.occupied() >= self.capacity:
            raise TableFull(
                f"all {self.capacity} adapter slots are taken ({len(self.adapters)} loaded, "
                f"{len(self.loading)} loading, {len(self.removing)} being removed): {why}"
            )
        if self.occupied(policy) >= self.quota:
            raise TableFull(
                f"policy {policy!r} has all its {self.quota} of the {self.capacity} adapter slots taken: {why}"
            )
        lora_id = self._next_id
        self._next_id += 1
        self.loading.add(lora_id)
        self._owners[lora_id] = policy
        return lora_id

    def cancel(self, lora_id: int) -> None:
        """The load of ``lora_id`` failed: its slot is free again."""
        self.loading.discard(lora_id)
        self._owners.pop(lora_id, None)

    def loaded(
        self, lora_id: int, version: int, path: Path, sha256: str, hold: bool = False, policy: str = GLOBAL
    ) -> tuple[Adapter, list[Adapter]]:
        """The load reserved as ``lora_id`` (``policy``'s ``version``) is done: the adapter, and
        those now removable.

        It becomes ``policy``'s current one unless a higher version of ``policy`` is current (a
        load that lost a race to a newer one is then removable at once). ``hold``: a load kept
        beside the current one (a canary split's control arm): pinned, and never current.
        Raises KeyError if ``lora_id`` was not reserved.
        """
        self.loading.remove(lora_id)
        adapter = Adapter(
            version=version, lora_id=lora_id, path=Path(path), sha256=sha256, pinned=hold, policy=policy
        )
        self.adapters[lora_id] = adapter
        cur = self.currents.get(policy)
        if not hold and (cur is None or version >= cur.version):
            self.currents[policy] = adapter
        return adapter, self._collect()

    def find(self, version: int, policy: str = GLOBAL) -> Adapter | None:
        """The newest load of ``policy``'s ``version`` still registered, or None."""
        found = [a for a in self.adapters.values() if a.version == version and a.policy == policy]
        return max(found, key=lambda a: a.lora_id, default=None)

    def acquire(self, version: int | None = None, policy: str = GLOBAL) -> Adapter | None:
        """The adapter a starting request of ``policy`` is served with, counted as used:
        ``version``'s when it is registered, else ``policy``'s current one; None when ``policy``
        has no current adapter (the base weights serve)."""
        adapter = self.find(version, policy) if version is not None else None
        adapter = adapter or self.currents.get(policy)
        if adapter is not None:
            adapter.users += 1
        return adapter

    def release(self, adapter: Adapter | None) -> list[Adapter]:
        """A request served with ``adapter`` (None: the base) ended; returns the removable ones.

        Raises ValueError if the adapter has no user to release.
        """
        if adapter is None:
            return []
        if adapter.users < 1:
            raise ValueError(f"adapter {adapter.name} released more often than acquired")
        adapter.users -= 1
        return self._collect()

    def pin(self, version: int, pinned: bool = True, policy: str = GLOBAL) -> list[Adapter]:
        """Pin (keep loaded) or unpin the newest load of ``policy``'s ``version``; returns the
        removable ones.

        Raises KeyError if that version is not registered.
        """
        adapter = self.find(version, policy)
        if adapter is None:
            raise KeyError(f"no adapter of version {version} of policy {policy!r} is loaded")
        adapter.pinned = pinned
        return self._collect()

    def clear_current(self, policy: str = GLOBAL) -> list[Adapter]:
        """``policy`` has no current adapter any more (full weights, or the base, serve it);
        returns the removable ones."""
        self.currents.pop(policy, None)
        return self._collect()

    def share(self, policies: int) -> None:
        """The table now serves ``policies`` policies (a tenant policy added or removed at run
        time): each one's share of the slots becomes ``capacity // policies``. A policy holding
        more than its new share keeps what it holds; its next load waits for its share.

        Raises:
            ValueError: fewer slots than ``policies``, or no policy.
        """
        if policies < 1 or self.capacity < policies:
            raise ValueError(
                f"an adapter table has at least one slot a policy, not {self.capacity} for {policies} policies"
            )
        self.quota = self.capacity // policies

    def drop_policy(self, policy: str) -> list[Adapter]:
        """``policy`` is no longer served: it has no current adapter and its pins are undone;
        returns the removable adapters (those requests still use are removed at their release)."""
        self.currents.pop(policy, None)
        for a in self.adapters.values():
            if a.policy == policy:
                a.pinned = False
        return self._collect()

    def removed(self, lora_id: int) -> None:
        """vLLM no longer holds ``lora_id``: its slot is free."""
        self.removing.discard(lora_id)
        self._owners.pop(lora_id, None)

    def _collect(self) -> list[Adapter]:
        out = [
            a
            for a in self.adapters.values()
            if a.users == 0 and not a.pinned and self.currents.get(a.policy) is not a
        ]
        for a in out:
            del self.adapters[a.lora_id]
            self.removing.add(a.lora_id)
        return out


class PolicyAdapters:
    """The shared ``AdapterTable`` bound to one policy: what ``PolicyView.adapters`` is, so code
    written for one policy's table (``find(version)``, ``current``, ``pin(version)``) works
    unchanged. Slots (``capacity``, ``occupied``) are the whole table's; ``reserve`` counts
    against this policy's share."""

    def __init__(self, table: AdapterTable, policy: str) -> None:
        self.table = table
        self.policy = policy

    @property
    def capacity(self) -> int:
        """Slots of the whole table (all policies)."""
        return self.table.capacity

    @property
    def current(self) -> Adapter | None:
        """This policy's current adapter (None: the base weights serve it)."""
        return self.table.current_of(self.policy)

    def occupied(self) -> int:
        """Slots taken by all policies (``AdapterTable.occupied``)."""
        return self.table.occupied()

    def reserve(self) -> int:
        """``AdapterTable.reserve`` for this policy (raises TableFull)."""
        return self.table.reserve(self.policy)

    def cancel(self, lora_id: int) -> None:
        """``AdapterTable.cancel``."""
        self.table.cancel(lora_id)

    def loaded(
        self, lora_id: int, version: int, path: Path, sha256: str, hold: bool = False
    ) -> tuple[Adapter, list[Adapter]]:
        """``AdapterTable.loaded`` of this policy's ``version``."""
        return self.table.loaded(lora_id, version, path, sha256, hold=hold, policy=self.policy)

    def find(self, version: int) -> Adapter | None:
        """The newest load of this policy's ``version``, or None."""
        return self.table.find(version, policy=self.policy)

    def acquire(self, version: int | None = None) -> Adapter | None:
        """``AdapterTable.acquire`` for a request of this policy."""
        return self.table.acquire(version, policy=self.policy)

    def release(self, adapter: Adapter | None) -> list[Adapter]:
        """``AdapterTable.release`` (raises ValueError)."""
        return self.table.release(adapter)

    def pin(self, version: int, pinned: bool = True) -> list[Adapter]:
        """``AdapterTable.pin`` of this policy's ``version`` (raises KeyError)."""
        return self.table.pin(version, pinned, policy=self.policy)

    def clear_current(self) -> list[Adapter]:
        """``AdapterTable.clear_current`` of this policy."""
        return self.table.clear_current(self.policy)

    def removed(self, lora_id: int) -> None:
        """``AdapterTable.removed``."""
        self.table.removed(lora_id)
