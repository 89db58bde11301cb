"""Sealing a log's trajectory records per subject (core/sealing.py) and the keyed hash of client
prompt ids (core/evidence_store.py): pure, no database."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.evidence_store import is_hashed_prompt_id, lookup_prompt_ids, stored_prompt_id
from core.records import TrajectoryRecord, prompt_id_for, utcnow
from core.sealing import (
    KEY_BYTES,
    NONCE_BYTES,
    Subject,
    envelope,
    is_sealed,
    seal,
    subject_of,
    unseal,
)

SECRET = bytes(range(KEY_BYTES))  # 00 01 .. 1f: any 32 bytes


def record(**kw) -> TrajectoryRecord:
    base = dict(
        id="t1",
        prompt_id="p",
        created_at=utcnow(),
        model="m",
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        rollout_logprobs=[-0.5, -0.25],
        token_versions=[(0, 2)],
        dispatch_version=0,
        sampling={"temperature": 0.8, "max_tokens": 4},
        finish_reason="stop",
    )
    return TrajectoryRecord(**(base | kw))


def test_the_subject_of_a_record_is_its_key_and_its_user():
    assert subject_of(record(identity="key:k0123456789abcdef", user="alice")) == Subject(
        "k0123456789abcdef", "alice"
    )
    assert subject_of(record(identity="key:k0123456789abcdef")) == Subject("k0123456789abcdef", None)
    # Without a key the identity is the user's, and the subject is the user alone.
    assert subject_of(record(identity="user:alice", user="alice")) == Subject(None, "alice")
    assert subject_of(record()) is None  # nobody to forget: logged plain


def test_a_subjects_holder_is_the_sha256_of_the_pair_and_names_nobody_in_clear():
    holder = Subject("k0123456789abcdef", "alice").holder
    assert holder == hashlib.sha256(b'["k0123456789abcdef", "alice"]').hexdigest()
    assert "alice" not in holder and Subject(None, "alice").holder != Subject("alice", None).holder


def test_a_sealed_record_opens_under_its_key_only():
    plain = record(user="alice").to_json()
    value = seal("s1", SECRET, plain)
    assert is_sealed(value) and not is_sealed(plain)
    assert b"alice" not in value and b"[1,2,3]" not in value
    subject, nonce, data = envelope(value)
    # AES-GCM: the ciphertext is the plaintext's length plus a 16-byte tag; a 12-byte nonce.
    assert (subject, len(nonce), len(data)) == ("s1", NONCE_BYTES, len(plain) + 16)
    assert unseal(value, SECRET) == plain
    with pytest.raises(ValueError, match="does not open"):
        unseal(value, bytes(KEY_BYTES))  # another key
    env = json.loads(value)
    moved = json.dumps(env | {"subject": "s2"}, separators=(",", ":")).encode()
    with pytest.raises(ValueError, match="does not open"):
        unseal(moved, SECRET)  # moved under another subject: the subject is bound as associated data
    flipped = bytearray(base64.b64decode(env["data"]))
    flipped[0] ^= 1
    tampered = json.dumps(env | {"data": base64.b64encode(bytes(flipped)).decode()}, separators=(",", ":"))
    with pytest.raises(ValueError, match="does not open"):
        unseal(tampered.encode(), SECRET)


@pytest.mark.parametrize("value", [b"{}", b'{"sealed":"other/1"}', b'{"sealed":"saoserve.sealed/1"}', b"[1]"])
def test_what_is_not_an_envelope_is_refused_by_name(value):
    with pytest.raises(ValueError, match="not a sealed record"):
        envelope(value)


@given(st.binary(max_size=4096), st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES))
def test_sealing_round_trips_and_two_seals_differ(plain, secret):
    a, b = seal("s0", secret, plain), seal("s0", secret, plain)
    assert unseal(a, secret) == unseal(b, secret) == plain
    assert a != b  # a fresh nonce per record


def test_a_client_prompt_id_is_stored_as_its_keyed_hash():
    # h- + the first 32 hex digits of HMAC-SHA256(secret, "saoserve.prompt_id/1\0" + id).
    want = (
        "h-"
        + hmac.new(b"s3cret", b"saoserve.prompt_id/1\x00alice@example.com", hashlib.sha256).hexdigest()[:32]
    )
    got = stored_prompt_id("s3cret", "alice@example.com")
    assert got == want and len(got) == 34 and is_hashed_prompt_id(got)
    assert "alice" not in got
    assert stored_prompt_id("other", "alice@example.com") != got  # keyed: another secret, another id
    assert stored_prompt_id("s3cret", "alice@example.com") == got  # equal ids aggregate
    # The server's own form (a hash of the messages) is kept as it is, whoever computed it.
    own = prompt_id_for([{"role": "user", "content": "hi"}])
    assert stored_prompt_id("s3cret", own) == own
    # Anything else is hashed, an h- id a client made up too.
    assert stored_prompt_id("s3cret", got) != got
    assert lookup_prompt_ids("s3cret", "alice@example.com") == [got, "alice@example.com"]
    assert not is_hashed_prompt_id("alice@example.com") and not is_hashed_prompt_id("p-short")


@pytest.mark.parametrize("subject_id", ["", "s", "x1", 's1"', "S1"])
def test_a_subject_id_that_is_not_s_and_hex_is_refused(subject_id):
    with pytest.raises(ValueError, match="a subject id is s and hex digits"):
        seal(subject_id, SECRET, b"{}")
