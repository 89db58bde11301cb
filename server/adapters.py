"""The adapter table of an engine serving policy versions as LoRA adapters (pure, no I/O).

vLLM keeps at most ``max_cpu_loras`` adapters registered; one more would make it evict the
least recently used, which may be the one requests are being served with. The table is the
server's own account of those slots, so it never asks vLLM for more than it has:

- a load first **reserves** a slot (``reserve``), refused with ``TableFull`` when every slot is
  loaded, loading or being removed; a load that fails gives its slot back (``cancel``), so a
  refused version never takes one;
- a loaded adapter becomes **current** (what new requests are served with) unless a higher
  version already is;
- a request **acquires** an adapter when it starts and **releases** it when it ends, so it is
  served by one adapter from its first token to its last (one version per answer);
- an adapter is **removable** once no request uses it and it is neither current nor pinned;
  every call that can make one removable returns those it made so, already marked as
  being removed (their slots stay taken until ``removed``), and the caller removes them from
  vLLM.

Each load gets a fresh vLLM id and name (``lora_id``, ``name``), never reused: vLLM skips an
``add_lora`` of an id it holds, and its prefix cache keys blocks by adapter name, so a version
published twice with other files must never share either with the first load.
docs/serving_adapters.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class TableFull(RuntimeError):
    """Every adapter slot is taken by an adapter in use, current, pinned, loading or being
    removed; the load is refused and the current adapter serves on."""


@dataclass
class Adapter:
    """One adapter registered in vLLM.

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

    @property
    def name(self) -> str:
        return f"policy-v{self.version}-{self.lora_id}"


class AdapterTable:
    """The adapters of one engine, at most ``capacity`` slots (``max_cpu_loras``)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an adapter table has at least one slot, not {capacity}")
        self.capacity = capacity
        self.adapters: dict[int, Adapter] = {}  # lora_id → loaded adapter
        self.loading: set[int] = set()
        self.removing: set[int] = set()
        self.current: Adapter | None = None
        self._next_id = 1

    def occupied(self) -> int:
        """Slots taken: loaded, loading and being removed."""
        return len(self.adapters) + len(self.loading) + len(self.removing)

    def reserve(self) -> int:
        """A slot for a load; returns the vLLM id it will have (ids start at 1, vLLM's lowest).

        Raises:
            TableFull: no slot is free.
        """
        if self.occupied() >= self.capacity:
            raise TableFull(
                f"all {self.capacity} adapter slots are taken ({len(self.adapters)} loaded, "
                f"{len(self.loading)} loading, {len(self.removing)} being removed): an adapter is "
                "removed only once no request uses it and it is neither current nor pinned"
            )
        lora_id = self._next_id
        self._next_id += 1
        self.loading.add(lora_id)
        return lora_id

    def cancel(self, lora_id: int) -> None:
        """The load of ``lora_id`` failed: its slot is free again."""
        self.loading.discard(lora_id)

    def loaded(
        self, lora_id: int, version: int, path: Path, sha256: str, hold: bool = False
    ) -> tuple[Adapter, list[Adapter]]:
        """The load reserved as ``lora_id`` is done: the adapter, and those now removable.

        It becomes current unless a higher version is current (a load that lost a race to a
        newer one is then removable at once). ``hold``: a load kept beside the current one (a
        canary split's control arm): pinned, and never current. Raises KeyError if ``lora_id``
        was not reserved.
        """
        self.loading.remove(lora_id)
        adapter = Adapter(version=version, lora_id=lora_id, path=Path(path), sha256=sha256, pinned=hold)
        self.adapters[lora_id] = adapter
        if not hold and (self.current is None or version >= self.current.version):
            self.current = adapter
        return adapter, self._collect()

    def find(self, version: int) -> Adapter | None:
        """The newest load of ``version`` still registered, or None."""
        found = [a for a in self.adapters.values() if a.version == version]
        return max(found, key=lambda a: a.lora_id, default=None)

    def acquire(self, version: int | None = None) -> Adapter | None:
        """The adapter a starting request is served with, counted as used: ``version``'s when it
        is registered, else the current one; None when no adapter is current (the base
        weights serve)."""
        adapter = self.find(version) if version is not None else None
        adapter = adapter or self.current
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

    def pin(self, version: int, pinned: bool = True) -> list[Adapter]:
        """Pin (keep loaded) or unpin the newest load of ``version``; returns the removable ones.

        Raises KeyError if ``version`` is not registered.
        """
        adapter = self.find(version)
        if adapter is None:
            raise KeyError(f"no adapter of version {version} is loaded")
        adapter.pinned = pinned
        return self._collect()

    def clear_current(self) -> list[Adapter]:
        """No adapter is current any more (full weights serve); returns the removable ones."""
        self.current = None
        return self._collect()

    def removed(self, lora_id: int) -> None:
        """vLLM no longer holds ``lora_id``: its slot is free."""
        self.removing.discard(lora_id)

    def _collect(self) -> list[Adapter]:
        out = [a for a in self.adapters.values() if a.users == 0 and not a.pinned and a is not self.current]
        for a in out:
            del self.adapters[a.lora_id]
            self.removing.add(a.lora_id)
        return out
