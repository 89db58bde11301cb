"""The identity cap (learner/data/identity_cap.py): hand-computed batches, then properties; and the
learner's batch assembly through it (learner.data.sample_queue.next_batch, via Learner._next_batch) on a real database."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from core.db import ApiKey, LearnerSample, make_engine, migrate
from core.records import utcnow
from learner.config import LearnerConfig
from learner.data.identity_cap import identity_shares, per_identity_limit, select_batch
from learner.process import Learner
from testing.servers import make_settings


# ------------------------------------------------------------------ hand-computed
def test_batch_4_cap_a_quarter_takes_one_of_a_and_defers_the_rest():
    # k = max(1, floor(0.25 * 4)) = 1: a (index 0), then a, a deferred (1, 2), then b, c, d.
    pick = select_batch(["a", "a", "a", "b", "c", "d"], 4, 0.25)
    assert pick.chosen == (0, 3, 4, 5)
    assert pick.deferred == (1, 2)
    assert pick.full


def test_batch_8_cap_a_quarter_takes_two_per_identity():
    # k = floor(0.25 * 8) = 2. Scan: a0 a1 take, a2 a3 defer, b4 b5 take, b6 defer, c7 c8 take,
    # d9 take, e10 take: 8 chosen, the scan stops before index 11.
    ids = ["a", "a", "a", "a", "b", "b", "b", "c", "c", "d", "e", "f"]
    pick = select_batch(ids, 8, 0.25)
    assert pick.chosen == (0, 1, 4, 5, 7, 8, 9, 10)
    assert pick.deferred == (2, 3, 6)
    assert pick.full


def test_too_few_identities_form_no_batch():
    # k = 1 with batch 4: a, b, c fill 3 slots; the other a's are deferred: no batch (the
    # learner waits for a fourth identity).
    pick = select_batch(["a", "b", "a", "c", "a"], 4, 0.25)
    assert pick.chosen == (0, 1, 3)
    assert pick.deferred == (2, 4)
    assert not pick.full


def test_anonymous_samples_are_each_their_own_identity():
    # None is never capped: 3 anonymous + one a fill batch 4 at k = 1; the second a is deferred.
    pick = select_batch([None, "a", None, "a", None], 4, 0.25)
    assert pick.chosen == (0, 1, 2, 4)
    assert pick.deferred == (3,)


def test_no_cap_is_the_oldest_batch():
    assert select_batch(["a"] * 6, 4, None).chosen == (0, 1, 2, 3)
    assert not select_batch(["a"] * 3, 4, None).full


@pytest.mark.parametrize(
    ("batch", "share", "k"),
    [(4, 0.25, 1), (16, 0.25, 4), (10, 0.3, 3), (100, 0.29, 29), (3, 0.1, 1), (8, 1.0, 8)],
)
def test_per_identity_limit(batch, share, k):
    # 0.29 * 100 is 28.999999999999996 in floats: still 29; 0.1 * 3 = 0.3 floors to 0, raised to 1.
    assert per_identity_limit(batch, share) == k


@pytest.mark.parametrize(("batch", "share"), [(0, 0.25), (4, 0.0), (4, 1.5), (4, -0.1)])
def test_per_identity_limit_refuses_bad_arguments(batch, share):
    with pytest.raises(ValueError, match="need batch_size >= 1 and max_share in"):
        per_identity_limit(batch, share)


def test_identity_shares_hand_computed():
    # a: rewards 1 + 1 = 2, b: 1, anonymous: 0 and 0 (two identities). Total 3 → a's share 2/3;
    # a holds 2 of the 5 samples; 4 identities.
    shares = identity_shares(["a", "a", "b", None, None], [1.0, 1.0, 1.0, 0.0, 0.0])
    assert shares == {"identity_count": 4, "identity_top_share": 2 / 3, "identity_top_sample_share": 2 / 5}


def test_identity_shares_of_a_batch_without_reward_has_no_reward_share():
    assert identity_shares(["a", "b"], [0.0, 0.0])["identity_top_share"] is None


def test_identity_shares_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="2 identities for 1 rewards"):
        identity_shares(["a", "b"], [1.0])


# ------------------------------------------------------------------ properties
identity = st.one_of(st.none(), st.sampled_from("abcdefgh"))
pools = st.lists(identity, max_size=60)
batch_sizes = st.integers(1, 20)
shares = st.floats(0.01, 1.0)


def fill_possible(ids: list[str | None], batch: int, k: int) -> bool:
    counts = Counter(i for i in ids if i is not None)
    return sum(min(c, k) for c in counts.values()) + ids.count(None) >= batch


@settings(max_examples=300, deadline=None)
@given(pools, batch_sizes, shares)
def test_no_identity_above_the_cap_and_a_batch_whenever_one_can_be_formed(ids, batch, share):
    k = per_identity_limit(batch, share)
    pick = select_batch(ids, batch, share)
    chosen = Counter(ids[i] for i in pick.chosen if ids[i] is not None)
    assert all(c <= k for c in chosen.values())
    assert len(pick.chosen) <= batch
    assert pick.full == fill_possible(ids, batch, k)


@settings(max_examples=300, deadline=None)
@given(pools, batch_sizes, shares)
def test_nothing_is_lost(ids, batch, share):
    """Every candidate is chosen, deferred, or not reached (all after the last chosen); a
    deferred one's identity is full, and each identity's chosen samples are its oldest."""
    pick = select_batch(ids, batch, share)
    k = per_identity_limit(batch, share)
    chosen, deferred = set(pick.chosen), set(pick.deferred)
    assert not chosen & deferred
    assert list(pick.chosen) == sorted(chosen) and list(pick.deferred) == sorted(deferred)
    reached = chosen | deferred
    unreached = set(range(len(ids))) - reached
    if unreached:
        assert pick.full and min(unreached) > max(reached)
    taken = Counter(ids[i] for i in pick.chosen)
    for i in pick.deferred:
        assert ids[i] is not None and taken[ids[i]] == k
        assert all(ids[j] != ids[i] for j in pick.chosen if j > i)  # never a younger one of its identity


@settings(max_examples=300, deadline=None)
@given(pools, batch_sizes, shares, st.randoms(use_true_random=False))
def test_when_the_pool_cannot_fill_a_batch_the_counts_do_not_depend_on_order(ids, batch, share, rnd):
    """Where the whole pool is scanned (no batch formed), each identity keeps min(count, k)
    whatever the order the samples came in."""
    k = per_identity_limit(batch, share)
    if fill_possible(ids, batch, k):
        return
    shuffled = list(ids)
    rnd.shuffle(shuffled)

    def counts(pool):
        return Counter(pool[i] for i in select_batch(pool, batch, share).chosen)

    assert counts(ids) == counts(shuffled)
    assert counts(ids) == Counter({i: min(c, k) if i is not None else c for i, c in Counter(ids).items()})


@settings(max_examples=200, deadline=None)
@given(pools.filter(bool), st.data())
def test_shares_are_order_invariant_and_in_range(ids, data):
    rewards = data.draw(st.lists(st.floats(0.0, 1.0), min_size=len(ids), max_size=len(ids)))
    perm = data.draw(st.permutations(range(len(ids))))
    a = identity_shares(ids, rewards)
    b = identity_shares([ids[i] for i in perm], [rewards[i] for i in perm])
    assert a["identity_count"] == b["identity_count"]
    assert a["identity_top_sample_share"] == pytest.approx(b["identity_top_sample_share"])
    if a["identity_top_share"] is None:
        assert b["identity_top_share"] is None
    else:
        assert 0.0 <= a["identity_top_share"] <= 1.0 + 1e-12
        assert a["identity_top_share"] == pytest.approx(b["identity_top_share"])


# ------------------------------------------------------------------ the learner's batch
def sample_payload(sample_id: str, identity: str | None) -> str:
    return json.dumps(
        {
            "id": sample_id,
            "prompt_id": "p",
            "input_ids": [1, 2, 3],
            "actions": [[2, 3]],
            "rollout_logprobs": [-0.5],
            "token_versions": [0],
            "temperature": 1.0,
            "reward": 1.0,
            "baseline_value": None,
            "result_version": 0,
            "identity": identity,
        }
    )


def test_the_learner_trains_the_capped_batch_and_the_excess_waits(tmp_path):
    """Six waiting samples a,a,a,b,c,d (oldest first), batch 4, cap 0.25: the batch is
    s0 (a), s3 (b), s4 (c), s5 (d); s1 and s2 stay in learner_samples, deferred (2)."""
    settings_ = make_settings(tmp_path)
    url = settings_.resolved_database_url
    migrate(url)
    db = make_engine(url)
    t0 = utcnow()
    who = ["key:ka", "key:ka", "key:ka", "key:kb", "user:c", None]
    with db.begin() as conn:
        conn.execute(
            insert(LearnerSample),
            [
                dict(
                    id=f"s{i}",
                    prompt_id="p",
                    payload=sample_payload(f"s{i}", w),
                    created_at=t0 + timedelta(seconds=i),
                    identity=w,
                )
                for i, w in enumerate(who)
            ],
        )
    learner = Learner(settings_, LearnerConfig(batch_size=4, max_identity_share=0.25), db=db)
    rows, deferred = learner._next_batch()
    assert [r.id for r in rows] == ["s0", "s3", "s4", "s5"]
    assert deferred == 2
    # Without the cap: the oldest four, a three times.
    learner.config = LearnerConfig(batch_size=4, max_identity_share=None)
    rows, deferred = learner._next_batch()
    assert ([r.id for r in rows], deferred) == (["s0", "s1", "s2", "s3"], 0)
    # Only a's samples and one b: no batch can be formed within the cap.
    learner.config = LearnerConfig(batch_size=4, max_identity_share=0.5)
    with db.begin() as conn:
        conn.execute(LearnerSample.__table__.delete().where(LearnerSample.id.in_(["s4", "s5"])))
    assert learner._next_batch() == (None, 0)  # k = 2: a, a, b = 3 < 4
    # ka trusted (a backend the operator vouches for): each of its samples is its own identity
    # to the cap, so a, a, a, b fill the batch and nothing is deferred.
    with db.begin() as conn:
        conn.execute(
            insert(ApiKey).values(id="ka", tenant="acme", key_sha256="0" * 64, created_at=t0, trusted=True)
        )
    rows, deferred = learner._next_batch()
    assert ([r.id for r in rows], deferred) == (["s0", "s1", "s2", "s3"], 0)
    learner.log.close()
    db.dispose()


def test_the_joiner_keeps_each_samples_identity(tmp_path):
    """A trajectory's identity reaches its sample and the learner_samples column the cap reads:
    a keyed record, a user's, one with neither (NULL), and an episode (its first turn's)."""
    from sqlalchemy import select

    from core.logbus import SqlLog
    from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES
    from learner.data.joiner import Joiner
    from testing.builders import fb, traj

    url = f"sqlite:///{tmp_path / 'j.db'}"
    migrate(url)
    log, db = SqlLog(url), make_engine(url)
    records = [
        traj("t1", identity="key:k0123456789abcdef", tenant="acme"),
        traj("t2", identity="user:bob"),
        traj("t3"),
        traj("e0", episode_id="ep", turn=0, identity="key:kep"),
        traj("e1", episode_id="ep", turn=1, identity="key:kep"),
    ]
    for rec in records:
        log.append(TOPIC_TRAJECTORIES, "p", rec.to_json())
    for tid in ("t1", "t2", "t3"):
        log.append(TOPIC_FEEDBACK, "p", fb(tid).to_json())
    rated = fb(episode="ep").model_copy(update={"turn_ids": ["e0", "e1"]})
    log.append(TOPIC_FEEDBACK, "p", rated.to_json())
    Joiner(log, db, 10 * 365 * 86400).poll_once()
    with db.connect() as conn:
        got = dict(conn.execute(select(LearnerSample.id, LearnerSample.identity)).all())
    assert got == {"t1": "key:k0123456789abcdef", "t2": "user:bob", "t3": None, "e:ep": "key:kep"}
    log.close()
    db.dispose()
