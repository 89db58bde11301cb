"""Operator writes are atomic under concurrency (issue 40 item 8): control flags are upserts,
lifecycle moves compare-and-set, so two writers racing on one flag or one version both get an
answer (2xx, or 409 naming what was recorded first) and the database records exactly the moves
that were answered 2xx, in some serial order. On PostgreSQL and SQLite, with real concurrency:
requests at once to the real app (``running_server``), threads at the store.

Each race is run for ``ROUNDS`` rounds: before the fix, two simultaneous ``POST /admin/pause``
on PostgreSQL answered 500 (``UniqueViolation`` on ``pk_control_flags``) in 16–18 of 20.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from sqlalchemy import delete, insert, select, text

from core import lifecycle_store
from core.control import GUARD_PIN, PAUSED, get_flag, set_flag
from core.db import ControlFlag, PolicyVersion, VersionStatusEvent, make_engine, migrate
from core.lifecycle import GUARD, Stage, TransitionError
from core.records import utcnow
from testing.fakes import FakeEngine
from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.integration

ROUNDS = 20


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path) -> str:
    """A migrated database URL: SQLite in ``tmp_path`` or a fresh PostgreSQL database."""
    if request.param == "postgres":
        url = request.getfixturevalue("pg_url")
    else:
        url = f"sqlite:///{tmp_path}/races.db"
    migrate(url)
    return url


def seed(db, stages: list[str]) -> None:
    """Versions 0..n-1 in ``stages`` (each the child of the one before), as the learner writes
    them; nothing else."""
    with db.begin() as conn:
        conn.execute(delete(VersionStatusEvent))
        conn.execute(delete(ControlFlag))
        conn.execute(delete(PolicyVersion))
        for v, stage in enumerate(stages):
            conn.execute(
                insert(PolicyVersion).values(
                    version=v,
                    path=f"/p/v{v}",
                    sha256="0" * 64,
                    status="published",
                    parent_version=v - 1 if v else None,
                    metrics={},
                    created_at=utcnow(),
                    lifecycle=stage,
                )
            )


def moves(db, version: int) -> list[tuple[str | None, str]]:
    """The recorded moves of ``version`` (from, to), oldest first; notes (same stage) left out."""
    with db.connect() as conn:
        rows = conn.execute(
            select(VersionStatusEvent.from_status, VersionStatusEvent.to_status)
            .where(VersionStatusEvent.version == version)
            .order_by(VersionStatusEvent.id)
        ).all()
    return [(r.from_status, r.to_status) for r in rows if r.from_status != r.to_status]


def stage_of(db, version: int) -> str:
    with db.connect() as conn:
        return conn.execute(
            select(PolicyVersion.lifecycle).where(PolicyVersion.version == version)
        ).scalar_one()


async def at_once(client: httpx.AsyncClient, *calls: tuple[str, dict | None]) -> list[httpx.Response]:
    return await asyncio.gather(*(client.post(path, json=body, headers=ADMIN) for path, body in calls))


async def test_simultaneous_flag_writes_all_succeed(tmp_path, database):
    """Pause ×2 at once, then pause + resume at once, ``ROUNDS`` times: every answer is 200
    (40 + 40 of them); after each pause pair the flag is "1"; after each pause/resume pair it
    is whichever the database took last, "1" or unset, and the answers agree with it."""
    settings = make_settings(tmp_path, database_url=database)
    db = make_engine(database)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for _ in range(ROUNDS):
                both = await at_once(client, ("/admin/pause", None), ("/admin/pause", None))
                assert [r.status_code for r in both] == [200, 200], [r.text for r in both]
                assert get_flag(db, PAUSED) == "1"
                mixed = await at_once(client, ("/admin/pause", None), ("/admin/resume", None))
                assert [r.status_code for r in mixed] == [200, 200], [r.text for r in mixed]
                assert get_flag(db, PAUSED) in ("1", None)
    db.dispose()


def test_flag_upserts_from_threads_at_once(database):
    """Four threads set one flag at the same instant (a barrier), ``ROUNDS`` times: no error, and
    the flag holds one of the four values: one row, the last writer's."""
    db = make_engine(database)
    errors: list[BaseException] = []
    for r in range(ROUNDS):
        barrier = threading.Barrier(4)

        def write(i: int, r: int = r, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                set_flag(db, GUARD_PIN, f"{r}-{i}")
            except BaseException as exc:  # the assertion below reports it
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert get_flag(db, GUARD_PIN) in {f"{r}-{i}" for i in range(4)}
    assert errors == []
    with db.connect() as conn:
        assert conn.execute(select(ControlFlag.name)).scalars().all() == [GUARD_PIN]
    db.dispose()


async def test_two_operators_racing_on_one_version(tmp_path, database):
    """Versions 0, 1 promoted, 2 canary. Each round, at once:

    * reject 2 and reject 2: one 200, one 409 ("already rejected" or "was canary and is rejected
      now"); exactly one move canary → rejected recorded;
    * promote 2 and reject 2: whichever commits first wins and the other is 409 when it had read
      2 as canary; a reject that reads 2 after the promotion's commit is 200 (promoted →
      rejected is allowed). Either way the moves recorded are exactly the 200s, in one order;
    * pin 1 and reject 1 (a promoted version): reject-first, the pin is 409 (rejected); pin-first,
      the rejection lifts the pin. Either way 1 ends rejected and nothing is pinned.
    """
    settings = make_settings(tmp_path, database_url=database)
    db = make_engine(database)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for _ in range(ROUNDS // 2):
                seed(db, ["promoted", "promoted", "canary"])
                two = await at_once(
                    client,
                    ("/admin/lifecycle/reject", {"version": 2}),
                    ("/admin/lifecycle/reject", {"version": 2}),
                )
                assert sorted(r.status_code for r in two) == [200, 409], [r.text for r in two]
                refused = next(r for r in two if r.status_code == 409).json()["error"]
                assert refused["code"] == "transition_refused"
                assert moves(db, 2) == [("canary", "rejected")]

                seed(db, ["promoted", "promoted", "canary"])
                promote, reject = await at_once(
                    client,
                    ("/admin/lifecycle/promote", {"version": 2}),
                    ("/admin/lifecycle/reject", {"version": 2}),
                )
                answered = {"promote": promote.status_code, "reject": reject.status_code}
                expected = {
                    # promote first, then reject (promoted → rejected is allowed)
                    (200, 200): ("rejected", [("canary", "promoted"), ("promoted", "rejected")]),
                    (200, 409): ("promoted", [("canary", "promoted")]),
                    (409, 200): ("rejected", [("canary", "rejected")]),
                }
                key = (promote.status_code, reject.status_code)
                assert key in expected, (answered, promote.text, reject.text)
                assert (stage_of(db, 2), moves(db, 2)) == expected[key]

                seed(db, ["promoted", "promoted", "canary"])
                pin, reject = await at_once(
                    client,
                    ("/admin/lifecycle/pin", {"version": 1}),
                    ("/admin/lifecycle/reject", {"version": 1}),
                )
                assert reject.status_code == 200, reject.text
                assert pin.status_code in (200, 409), pin.text
                # 2 descends from 1: rejected with it (docs/guard.md, "Rejecting a version").
                assert (stage_of(db, 1), stage_of(db, 2)) == ("rejected", "rejected")
                assert get_flag(db, GUARD_PIN) is None
                assert moves(db, 1) == [("promoted", "rejected")]
    db.dispose()


def test_the_guard_and_an_operator_racing_on_postgres(pg_url):
    """The guard promotes the lineage [2] in a transaction it holds open; an operator's reject of
    2 read the stage (canary) before that commit and waits on the row (PostgreSQL shows it
    waiting on a lock). When the guard commits, the operator's compare-and-set finds 2 promoted:
    TransitionError, nothing written by it; the record is the guard's one move."""
    migrate(pg_url)
    db = make_engine(pg_url)
    seed(db, ["promoted", "promoted", "canary"])
    outcome: dict[str, object] = {}

    def operator() -> None:
        try:
            with db.begin() as conn:
                lifecycle_store.transition(conn, 2, Stage.REJECTED, "alice", "by alice", utcnow())
            outcome["operator"] = "rejected"
        except TransitionError as exc:
            outcome["operator"] = str(exc)

    with db.begin() as guard:
        lifecycle_store.transition(guard, 2, Stage.PROMOTED, GUARD, "shown not worse", utcnow())
        worker = threading.Thread(target=operator)
        worker.start()
        with db.connect() as watch:
            while not watch.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            ).scalar_one():
                watch.rollback()
                worker.join(0.05)
    worker.join()
    assert outcome["operator"] == (
        "version 2 was canary and is promoted now: another move of it was recorded first "
        "(read the lifecycle and try again if it still applies)"
    )
    assert moves(db, 2) == [("canary", "promoted")]
    assert stage_of(db, 2) == "promoted"
    db.dispose()
