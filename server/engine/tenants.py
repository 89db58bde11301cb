"""The policies one ``PolicyEngine`` serves (``core.policies``): the global one and its tenant
policies (``tenant_names``: ``settings.tenant_policies`` at start, then changed at run time by
``add_policy`` and ``remove_policy``), the version and folder each serves, and the engine as one
policy sees it (``PolicyView``)."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import TYPE_CHECKING

from core.policies import GLOBAL
from server.adapters import PolicyAdapters
from server.engine.types import TenantPolicyRefused, UnknownPolicy

if TYPE_CHECKING:
    from server.engine.core import PolicyEngine


class TenantPolicies:
    """``PolicyEngine``'s policies: their names, their served versions and folders (the global
    policy's in ``version`` and ``path``, a tenant policy's in ``_tenant_served``) and a view of
    each. Every method that takes ``policy`` raises UnknownPolicy for a name not served."""

    @property
    def policies(self) -> list[str]:
        """The policies this engine serves: ``GLOBAL``, then ``tenant_names``."""
        return [GLOBAL, *self.tenant_names]

    async def add_policy(self, policy: str) -> None:
        """Serve tenant policy ``policy`` from now on, at version 0 (the base weights) until its
        watcher swaps its adapter in; the policies' shares of the adapter slots are recounted
        (``AdapterTable.share``). A policy served already is left as it is. Under the swap lock,
        so a full-weights load in flight ends first and one asked for later is refused.

        Raises:
            TenantPolicyRefused: the engine serves full weights (``tenant_policy_refusal``);
                nothing changed.
        """
        async with self._swap_lock:
            if policy in self.tenant_names:
                return
            why = self.tenant_policy_refusal()
            if why is not None:
                raise TenantPolicyRefused(why)
            if self.adapters is not None:
                self.adapters.share(len(self.tenant_names) + 2)
            self.tenant_names.append(policy)

    async def remove_policy(self, policy: str) -> None:
        """Stop serving tenant policy ``policy``: no request or load of it starts from the call
        on; once the load in flight, if any, has ended (the swap lock: a swap is shielded from
        its caller's cancellation and finishes after its watcher is gone), its view, version
        and pins are dropped and its adapters removed from vLLM once no request uses them
        (``AdapterTable.drop_policy``). A load of it still waiting for the lock is refused
        (``_loading``). Raises UnknownPolicy for a name not served."""
        if self.check_policy(policy) == GLOBAL:
            raise UnknownPolicy("the global policy is always served")
        self.tenant_names.remove(policy)
        self._views.pop(policy, None)
        async with self._swap_lock:
            self._tenant_served.pop(policy, None)
            if self.adapters is not None:
                self._remove_later(self.adapters.drop_policy(policy))
                self.adapters.share(len(self.tenant_names) + 1)

    def tenant_policy_refusal(self) -> str | None:
        """Why no tenant policy can be added now, or None: with adapters served as LoRA, the
        global policy's full weights (a full version) serve in place of the base weights that
        every tenant adapter applies to, so a tenant added would have its adapters refused and
        would block the global policy's next full-weights version (``PolicyEngine.swap``). The
        engine is at the base weights again only after a restart."""
        if self.adapters is None or self.weights_path == self.model_dir:
            return None
        return (
            f"the global policy serves the full weights of its version {self.weights_version} "
            f"({self.weights_path}), and tenant policies are LoRA adapters over the base weights; "
            "publish the global policy's versions as adapters (saoserve learn --policy lora), and "
            "once its newest version is one, restart the servers (they start at the base weights) "
            "and add the tenant policy"
        )

    def check_policy(self, policy: str) -> str:
        """``policy`` if this engine serves it; raises UnknownPolicy naming the ones it does."""
        if policy != GLOBAL and policy not in self.tenant_names:
            raise UnknownPolicy(f"no policy named {policy!r} (policies: {', '.join(self.policies)})")
        return policy

    def view(self, policy: str = GLOBAL) -> PolicyView:
        """The engine as ``policy`` sees it (one object per policy). Raises UnknownPolicy."""
        self.check_policy(policy)
        if policy not in self._views:
            self._views[policy] = PolicyView(self, policy)
        return self._views[policy]

    def version_of(self, policy: str = GLOBAL) -> int:
        """The version ``policy``'s new requests are served with (``version`` for the global
        policy; 0, the base weights, for a tenant policy before its first adapter)."""
        if self.check_policy(policy) == GLOBAL:
            return self.version
        return self._tenant_served.get(policy, (0, self.model_dir))[0]

    def path_of(self, policy: str = GLOBAL) -> Path | None:
        """The folder of the version ``policy`` serves (``path`` for the global policy;
        ``model_dir`` for a tenant policy served by the base weights)."""
        if self.check_policy(policy) == GLOBAL:
            return self.path
        return self._tenant_served.get(policy, (0, self.model_dir))[1]

    def weights_version_of(self, policy: str = GLOBAL) -> int:
        """The version a request of ``policy`` served by no adapter is stamped with:
        ``weights_version`` for the global policy, 0 (the base weights) for a tenant's."""
        return self.weights_version if self.check_policy(policy) == GLOBAL else 0

    def _serve(self, policy: str, version: int, path: Path) -> None:
        if policy == GLOBAL:
            self.version, self.path = version, path
        else:
            self._tenant_served[policy] = (version, path)


class PolicyView:
    """One policy's view of the shared ``PolicyEngine``: what the chat handler, policy watcher,
    canary router and readiness code use of an engine, bound to ``policy``, so each of them can
    be handed a view in place of the engine and work unchanged. ``engine.view(GLOBAL)`` behaves
    exactly as the engine itself. Made by ``PolicyEngine.view`` (which checks the name).

    The policy's own state is the view's: ``version`` (``version_of``), ``path`` (``path_of``),
    ``weights_version`` (``weights_version_of``: always 0 for a tenant policy) and ``adapters``
    (the table bound to the policy). Every other attribute is the engine's: a method that takes
    ``policy`` (``generate``, ``swap``, ``hold``, ``pin``) with it bound to this view's policy,
    the rest (``settings``, ``engine``, ``tokenizer``, ``render``, ``removals_done``...) as the
    engine has it.

    Versions only go forward per policy: a tenant's version 3 never blocks the global policy's
    version 2, nor the other way round. Loads of all policies share the engine's adapter slots
    and its swap lock.
    """

    def __init__(self, owner: PolicyEngine, policy: str) -> None:
        self.owner = owner
        self.policy = policy

    def __repr__(self) -> str:
        return f"PolicyView(policy={self.policy!r}, version={self.version})"

    @property
    def version(self) -> int:
        """The version this policy's new requests are served with (``version_of``)."""
        return self.owner.version_of(self.policy)

    @property
    def path(self) -> Path | None:
        """The folder of that version as its policy event names it (``path_of``)."""
        return self.owner.path_of(self.policy)

    @property
    def weights_version(self) -> int:
        """The version a request of this policy served by no adapter is stamped with
        (``weights_version_of``: always 0 for a tenant policy)."""
        return self.owner.weights_version_of(self.policy)

    @property
    def adapters(self) -> PolicyAdapters | None:
        """The adapter table bound to this policy (``find(version)``, ``current``,
        ``pin(version)``, ...; slots are the whole engine's), or None when adapters are not
        served as LoRA."""
        table = self.owner.adapters
        return None if table is None else table.of(self.policy)

    def __getattr__(self, name: str):
        # Only names the view does not have reach here; dunders stay the view's own (copy,
        # pickle), and ``owner`` is missing only on a view being built.
        if name.startswith("__") or name == "owner":
            raise AttributeError(name)
        attr = getattr(self.owner, name)
        if inspect.ismethod(attr) and takes_policy(attr.__func__):
            return functools.partial(attr, policy=self.policy)
        return attr


@functools.cache
def takes_policy(fn) -> bool:
    """Whether the engine's method ``fn`` (its function) has a ``policy`` parameter."""
    return "policy" in inspect.signature(fn).parameters
