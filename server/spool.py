"""Local spool for trajectory records while the log is down (``log_required=False``).

One JSON record per file under the spool folder, written with fsync and an atomic rename, so
a crash never leaves a half record; ``run`` re-sends them in creation order when the log is
back and deletes each file only after the log and the index accepted it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from sqlalchemy.exc import IntegrityError

from core.logbus import LogTransport
from core.policies import GLOBAL
from core.records import TOPIC_TRAJECTORIES, TrajectoryRecord
from server.policy_log import PolicyLog
from server.store import ServerStore

log = logging.getLogger(__name__)


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
        tmp = self.folder / f".{rec.id}.tmp"
        with open(tmp, "wb") as f:
            f.write(rec.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.folder / f"{rec.created_at.timestamp():.6f}-{rec.id}.json")

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
