"""The checks every log transport passes (SQLite and the SQL table in tests/unit/core/test_logbus.py;
PostgreSQL and tansu in tests/integration/test_logbus.py)."""

from __future__ import annotations

import pytest

from testing.logs import read_topic


def exercise_log(log):
    placed = [log.append("trajectories", f"p{i % 3}", f'{{"n": {i}}}'.encode()) for i in range(12)]
    entries = read_topic(log, "trajectories")
    assert sorted(int(e.value.decode()[6:-1]) for e in entries) == list(range(12))
    # One key → one partition, in append order.
    by_key: dict[str, list[int]] = {}
    parts: dict[str, set[int]] = {}
    for e in sorted(entries, key=lambda e: (e.partition, e.offset)):
        by_key.setdefault(e.key, []).append(int(e.value.decode()[6:-1]))
        parts.setdefault(e.key, set()).add(e.partition)
    assert by_key["p0"] == [0, 3, 6, 9] and all(len(p) == 1 for p in parts.values())
    # Reading from an offset returns that record first.
    part, off = placed[4]
    assert log.read("trajectories", part, off, 1)[0].value == b'{"n": 4}'
    with pytest.raises(ValueError, match="unknown topic"):
        log.append("nope", "k", b"{}")
