"""Reading a whole topic back, for assertions."""

from __future__ import annotations

from core.db import make_engine
from core.logbus import LogEntry, LogTransport, open_log
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, TrajectoryRecord
from core.sealing import SubjectKeys


def read_topic(log: LogTransport, topic: str) -> list[LogEntry]:
    """Every record of ``topic`` (all partitions), reading until each partition is drained."""
    out: list[LogEntry] = []
    for p in log.partitions(topic):
        offset = 0
        while True:
            batch = log.read(topic, p, offset, 500, 0.3)
            if not batch:
                break
            out.extend(batch)
            offset = batch[-1].offset + 1
    return out


def logged_trajectories(settings) -> list[TrajectoryRecord]:
    """Every trajectory record in the log of a server run with ``settings`` (a Kafka log's sealed
    records opened with their data keys, ``core.sealing``)."""
    log = open_log(settings.resolved_log_url)
    db = make_engine(settings.resolved_database_url)
    try:
        keys = SubjectKeys(db)
        return [
            TrajectoryRecord.model_validate_json(keys.open(e.value))
            for e in read_topic(log, TOPIC_TRAJECTORIES)
        ]
    finally:
        log.close()
        db.dispose()


def append(log, *recs):
    for r in recs:
        topic = TOPIC_FEEDBACK if hasattr(r, "reward") else TOPIC_TRAJECTORIES
        log.append(topic, r.prompt_id, r.to_json())
