"""Small fakes for unit tests of the server (no vLLM, no broker).

``FakeEngine`` stands in for ``server.engine.core.PolicyEngine`` where a test exercises the server's
edges (admin routes, feedback, readiness) and no answer is generated: the real app, database and
log under uvicorn, with the engine's version, path and swap only; ``ScriptedEngine`` also answers
every chat with two fixed tokens. ``FakeState`` is what ``server.fate.Fate`` uses of the server's
state; ``OutageLog`` a policy topic that is down for its first reads. ``record_versions`` and
``index_answer`` write the rows the learner and the server would have written.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import insert

from core.db import PolicyVersion, make_engine
from core.logbus import LogEntry, LogUnavailable
from core.policy_store import ADAPTER_CONFIG, ADAPTER_FILE
from core.records import TOPIC_POLICY, PolicyEvent
from server.adapters import AdapterTable
from server.engine import GenerationDelta, SwapRefused, SwapResult
from server.metrics import ServerMetrics
from server.store import ServerStore
from testing.builders import record


@dataclass
class FakeEngine:
    """``version``/``path`` as the engine keeps them; ``swap`` records its calls and serves the
    version asked for (no weights are read: the admin route's checks run before it)."""

    version: int = 0
    path: Path | None = None
    model_dir: Path | None = None  # version 0's weights
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
    rec = record(completion_id, episode_id, finish_reason, prompt_id=prompt_id, turn=turn, max_tokens=4)
    db = make_engine(settings.resolved_database_url)
    ServerStore(db).index_trajectory(rec, 0, 1)
    db.dispose()


class FakeState:
    """What ``Fate`` uses of ``ServerState``: the write (``refuse``: LogUnavailable, or another
    exception), the turn release, background tasks and the metrics."""

    def __init__(self, refuse: BaseException | None = None) -> None:
        self.metrics = ServerMetrics()
        self.refuse = refuse
        self.persisted: list = []
        self.released: list[str] = []
        self.order: list[str] = []  # "release" and "persist", as they ran
        self.tasks: list[asyncio.Task] = []

    async def persist_trajectory(self, rec) -> None:
        self.order.append("persist")
        if self.refuse is not None:
            raise self.refuse
        self.persisted.append(rec)

    async def release_turn(self, trajectory_id: str) -> None:
        self.order.append("release")
        self.released.append(trajectory_id)

    def spawn(self, coro) -> None:
        self.tasks.append(asyncio.ensure_future(coro))

    async def drained(self) -> FakeState:
        await asyncio.gather(*self.tasks)
        return self

    def count(self, stream: str, outcome: str) -> float:
        return self.metrics.requests.labels(stream, outcome)._value.get()

    def refused_before_generation(self) -> float:
        return self.metrics.failed_before_generation.labels("engine_error")._value.get()

    def latencies(self) -> float:
        return self.metrics.registry.get_sample_value("saoserve_request_seconds_count")


# The first chat imports vLLM (its SamplingParams) inside the server's loop: tens of seconds here.
TIMEOUT_S = 120.0


@dataclass
class ScriptedEngine(FakeEngine):
    """FakeEngine that answers: every prompt renders as 3 tokens and every answer is the two
    tokens 7, 8 (logprobs -0.5, -0.25), finished with ``stop``, at the served version."""

    tokenizer: tuple = tuple(range(100))  # only its length is read (the top-k bound)

    def render(self, messages: list[dict]) -> list[int]:
        return [1, 2, 3]

    async def generate(self, prompt_ids, sampling, request_id=None, top_logprobs=0, **_):
        yield GenerationDelta([7], [-0.5], "hi", self.version)
        yield GenerationDelta([8], [-0.25], "!", self.version, "stop", [(self.version, 0, 2)])


class OutageLog:
    """A policy topic that refuses its first ``down_for`` reads, then holds ``events``."""

    def __init__(self, down_for: int, events: list[PolicyEvent] = ()):
        self.down_for, self.calls = down_for, 0
        self.entries = [LogEntry(TOPIC_POLICY, 0, i, "policy", e.to_json()) for i, e in enumerate(events)]

    def partitions(self, topic: str) -> list[int]:
        self.calls += 1
        if self.calls <= self.down_for:
            raise LogUnavailable("the Kafka log is unavailable: KafkaConnectionError: broker down")
        return [0]

    def read(self, topic, partition, offset, max_records=500, timeout_s=0.5) -> list[LogEntry]:
        return self.entries[offset : offset + max_records]


def event(version: int) -> PolicyEvent:
    return PolicyEvent(
        version=version,
        path=f"/policies/v{version}",
        sha256="0" * 64,
        created_at=datetime(2025, 6, 1, 0, 0, version, tzinfo=UTC),
        parent_version=version - 1,
        metrics={},
    )


def notice(version: int, stage: str, second: int) -> PolicyEvent:
    """A stage notice of ``version`` (moved to ``stage`` by the guard), ``second`` s into minute 1."""
    at = datetime(2025, 6, 1, 0, 1, second, tzinfo=UTC)
    return event(version).model_copy(
        update={"kind": "stage", "lifecycle": stage, "actor": "guard", "created_at": at}
    )


def staged(version: int, stage: str) -> PolicyEvent:
    """A publish event of ``version`` announced at ``stage``."""
    return event(version).model_copy(update={"lifecycle": stage})


def append_events(log: OutageLog, *events: PolicyEvent) -> None:
    """Append ``events`` to the policy topic of ``log`` after what it holds."""
    for e in events:
        log.entries.append(LogEntry(TOPIC_POLICY, 0, len(log.entries), "policy", e.to_json()))


def adapter_folder(root: Path, version: int) -> None:
    """An adapter folder ``v<version>`` under ``root`` as the router sees it: the files, empty."""
    d = root / f"v{version}"
    d.mkdir(parents=True)
    (d / ADAPTER_FILE).write_bytes(b"")
    (d / ADAPTER_CONFIG).write_text("{}")


class RouterEngine:
    """What the canary router (``server.canary``) uses of ``server.engine.core.PolicyEngine``: the version new requests get, the
    full weights' version (0: the base), holding an adapter (it is then registered and pinned)
    and unpinning it."""

    def __init__(self, version: int, refuse: bool = False):
        self.version = version
        self.weights_version = 0
        self.adapters = AdapterTable(4)
        self.refuse = refuse
        self.held: list[int] = []
        self.unpinned: list[int] = []

    async def hold(self, version: int, path: Path, sha256: str) -> None:
        if self.refuse:
            raise SwapRefused("no such files")
        self.held.append(version)
        self.adapters.loaded(self.adapters.reserve(), version, path, sha256, hold=True)

    def pin(self, version: int, pinned: bool = True) -> None:
        self.unpinned.append(version)
        self.adapters.pin(version, pinned)
