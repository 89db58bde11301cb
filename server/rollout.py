"""Assemble one request's trajectory record from the engine's deltas (pure, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from core.lifecycle import Arm
from core.records import FrozenBaseline, SamplingRecord, TrajectoryRecord
from server.engine import GenerationDelta


def run_lengths(spans: list[tuple[int, int, int]], n_tokens: int) -> list[tuple[int, int]]:
    """vLLM spans ``(version, start, end)`` → run-length ``[(version, count)]`` over n tokens.

    Adjacent spans of one version merge; raises ValueError if the spans do not tile
    ``[0, n_tokens)``.
    """
    out: list[tuple[int, int]] = []
    pos = 0
    for version, start, end in spans:
        if start != pos or end < start:
            raise ValueError(f"version spans {spans} do not tile {n_tokens} tokens")
        if end > start:
            if out and out[-1][0] == version:
                out[-1] = (version, out[-1][1] + end - start)
            else:
                out.append((version, end - start))
        pos = end
    if pos != n_tokens:
        raise ValueError(f"version spans {spans} cover {pos} tokens, response has {n_tokens}")
    return out


@dataclass
class Rollout:
    """A request in progress: what has been sampled so far, and what was frozen at dispatch."""

    id: str
    prompt_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingRecord
    dispatch_version: int
    created_at: datetime
    baseline: FrozenBaseline | None = None
    episode_id: str | None = None
    turn: int | None = None
    train: bool = True
    user: str | None = None
    # Who sent it and the key's tenant (TrajectoryRecord.identity, .tenant; docs/tenants.md).
    identity: str | None = None
    tenant: str | None = None
    # The canary arm it was routed to (core.lifecycle.route; TrajectoryRecord.arm).
    arm: Arm | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    delta_versions: list[tuple[int, int]] = field(default_factory=list)
    spans: list[tuple[int, int, int]] | None = None
    finish_reason: str | None = None

    def add(self, d: GenerationDelta) -> None:
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        if d.token_ids:
            if self.delta_versions and self.delta_versions[-1][0] == d.version:
                v, c = self.delta_versions[-1]
                self.delta_versions[-1] = (v, c + len(d.token_ids))
            else:
                self.delta_versions.append((d.version, len(d.token_ids)))
        if d.weight_versions is not None:
            self.spans = d.weight_versions
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason

    def record(self, finish_reason: str | None = None) -> TrajectoryRecord:
        """The trajectory record; ``finish_reason`` overrides (e.g. ``abort``).

        Token versions come from vLLM's spans when the request finished in the engine; an
        aborted request has none, and each token is stamped with the version served when its
        delta arrived (swaps pause generation, so a delta never straddles one).
        """
        n = len(self.token_ids)
        versions = run_lengths(self.spans, n) if self.spans is not None else list(self.delta_versions)
        return TrajectoryRecord(
            id=self.id,
            prompt_id=self.prompt_id,
            episode_id=self.episode_id,
            turn=self.turn,
            created_at=self.created_at,
            model=self.model,
            prompt_token_ids=self.prompt_token_ids,
            response_token_ids=self.token_ids,
            rollout_logprobs=self.logprobs,
            token_versions=versions,
            dispatch_version=self.dispatch_version,
            sampling=self.sampling,
            baseline=self.baseline,
            finish_reason=finish_reason or self.finish_reason or "abort",
            train=self.train,
            user=self.user,
            identity=self.identity,
            tenant=self.tenant,
            arm=self.arm,
        )
