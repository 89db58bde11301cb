"""Who votes, on a learner (learner/guard/guard_votes.py; docs/guard.md, "Who votes"; issue 40,
items 1 and 6): one identity rating by arm decides no verdict under the identity cap, and each
verdict says who held its ratings; the ratings of an opted-out key, of a record logged ``train:
false`` or sent before an opt-out never vote. The tiny in-process learner of testing/learner.py
and hand-written rated answers."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from core.control import GUARD_VERDICT, get_flag
from core.keys import KeyStore
from core.logbus import open_log
from core.records import utcnow
from core.sequential import Decision
from learner.guard.guard_config import GuardConfig, VoteCap
from learner.guard.guard_votes import Electorate, warn_vote_cap_scope
from learner.process import Learner
from testing.guard import add_rated
from testing.learner import BATCH, feed


def rate_as(
    learner: Learner, version: int, arm: str, raters: list[tuple[str | None, float]], at, **row
) -> None:
    """Record one rated answer of ``version`` in ``arm`` per ``(identity, reward)`` of ``raters``,
    1 ms apart in that order (``row``: the index row's other fields, e.g. ``train``)."""
    with learner.db.begin() as conn:
        for i, (who, r) in enumerate(raters):
            tid = f"v{version}-{arm}-{at.timestamp()}-{i}"
            add_rated(conn, tid, version, r, at + timedelta(milliseconds=i), arm=arm, identity=who, **row)


def attacked_arm(reward: float) -> list[tuple[str, float]]:
    """120 ratings of one arm: every third (40) from 10 honest users (4 each, 1.0), the other
    80 from one API key rating ``reward``."""
    return [
        (f"user:u{i // 3 % 10}", 1.0) if i % 3 == 0 else ("key:kevil0000000000", reward) for i in range(120)
    ]


def one_key_rating_by_arm(learner: Learner, n: int) -> tuple[KeyStore, str, datetime]:
    """Version 1 trained, then one new API key rating ``n`` of its answers 0 on the canary arm
    and ``n`` of version 0's 1 on the control arm, from now: the key store, the key's id, and
    when the ratings began."""
    feed(open_log(learner.settings.resolved_database_url), BATCH, 0)
    learner.poll_once()
    learner.train_step()
    store = KeyStore(learner.db)
    info, _ = store.create("acme", utcnow())
    now = utcnow()
    rate_as(learner, 1, "canary", [(f"key:{info.id}", 0.0)] * n, now)
    rate_as(learner, 0, "control", [(f"key:{info.id}", 1.0)] * n, now)
    return store, info.id, now


def test_one_identity_rating_by_arm_does_not_decide_the_verdict_under_the_identity_cap(learner):
    """Issue 40: one API key rating 0 on the candidate's answers and 1 on the control's, among
    honest raters, got an honest lineage rejected. The honest ratings alone (40 wins in each
    arm) decide nothing yet; the key's 80 ratings an arm decide a rejection unless the guard's
    streams pass the identity cap."""
    feed(open_log(learner.settings.resolved_database_url), BATCH, 0)
    learner.poll_once()
    learner.train_step()
    now = utcnow()
    rate_as(learner, 1, "canary", attacked_arm(0.0), now)
    rate_as(learner, 0, "control", attacked_arm(1.0), now)
    # The cap is on by default on API keys: share 0.01, windows of ⌈1/0.01⌉ = 100 votes.
    assert learner.guard.electorate == Electorate(0.01, 100, VoteCap.KEYS)
    # No cap: 40 wins and 80 losses against 120 wins: rejected... judged first with the
    # guard's electorate off, so the lineage stays for the capped check.
    learner.guard.electorate = Electorate(None, 20)
    with learner.db.connect() as conn:
        created = {1: now - timedelta(seconds=1)}  # before the ratings, however slow the run
        uncapped, _, senders, _ = learner.guard._judge(conn, [1], [0], created)
    assert uncapped.decision == Decision.REJECT and uncapped.candidate.n == 120
    # The cap at share 0.1 of windows of 20, binding API keys (the default): k = 2 votes of the
    # key per window, each user's vote its own. Window 1: answers 0 (a user), 1 and 2 (the
    # key's 2), then the users' 3, 6, ..., 51 (17): 20; window 2: the key's 4 and 5, the users'
    # 54 ... 105 (18); window 3: the key's 7 and 8 and the users' last 4, 6 < 20: the last. The
    # key counts 6 times and 74 are held back, the honest raters 40: 46 an arm.
    learner.guard.electorate = Electorate(0.1, 20)
    assert learner.guard_check() == Decision.CONTINUE
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert (verdict["candidate"]["n"], verdict["candidate"]["mean"]) == (46, pytest.approx(40 / 46))
    assert (verdict["promoted"]["n"], verdict["promoted"]["mean"]) == (46, 1.0)
    # Who held the votes (saoserve_guard_top_sender_share): uncapped, the key 80 of 120 in each
    # arm; capped, 6 of 46 (each honest user 4), among 11 identified senders.
    assert senders["candidate"] == {
        "votes": 120,
        "identified": 11,
        "top_share": pytest.approx(80 / 120),
        "held_back": 0,
    }
    assert verdict["senders"]["candidate"] == {
        "votes": 46,
        "identified": 11,
        "top_share": pytest.approx(6 / 46),
        "held_back": 74,
    }
    assert verdict["senders"]["promoted"] == verdict["senders"]["candidate"]


def test_a_trusted_key_decides_under_the_cap_and_holds_no_sender_s_share(learner):
    """A deployment that rates through one backend key: under the identity cap the key is one
    sender and its 30 ratings an arm count 2 (share 0.1 of windows of 20: k = 2; the second
    window cannot be filled), so nothing is decided; trusted (``saoserve admin keys trust``),
    all 30 an arm count: 30 losses against 30 wins, rejected. The verdict names no sender: the
    operator vouched that the key's ratings are many people's."""
    store, backend, now = one_key_rating_by_arm(learner, 30)
    learner.guard.electorate = Electorate(0.1, 20)
    assert learner.guard_check() == Decision.CONTINUE
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert (verdict["candidate"]["n"], verdict["promoted"]["n"]) == (2, 2)
    assert verdict["senders"]["candidate"] == {"votes": 2, "identified": 1, "top_share": 1.0, "held_back": 28}
    store.configure(backend, trusted=True)
    with learner.db.connect() as conn:
        created = {1: now - timedelta(seconds=1)}  # before the ratings, however slow the run
        judged, _, senders, _ = learner.guard._judge(conn, [1], [0], created)
    assert judged.decision == Decision.REJECT
    assert (judged.candidate.n, judged.candidate.mean, judged.promoted.n) == (30, 0.0, 30)
    assert senders["candidate"] == {"votes": 30, "identified": 0, "top_share": 0.0, "held_back": 0}


def test_a_lineage_the_cap_holds_back_is_logged_once(learner, caplog):
    """One key not trusted rates 60 answers an arm: share 0.1 of windows of 20 counts its first
    2 (k = 2; window 1 cannot be filled) and holds back 58, more than it counts and at least
    HELD_BACK_WARNING (40): the guard warns, naming what to do, once for the lineage however
    many checks see it."""
    one_key_rating_by_arm(learner, 60)
    learner.guard.electorate = Electorate(0.1, 20)
    with caplog.at_level("WARNING", logger="learner.guard.guard"):
        assert learner.guard_check() == Decision.CONTINUE
        learner.guard._next_check = 0.0
        assert learner.guard_check() == Decision.CONTINUE
    warned = [r.getMessage() for r in caplog.records if "holds back" in r.getMessage()]
    assert warned == [
        "guard: the vote cap holds back more ratings than it counts on versions [1] (candidate: 2 "
        "counted, 58 held back; promoted: 2 counted, 58 held back); if they come through a key that "
        "rates for many people (a backend, a judge), trust it: saoserve admin keys trust KEY_ID on"
    ]


def test_a_share_set_without_saying_whom_it_binds_is_warned(caplog):
    """A config from before ``vote_cap`` that set the share meant every identity: warned at the
    learner's start; the default, or both set, is not."""
    with caplog.at_level("WARNING", logger="learner.guard.guard_votes"):
        warn_vote_cap_scope(GuardConfig(vote_identity_share=0.01))
        warn_vote_cap_scope(GuardConfig())
        warn_vote_cap_scope(GuardConfig(vote_identity_share=0.01, vote_cap=VoteCap.IDENTITIES))
    assert [r.getMessage()[:60] for r in caplog.records] == [
        "guard.vote_identity_share is set and guard.vote_cap is not: "
    ]


def test_an_opted_out_or_unknown_sender_s_ratings_never_vote(learner):
    """Issue 40: ratings of answers from a key that opted out of training voted (they decided a
    promotion). A key that opts out after its answers were logged (``train`` true on them), a
    record with no flag (indexed before revision 0016) of that key, a record logged ``train:
    false`` (``store: false``, the traffic that is not production), and, with the cap on, an
    answer without identity while the cap binds every identity: none votes."""
    store, key_id, now = one_key_rating_by_arm(learner, 30)
    who = f"key:{key_id}"
    learner.guard.electorate = Electorate(None, BATCH)
    with learner.db.connect() as conn:
        created = {1: now - timedelta(seconds=1)}  # before the ratings, however slow the run
        assert learner.guard._judge(conn, [1], [0], created)[0].decision == Decision.REJECT
    store.set_train(key_id, False)
    rate_as(learner, 1, "canary", [(who, 0.0)] * 30, now + timedelta(seconds=1), train=None)
    rate_as(learner, 1, "canary", [("user:probe", 0.0)] * 30, now + timedelta(seconds=2), train=False)
    assert learner.guard_check() == Decision.CONTINUE
    verdict = json.loads(get_flag(learner.db, GUARD_VERDICT))
    assert (verdict["candidate"]["n"], verdict["promoted"]["n"]) == (0, 0)
    # Anonymous answers vote while the cap is off or binds keys only (the default), not once it
    # binds every identity.
    rate_as(learner, 1, "canary", [(None, 0.0)] * 30, now + timedelta(seconds=3))
    rate_as(learner, 0, "control", [(None, 1.0)] * 30, now + timedelta(seconds=3))
    with learner.db.connect() as conn:
        assert learner.guard._judge(conn, [1], [0], created)[0].candidate.n == 30
        learner.guard.electorate = Electorate(0.5, BATCH)
        assert learner.guard._judge(conn, [1], [0], created)[0].candidate.n == 30
    learner.guard.electorate = Electorate(0.5, BATCH, VoteCap.IDENTITIES)
    assert learner.guard_check() == Decision.CONTINUE
    assert json.loads(get_flag(learner.db, GUARD_VERDICT))["candidate"]["n"] == 0
