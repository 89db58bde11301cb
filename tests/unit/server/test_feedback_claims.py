"""First-wins feedback claims (server/store.py): a stuck claim is taken over, a given one never."""

from __future__ import annotations

from sqlalchemy import select, update

from core.claims import CLAIM_TIMEOUT
from core.db import FeedbackClaim, make_engine, migrate
from core.records import utcnow
from server.store import ServerStore


def store_at(tmp_path) -> ServerStore:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    return ServerStore(make_engine(url))


def age_claim(store: ServerStore, target: str, by) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            update(FeedbackClaim).where(FeedbackClaim.target == target).values(claimed_at=utcnow() - by)
        )


def test_a_fresh_claim_is_not_taken_over(tmp_path):
    store = store_at(tmp_path)
    assert store.claim("t:a") is True
    assert store.claim("t:a") is False


def test_a_claim_older_than_the_timeout_is_taken_over_once(tmp_path):
    # The first holder crashed mid-append (no 202 was sent): after CLAIM_TIMEOUT another request
    # may take the claim, and only one of two competitors wins it.
    store = store_at(tmp_path)
    assert store.claim("t:a")
    age_claim(store, "t:a", CLAIM_TIMEOUT * 2)
    assert store.claim("t:a") is True
    assert store.claim("t:a") is False


def test_a_received_claim_is_never_taken_over(tmp_path):
    store = store_at(tmp_path)
    assert store.claim("t:a")
    store.mark_received("t:a", 1.0)
    age_claim(store, "t:a", CLAIM_TIMEOUT * 10)
    assert store.claim("t:a") is False


def test_a_released_claim_can_be_claimed_again(tmp_path):
    store = store_at(tmp_path)
    assert store.claim("t:a")
    store.release("t:a")
    assert store.claim("t:a") is True


def test_a_taken_over_claim_is_neither_released_nor_marked_by_its_old_holder(tmp_path):
    # A's append outlived the claim timeout; B took the claim over. A's 503 (release) must not
    # drop B's claim, nor a late mark of A's confirm A: the claim stays B's.
    store = store_at(tmp_path)
    assert store.claim("t:a", "A")
    age_claim(store, "t:a", CLAIM_TIMEOUT * 2)
    assert store.claim("t:a", "B") is True
    store.release("t:a", "A")
    store.mark_received("t:a", 0.0, "A")
    assert claim_row(store, "t:a") == ("claimed", None, "B")
    store.mark_received("t:a", 1.0, "B")
    assert claim_row(store, "t:a") == ("received", 1.0, "B")
    store.release("t:a", "B")
    assert claim_row(store, "t:a") == ("received", 1.0, "B")


def claim_row(store: ServerStore, target: str):
    with store.engine.connect() as conn:
        return tuple(
            conn.execute(
                select(FeedbackClaim.state, FeedbackClaim.reward, FeedbackClaim.feedback_id).where(
                    FeedbackClaim.target == target
                )
            ).one()
        )
