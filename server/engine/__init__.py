"""The policy engine: vLLM ``AsyncLLM`` with token logprobs, version stamps and hot-swap.

The engine samples with ``logprobs_mode="processed_logprobs"`` so the logged logprob of each
token is the one of the distribution it was actually drawn from (after temperature), which is
what DIS needs as π_rollout (SAO §2.2; docs/design.md §5.1). Every output token carries the policy
version that produced it (vLLM's weight-version spans).

A version is full weights or a LoRA adapter (``core.policy_store.layout``). Full weights swap in
place (pause, reload, resume). An adapter is served as ``settings.adapter_serving`` says: merged
into the base weights and swapped in the same way, or (``ADAPTER``) added to vLLM with
``add_lora`` and given to every request that starts afterwards, while requests in flight finish
on the adapter they started with (``server.adapters``; docs/serving_adapters.md).

One engine serves every policy (``core.policies``): the global one and, in adapter mode, each
tenant policy (``settings.tenant_policies`` at start; ``add_policy`` and ``remove_policy`` at run
time), each with its own current adapter and served version over the shared base weights. ``PolicyEngine.view(policy)`` is the engine as one policy
sees it (``PolicyView``), which the chat handler, policy watcher and canary router take in place
of the engine. With tenant policies no full weights are ever loaded (merged adapters included):
every policy's adapters apply to the base weights.

The engine is split by what it serves: ``core`` (``PolicyEngine``: start, generation, the swap
and its lock, shutdown), ``full_weights`` (full-weight and merged-adapter swaps),
``served_adapters`` (adapters served as LoRA: slots, loads, removals), ``holds`` (holds and
pins of adapters), ``tenants`` (the policies served, their versions, ``PolicyView``);
``sampling`` builds vLLM's sampling parameters and ``types`` holds the results and errors.
"""

from server.engine.core import PolicyEngine
from server.engine.sampling import InvalidSampling, vllm_sampling
from server.engine.tenants import PolicyView
from server.engine.types import (
    GenerationDelta,
    SlotsTaken,
    SwapRefused,
    SwapResult,
    TenantPolicyRefused,
    UnknownPolicy,
)

__all__ = [
    "GenerationDelta",
    "InvalidSampling",
    "PolicyEngine",
    "PolicyView",
    "SlotsTaken",
    "SwapRefused",
    "SwapResult",
    "TenantPolicyRefused",
    "UnknownPolicy",
    "vllm_sampling",
]
