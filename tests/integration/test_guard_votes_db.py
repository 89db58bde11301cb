"""The guard's vote queries on SQLite and PostgreSQL (learner.guard.guard_votes.rated_votes and
health_votes; issue 40, items 1 and 6): the keys whose training is off read from the registry
(core.keys.opted_out_keys), the opted-out, unflagged and anonymous answers left out in SQL, the
cap applied after."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import insert

from core.claims import trajectory_target
from core.db import FeedbackClaim, TrajectoryIndex, make_engine, migrate
from core.keys import KeyStore, opted_out_keys, trusted_keys
from core.lifecycle import Arm
from core.records import utcnow
from learner.guard.guard_config import VoteCap
from learner.guard.guard_votes import Electorate, Senders, Tally, health_votes, rated_votes, values


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path / 'db.sqlite'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    migrate(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def answer(conn, tid, at, identity, reward, train=True, n_tokens=8, arm=Arm.CANARY):
    conn.execute(
        insert(TrajectoryIndex).values(
            id=tid,
            prompt_id="p",
            dispatch_version=1,
            last_version=1,
            n_response_tokens=n_tokens,
            finish_reason="stop",
            log_partition=0,
            log_offset=0,
            created_at=at,
            arm=str(arm),
            identity=identity,
            train=train,
        )
    )
    if reward is not None:
        conn.execute(
            insert(FeedbackClaim).values(
                target=trajectory_target(tid), state="received", reward=reward, claimed_at=at, received_at=at
            )
        )


def test_who_votes_in_the_database(db):
    keys = KeyStore(db)
    out, _ = keys.create("acme", utcnow())
    stays, _ = keys.create("acme", utcnow())
    keys.set_train(out.id, False)  # after its answers were logged (train true on them)
    t = utcnow()
    rows = [
        ("a", f"key:{out.id}", 0.0, True),  # the key opted out since: out
        ("b", f"key:{out.id}", 0.0, None),  # no flag (before revision 0016), same key: out
        ("c", f"key:{stays.id}", 1.0, True),  # votes
        ("d", "user:probe", 0.0, False),  # logged train: false: out
        ("e", None, 0.5, True),  # anonymous: votes only with the cap off
        ("f", f"user:{out.id}", 0.25, True),  # a user named like the key id is not the key
        ("g", f"key:{stays.id}", 1.0, True),  # the same key again: the cap's second vote
    ]
    with db.begin() as conn:
        for i, (tid, who, reward, train) in enumerate(rows):
            answer(conn, tid, t + timedelta(seconds=i), who, reward, train, n_tokens=1 if tid == "c" else 8)
    with db.connect() as conn:
        opted = opted_out_keys(conn)
        assert opted == {f"key:{out.id}"}
        # Without the registry's answer the key's own rows (a, b) still vote: the setting is read.
        assert values(rated_votes(conn, [1], Electorate(None, 2)).votes) == [0.0, 0.0, 1.0, 0.5, 0.25, 1.0]
        voting = rated_votes(conn, [1], Electorate(None, 2), opted)
        assert values(voting.votes) == [1.0, 0.5, 0.25, 1.0]  # c, e, f, g
        # Who holds them: the key that stays (c, g) 2 of 4, user:<id> (f) 1, e anonymous.
        assert Senders.of(voting) == Senders(votes=4, identified=2, top_share=0.5)
        # Cap on every identity, windows of 2 at share 0.5 (k = 1): e is out; c and f fill
        # window 1; g alone in window 2 (partial, the last).
        every = Electorate(0.5, 2, VoteCap.IDENTITIES)
        assert values(rated_votes(conn, [1], every, opted).votes) == [1.0, 0.25, 1.0]
        # Cap on keys (the default): e and f vote unbound; window 1 c, e; window 2 f, g: all 4.
        assert rated_votes(conn, [1], Electorate(0.5, 2), opted) == Tally(voting.votes, 0)
        # limit counts voting ratings: the newest 2 that vote (f, g).
        assert values(rated_votes(conn, [1], Electorate(None, 2), opted, limit=2).votes) == [0.25, 1.0]
        assert values(rated_votes(conn, [1], Electorate(None, 2), opted, arm=Arm.CONTROL).votes) == []
        assert values(health_votes(conn, [1], 4, Electorate(None, 2), opted).votes) == [0.0, 1.0, 1.0, 1.0]
    # The trusted keys as the learner reads them with each check (revision 0019's column).
    keys.configure(stays.id, trusted=True)
    with db.connect() as conn:
        assert trusted_keys(conn) == {f"key:{stays.id}"}
