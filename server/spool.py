"""Local spools: trajectory records while the log is down (``log_required=False``), and the
database writes that follow a record already in the log while the database refuses them.

One JSON file per entry, written with fsync and an atomic rename, so a crash never leaves a half
entry. ``Spool.run`` re-sends the records in creation order when the log is back and deletes
each file only after the log and the index accepted it. ``WriteJournal`` keeps each deferred
database write (an index row, a feedback claim's mark, an episode turn's release) until the
database took it, so a server that restarts before then does them at its start instead of
losing them (issue 40 item 9: a 202 whose claim mark was lost at a restart).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from enum import StrEnum
from pathlib import Path

from sqlalchemy.exc import IntegrityError

from core.logbus import LogTransport
from core.policies import GLOBAL
from core.records import TOPIC_TRAJECTORIES, TrajectoryRecord
from server.policy_log import PolicyLog
from server.store import ServerStore

log = logging.getLogger(__name__)


def _write_durably(folder: Path, name: str, data: bytes) -> Path:
    """Write ``data`` to ``folder``/``name`` with fsync and an atomic rename; returns the path."""
    tmp = folder / f".{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    path = folder / name
    os.replace(tmp, path)
    return path


class DeferredWrite(StrEnum):
    """The database writes a server defers when the database refuses them after the log took
    the record they follow (``server.state.ServerState``): each is one ``ServerStore`` method."""

    INDEX_TRAJECTORY = "index_trajectory"
    MARK_RECEIVED = "mark_received"
    RELEASE_TURN = "release_turn"


class WriteJournal:
    """The deferred database writes of one policy, kept in ``folder`` until done: ``put`` one
    (its kind and JSON arguments) before the answer that depends on it is sent, ``done`` once
    the database took it, ``pending`` at start to do the ones a restart interrupted, oldest
    first."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def put(self, kind: DeferredWrite, args: list) -> Path:
        """Keep the write ``kind(*args)``; returns its file. Raises OSError (a full disk)."""
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
        return _write_durably(self.folder, name, json.dumps({"kind": str(kind), "args": args}).encode())

    def done(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def pending(self) -> list[tuple[Path, DeferredWrite, list]]:
        """The writes not done yet, oldest first; a file that does not parse (written by hand,
        or by another version) is logged and left in place."""
        out = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                entry = json.loads(path.read_bytes())
                out.append((path, DeferredWrite(entry["kind"]), list(entry["args"])))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("deferred write %s does not parse, left in place: %s", path, exc)
        return out


class Spool:
    """The spool of one policy's trajectories in ``folder``; ``policy`` (``GLOBAL`` or a tenant)
    starts each of its log lines (``server.policy_log``)."""

    def __init__(
        self,
        folder: Path,
        log_transport: LogTransport,
        store: ServerStore,
        retry_s: float = 2.0,
        policy: str = GLOBAL,
    ):
        self.logger = PolicyLog(log, policy)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = log_transport
        self.store = store
        self.retry_s = retry_s

    def put(self, rec: TrajectoryRecord) -> None:
        _write_durably(self.folder, f"{rec.created_at.timestamp():.6f}-{rec.id}.json", rec.to_json())

    def pending(self) -> list[Path]:
        return sorted(self.folder.glob("*.json"))

    def flush_once(self) -> int:
        """Send spooled records; returns how many were sent. Stops at the first failure.

        Where a record was appended but its index row was refused (the database down), the
        placement is kept beside it (``.placed``), so the next flush writes the index row
        without appending the record a second time."""
        sent = 0
        for path in self.pending():
            rec = TrajectoryRecord.model_validate_json(path.read_bytes())
            placed = path.with_suffix(".placed")
            if self.store.find_trajectory(rec.id) is None:
                if placed.exists():
                    part, off = json.loads(placed.read_text())
                else:
                    value = self.store.log_bytes(rec, self.log.keeps_records)
                    part, off = self.log.append(TOPIC_TRAJECTORIES, rec.prompt_id, value)
                    placed.write_text(json.dumps([part, off]))
                try:
                    self.store.index_trajectory(rec, part, off)
                except IntegrityError:
                    pass
            path.unlink()
            placed.unlink(missing_ok=True)
            sent += 1
        return sent

    async def run(self) -> None:
        while True:
            if self.pending():
                try:
                    n = await asyncio.to_thread(self.flush_once)
                    if n:
                        self.logger.info("re-sent %d spooled trajectories", n)
                except Exception as exc:
                    self.logger.warning("spool flush failed, will retry: %s", exc)
            await asyncio.sleep(self.retry_s)
