"""What the engine answers and raises: a generation's deltas (``GenerationDelta``), a swap's
timings (``SwapResult``), and the refusals (``SwapRefused``, ``SlotsTaken``, ``TenantPolicyRefused``,
``UnknownPolicy``)."""

from __future__ import annotations

from dataclasses import dataclass, field


class SwapRefused(RuntimeError):
    """A policy version was not loaded (bad checksum, missing files, tensors that do not match
    the serving model, a reload that failed, full weights while tenant policies are served);
    the old one serves on."""


class SlotsTaken(SwapRefused):
    """A version refused only because its policy's adapter slots are all taken (in use, current,
    pinned or being removed): it loads once one frees, and the policy watcher tries it again
    (``server.policy_watch``)."""


class TenantPolicyRefused(RuntimeError):
    """A tenant policy the engine cannot serve now (``PolicyEngine.tenant_policy_refusal``: the
    global policy serves full weights, and tenant adapters apply to the base weights); nothing
    changed."""


class UnknownPolicy(ValueError):
    """A policy name this engine does not serve: neither ``GLOBAL`` nor one of its
    ``settings.tenant_policies``. The message lists the policies it serves."""


@dataclass
class GenerationDelta:
    """New output since the previous delta of one request.

    ``token_ids`` and ``logprobs`` (processed, nats) are the new tokens only; ``text`` is the
    new detokenised text; ``versions`` the policy version current when this delta arrived.
    ``top_logprobs`` holds, per new token, the ``(token_id, logprob)`` of the most likely
    tokens by rank when the request asked for alternatives (else empty lists).
    On the final delta ``finish_reason`` is set and ``weight_versions`` holds vLLM's spans
    ``(version, start, end)`` over all output tokens.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    version: int
    finish_reason: str | None = None
    weight_versions: list[tuple[int, int, int]] | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class SwapResult:
    version: int
    seconds: float
    paused_seconds: float
