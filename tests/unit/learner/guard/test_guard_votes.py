"""Who votes in the guard (learner.guard.guard_votes, learner.data.identity_cap.admit_stream; issue 40,
items 1 and 6): the identity cap on each arm's stream, opted-out and unknown senders left out.
Pure: hand-made streams, the values worked out by hand."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from learner.data.identity_cap import admit_stream, select_batch
from learner.guard.guard_config import VoteCap
from learner.guard.guard_votes import Electorate, Senders, Tally, Vote, ballot, counted, may_vote, tally


def naive_stream(identities, window, share):
    """``select_batch`` again and again on what is left, each chosen window in order, up to and
    including the first window that is not full: the definition ``admit_stream`` computes."""
    left = list(range(len(identities)))
    out = []
    while left:
        sel = select_batch([identities[i] for i in left], window, share)
        out += [left[i] for i in sel.chosen]
        if not sel.full:
            break
        taken = {left[i] for i in sel.chosen}
        left = [i for i in left if i not in taken]
    return tuple(out)


def test_the_cap_on_a_stream_by_hand():
    # window 4, share 0.5: k = 2 votes an identity per window.
    ids = ["a", "a", "a", "b", "a", "c", "a", "b"]
    # Window 1: a0, a1 taken, a2 passed over, b3, a4 passed over, c5: full (0, 1, 3, 5).
    # Window 2 from what is left (a2, a4, a6, b7): a2, a4, a6 passed over (a has 2), b7: 3 < 4,
    # so it is the last; a6 waits for other identities' votes and does not count.
    assert admit_stream(ids, 4, 0.5) == (0, 1, 3, 5, 2, 4, 7)
    assert admit_stream(ids, 4, None) == tuple(range(8))
    # Anonymous votes (None) are each their own identity, never passed over. Window 2, k = 1:
    # (None0, a1), (None2, a3), then a4 alone (a5 passed over): partial, the last.
    assert admit_stream([None, "a", None, "a", "a", "a"], 2, 0.5) == (0, 1, 2, 3, 4)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.sampled_from(["a", "b", "c", "d", None]), max_size=60),
    window=st.integers(1, 8),
    share=st.sampled_from([0.1, 0.25, 0.5, 1.0]),
)
def test_the_stream_is_the_learner_s_batches_one_after_another(ids, window, share):
    out = admit_stream(ids, window, share)
    assert out == naive_stream(ids, window, share)
    # In every window of the admitted stream an identity has at most k votes.
    k = max(1, int(share * window + 1e-9))
    for start in range(0, len(out), window):
        named = [ids[i] for i in out[start : start + window] if ids[i] is not None]
        assert all(named.count(who) <= k for who in named)


def test_who_may_vote():
    capped, open_ = Electorate(0.25, 16, VoteCap.IDENTITIES), Electorate(None, 16)
    assert may_vote(Vote(1.0, "key:k1", True, True), capped)
    assert not may_vote(Vote(1.0, "key:k1", False, True), capped)  # logged train: false
    assert not may_vote(Vote(1.0, "key:k1", True, False), capped)  # the key opted out since
    assert not may_vote(Vote(1.0, "key:k1", None, False), capped)  # no flag: the key decides
    assert may_vote(Vote(1.0, "user:u", None, None), capped)  # indexed before 0016, a user
    assert not may_vote(Vote(1.0, None, True, None), capped)  # unknown sender, cap on
    assert may_vote(Vote(1.0, None, True, None), open_)  # cap off: anonymous votes
    assert not may_vote(Vote(1.0, None, False, None), open_)
    # A cap that binds keys only (the default): an anonymous answer votes, as its own identity.
    keys_only = Electorate(0.25, 16)
    assert may_vote(Vote(1.0, None, True, None), keys_only)
    assert not may_vote(Vote(1.0, None, True, False), keys_only)


def test_which_senders_the_cap_binds():
    """The default binds API keys not trusted; ``identities`` binds ``user`` fields too."""
    keys_only = Electorate(0.5, 2).with_trusted(frozenset({"key:t"}))
    every = Electorate(0.5, 2, VoteCap.IDENTITIES).with_trusted(frozenset({"key:t"}))
    assert [keys_only.bound(i) for i in ("key:k1", "key:t", "user:ann", None)] == ["key:k1", None, None, None]
    assert [every.bound(i) for i in ("key:k1", "key:t", "user:ann", None)] == [
        "key:k1",
        None,
        "user:ann",
        None,
    ]
    # Four votes of user:ann then one of key:k1, share 0.5 of windows of 2 (one a window):
    # binding keys only, ann's votes are each their own identity and all 5 count; binding every
    # identity, window 1 takes ann and k1, window 2 only ann (partial, the last): 3 count, 2
    # held back.
    votes = [Vote(1.0, "user:ann")] * 4 + [Vote(0.0, "key:k1")]
    assert tally(votes, keys_only) == Tally(votes, 0)
    assert tally(votes, every) == Tally([votes[0], votes[4], votes[1]], 2)


def test_one_identity_flooding_an_arm_keeps_its_share():
    """An attacker's 40 ratings of 0 interleaved with 12 honest ratings of 1 (4 identities, 3
    each), capped at share 0.25 of windows of 4 (k = 1). Each full window holds the attacker's
    oldest waiting rating and 3 honest ones: 12 honest ratings fill 4 windows; the fifth holds
    only the attacker's next rating (partial: the last)."""
    votes = [Vote(0.0, "key:evil") for _ in range(40)]
    honest = [Vote(1.0, f"user:{u}") for _ in range(3) for u in "wxyz"]
    stream = [x for pair in zip(votes, honest, strict=False) for x in pair] + votes[len(honest) :]
    counted = ballot(stream, Electorate(0.25, 4))
    # 12 honest + 4 attacker in the four full windows, + 1 in the partial fifth: 17 votes, 5 zeros.
    assert (len(counted), counted.count(0.0)) == (17, 5)
    # Uncapped: every vote, 40 zeros of 52.
    assert ballot(stream, Electorate(None, 4)).count(0.0) == 40


def test_the_vote_window_makes_the_share_exact():
    # share 0.25, batch 16: windows of 16, k = 4. share 0.01, batch 16: a batch holds at least
    # 1 of 16 (6.25%); the votes' windows are ⌈1/0.01⌉ = 100 long, k = 1: 1%.
    assert Electorate.of(0.25, 16) == Electorate(0.25, 16)
    assert Electorate.of(0.01, 16) == Electorate(0.01, 100)
    assert Electorate.of(1 / 3, 2) == Electorate(1 / 3, 3)  # ⌈3 − 1e-9⌉ = 3, not 4
    assert Electorate.of(None, 16) == Electorate(None, 16)


def test_who_holds_an_arm_s_votes():
    # a, a, a, b and one anonymous: 5 votes, 2 identified senders, a holds 3 of 5.
    votes = [Vote(1.0, "key:a")] * 3 + [Vote(0.0, "user:b"), Vote(1.0, None)]
    assert Senders.of(Tally(votes, 3)) == Senders(votes=5, identified=2, top_share=0.6, held_back=3)
    # Anonymous alone: no sender identified, so no share held; no votes at all: zeros.
    assert Senders.of(Tally([Vote(1.0, None)] * 4)) == Senders(4, 0, 0.0)
    assert Senders.of(Tally([])) == Senders(0, 0, 0.0)


def test_a_trusted_key_is_not_bound_by_the_cap():
    """A trusted key (the operator vouches for it: a backend relaying its users) passes the cap
    as anonymous votes do, each vote its own identity, and holds no sender's share."""
    votes = [Vote(1.0, "key:t")] * 4 + [Vote(0.0, "key:a")]
    capped = Electorate(0.5, 2)  # k = max(1, ⌊0.5·2⌋) = 1 vote of a sender per window of 2
    # Untrusted: window 1 takes t (index 0) and a (4); window 2 has only t (1) left to take, so
    # it is partial and the last: t, a, t count, the other two t are held back.
    assert [v.identity for v in counted(votes, capped)] == ["key:t", "key:a", "key:t"]
    assert tally(votes, capped).held_back == 2
    # Trusted: t, t | t, t | a, all 5.
    trusted = capped.with_trusted(frozenset({"key:t"}))
    assert tally(votes, trusted) == Tally(votes, 0)
    # Opted out still wins over trusted: its votes never count.
    assert counted([Vote(1.0, "key:t", key_train=False)], trusted) == []
    assert Senders.of(Tally(votes), trusted.trusted) == Senders(votes=5, identified=1, top_share=0.2)
