"""A stand-in for ``server.engine.PolicyEngine`` where a test exercises the server's edges (admin
routes, feedback, readiness) and no answer is generated: the real app, database and log under
uvicorn, with the engine's version, path and swap only. Chats need the real engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import insert

from core.db import PolicyVersion, make_engine
from core.records import SamplingRecord, TrajectoryRecord, utcnow
from server.engine import SwapResult
from server.store import ServerStore


@dataclass
class FakeEngine:
    """``version``/``path`` as the engine keeps them; ``swap`` records its calls and serves the
    version asked for (no weights are read: the admin route's checks run before it)."""

    version: int = 0
    path: Path | None = None
    engine: object = True  # /readyz: the engine runs
    adapters: None = None  # a full-weight engine: no adapter table, no canary split
    swaps: list[tuple[int, Path, str]] = field(default_factory=list)

    async def swap(self, version: int, path: Path, sha256: str) -> SwapResult:
        self.swaps.append((version, Path(path), sha256))
        self.version, self.path = version, Path(path)
        return SwapResult(version=version, seconds=0.0, paused_seconds=0.0)


def record_versions(settings, versions: dict[int, str]) -> None:
    """Rows of ``policy_versions`` as the learner writes them: ``{version: sha256}``, each at
    ``/policies/v<version>``, the parent the version before."""
    db = make_engine(settings.resolved_database_url)
    with db.begin() as conn:
        for v, sha in versions.items():
            conn.execute(
                insert(PolicyVersion).values(
                    version=v,
                    path=f"/policies/v{v}",
                    sha256=sha,
                    status="published",
                    parent_version=v - 1 if v else None,
                    metrics={},
                    created_at=datetime(2025, 6, 1, tzinfo=UTC),
                )
            )
    db.dispose()


def index_answer(
    settings,
    completion_id: str,
    prompt_id: str,
    finish_reason: str = "stop",
    episode_id: str | None = None,
    turn: int | None = None,
) -> None:
    """An answer's index row, as the server writes it once its record is in the log (an episode
    turn is marked logged with it), so feedback can be given for ``completion_id``."""
    rec = TrajectoryRecord(
        id=completion_id,
        prompt_id=prompt_id,
        episode_id=episode_id,
        turn=turn,
        created_at=utcnow(),
        model="m",
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        rollout_logprobs=[-0.5],
        token_versions=[(0, 1)],
        dispatch_version=0,
        sampling=SamplingRecord(temperature=1.0, top_p=1.0, top_k=0, max_tokens=4, seed=None),
        finish_reason=finish_reason,
    )
    db = make_engine(settings.resolved_database_url)
    ServerStore(db).index_trajectory(rec, 0, 1)
    db.dispose()
