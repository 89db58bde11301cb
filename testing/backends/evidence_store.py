"""The prompt_evidence table's tests on any database (core/evidence_store.py, migration 0002):
migration up/down/up with the model matching, hand-computed reads, the caller's transaction,
validation before writing, thousands of versions, order and batching, the offline file. They
take ``new_database`` (tests/unit: SQLite; tests/integration: PostgreSQL) and run in
tests/unit/core/test_evidence_store.py and tests/integration/test_evidence_store.py."""

from __future__ import annotations

import json
import math
import random
import threading
import uuid
from collections.abc import Iterator
from functools import reduce

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import inspect
from sqlalchemy.orm import Session

from core.db import Base, downgrade, make_engine, migrate
from core.evidence import RHO, EvidenceState, event_coordinate
from core.evidence_store import EvidenceStore, init_from_file, read_rollouts_file, stored_prompt_id

__all__ = [
    "store",
    "test_migration_up_down_up",
    "test_hand_computed_offline_prior_and_two_results",
    "test_hand_computed_default_prior_sits_at_the_earliest_result",
    "test_unknown_prompt_reads_the_default_prior",
    "test_offline_init_keeps_results_and_is_idempotent",
    "test_add_results_joins_the_callers_transaction",
    "test_add_results_validates_before_writing",
    "test_thousands_of_versions_in_sql",
    "test_receipt_order_and_batching_do_not_matter",
    "test_rollouts_file_and_init",
]

REVISION = "0002"


@pytest.fixture(scope="module")
def store(new_database) -> Iterator[EvidenceStore]:
    """One migrated evidence store for the module's tests, on the tier's database."""
    with new_database() as url:
        migrate(url, REVISION)
        engine = make_engine(url)
        try:
            yield EvidenceStore(engine)
        finally:
            engine.dispose()


def pid(tag: str) -> str:
    """A prompt id no other test (or hypothesis example) uses."""
    return f"{tag}-{uuid.uuid4().hex[:12]}"


def add(store: EvidenceStore, results) -> None:
    with store.engine.begin() as conn:
        store.add_results(conn, results)


def expected_state(results, prior=(4.0, 4.0), prior_version=None) -> EvidenceState:
    """Sequential sum: the default prior sits at the earliest result version."""
    v0 = min(v for _, _, v in results) if prior_version is None else prior_version
    return reduce(lambda s, r: s.add(r[1], r[2]), results, EvidenceState(*prior, v0))


def assert_same(got: EvidenceState, want: EvidenceState, rel: float = 1e-9) -> None:
    assert got.ref_version == want.ref_version
    assert got.alpha == pytest.approx(want.alpha, rel=rel, abs=1e-280)
    assert got.beta == pytest.approx(want.beta, rel=rel, abs=1e-280)


def test_migration_up_down_up(new_database):
    with new_database() as url:
        for _ in range(2):
            migrate(url, REVISION)
            engine = make_engine(url)
            assert "prompt_evidence" in inspect(engine).get_table_names()
            _assert_model_matches(engine)
            engine.dispose()
            downgrade(url, "0001")
            engine = make_engine(url)
            names = inspect(engine).get_table_names()
            engine.dispose()
            assert "prompt_evidence" not in names and "trajectory_index" in names
        migrate(url, REVISION)


def _assert_model_matches(engine) -> None:
    """The ORM model ``PromptEvidence`` and migration 0002 describe the same table."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "include_object": lambda obj, name, type_, reflected, other: (
                    type_ != "table" or name == "prompt_evidence"
                ),
            },
        )
        diffs = compare_metadata(ctx, Base.metadata)
    assert diffs == []


def test_hand_computed_offline_prior_and_two_results(store):
    # Prior Jeffreys(0 of 0) = (4, 4) at version 0; R = 1 at version 2, R = 0 at version 3.
    # Read at 5: α = 4ρ⁵ + ρ³ = 2.0516357421875 + 0.669921875 = 2.7215576171875,
    #            β = 4ρ⁵ + ρ² = 2.0516357421875 + 0.765625    = 2.8172607421875.
    p = pid("hand")
    assert store.init_from_rollouts([(p, 0, 0)]) == 1
    add(store, [(p, 1, 2), (p, 0, 3)])
    b = store.read(p, 5)
    assert b.alpha == pytest.approx(2.7215576171875, rel=1e-12)
    assert b.beta == pytest.approx(2.8172607421875, rel=1e-12)
    assert b.value == pytest.approx(0.4913606911447084, rel=1e-12)
    assert (b.version, b.z) == (5, pytest.approx(event_coordinate(5)))
    row = store.get(p)
    assert (row.n_results, row.reward_sum, row.offline_n, row.offline_successes) == (2, 1.0, 0, 0)
    # Stored at ref version 3: α_ref = ρ·1 + 0 = 0.875, β_ref = 0 + 1 = 1.
    assert (row.online.alpha, row.online.beta, row.online.ref_version) == (
        pytest.approx(0.875, rel=1e-12),
        pytest.approx(1.0, rel=1e-12),
        3,
    )


def test_hand_computed_default_prior_sits_at_the_earliest_result(store):
    # No offline init: prior (4, 4) at version 2 (the earliest result). Read at 5:
    # α = 4ρ³ + ρ³ = 5·0.669921875 = 3.349609375, β = 4ρ³ + ρ² = 2.6796875 + 0.765625 = 3.4453125.
    p = pid("default")
    add(store, [(p, 0, 3)])
    add(store, [(p, 1, 2)])  # arrives later, generated earlier: moves the prior to version 2
    b = store.read(p, 5)
    assert b.alpha == pytest.approx(3.349609375, rel=1e-12)
    assert b.beta == pytest.approx(3.4453125, rel=1e-12)
    assert store.get(p).prior.ref_version == 2


def test_unknown_prompt_reads_the_default_prior(store):
    b = store.read(pid("unknown"), 7)
    assert (b.alpha, b.beta, b.value, b.version) == (4.0, 4.0, 0.5, 7)
    assert b.z == pytest.approx(-7 * math.log(RHO))
    assert store.get(pid("unknown")) is None


def test_offline_init_keeps_results_and_is_idempotent(store):
    p = pid("reinit")
    add(store, [(p, 1, 4), (p, 1, 5)])
    for _ in range(2):
        # 3 of 8 at version 1: α0 = 8·3.5/9 = 28/9, β0 = 44/9.
        store.init_from_rollouts([(p, 3, 8)], version=1)
        row = store.get(p)
        assert (row.prior.alpha, row.prior.beta) == (pytest.approx(28 / 9), pytest.approx(44 / 9))
        assert row.prior.ref_version == 1 and row.n_results == 2
    assert_same(row.state, expected_state([(p, 1, 4), (p, 1, 5)], prior=(28 / 9, 44 / 9), prior_version=1))
    # A result older than an offline prior does not move it.
    add(store, [(p, 0, 0)])
    assert store.get(p).prior.ref_version == 1


def test_add_results_joins_the_callers_transaction(store):
    p = pid("txn")
    with store.engine.connect() as conn:
        with conn.begin() as txn:
            assert store.add_results(conn, [(p, 1, 1), (p, 0, 2)]) == 2
            txn.rollback()
    assert store.get(p) is None
    with Session(store.engine) as session:
        store.add_results(session, [(p, 1, 1)])
        session.rollback()
    assert store.get(p) is None
    with Session(store.engine) as session, session.begin():
        store.add_results(session, [(p, 1, 1)])
    assert store.get(p).n_results == 1


@pytest.mark.parametrize(
    "bad", [("x", 1.5, 0), ("x", float("nan"), 0), ("x", 1, -1), ("", 1, 0), ("x" * 129, 1, 0)]
)
def test_add_results_validates_before_writing(store, bad):
    p = pid("valid")
    with pytest.raises(ValueError):
        add(store, [(p, 1, 0), bad])
    assert store.get(p) is None


def test_thousands_of_versions_in_sql(store):
    # Terms up to 20 000 versions old: PostgreSQL must not raise "value out of range: underflow".
    p = pid("long")
    results = [(p, float(i % 2), 4 * i) for i in range(0, 5000, 7)]
    add(store, results[:3])
    add(store, [(p, 1, 20_000)])
    add(store, results[3:])
    got = store.get(p).state
    assert_same(got, expected_state(results + [(p, 1, 20_000)]))
    assert store.read(p, 20_001).alpha == pytest.approx(got.at(20_001)[0], rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.sampled_from([0.0, 1.0, 0.25]), st.integers(0, 3000)), min_size=1, max_size=25
    ),
    data=st.data(),
)
def test_receipt_order_and_batching_do_not_matter(store, items, data):
    perm = data.draw(st.permutations(items))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(items)), max_size=4)))
    a, b = pid("perm-a"), pid("perm-b")
    add(store, [(a, r, v) for r, v in items])  # one batch, original order
    bounds = [0, *cuts, len(perm)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):  # several batches, permuted
        add(store, [(b, r, v) for r, v in perm[lo:hi]])
    sa, sb = store.get(a), store.get(b)
    assert_same(sa.state, sb.state)
    assert_same(sa.state, expected_state([(a, r, v) for r, v in items]))
    assert sa.n_results == sb.n_results == len(items)


def hammer(store: EvidenceStore, prompts: list[str], threads: int, per_thread: int, batch: int) -> list:
    """``threads`` writers add ``per_thread`` results each, ``batch`` per transaction."""
    rng = random.Random(1234)
    plans = [
        [(rng.choice(prompts), rng.choice([0.0, 1.0, 0.5]), rng.randrange(0, 60)) for _ in range(per_thread)]
        for _ in range(threads)
    ]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(plan: list) -> None:
        try:
            start.wait()
            for i in range(0, len(plan), batch):
                add(store, plan[i : i + batch])
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    workers = [threading.Thread(target=work, args=(plan,)) for plan in plans]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    return [r for plan in plans for r in plan]


def check_sum(store: EvidenceStore, prompts: list[str], all_results: list) -> None:
    for p in prompts:
        mine = [r for r in all_results if r[0] == p]
        row = store.get(p)
        assert row.n_results == len(mine)
        assert row.reward_sum == pytest.approx(sum(r for _, r, _ in mine), rel=1e-12)
        assert_same(row.state, expected_state(mine))


def test_rollouts_file_and_init(store, tmp_path):
    a, b = pid("file-a"), pid("file-b")
    lines = [
        {"prompt_id": a, "reward": 1},
        {"prompt_id": a, "reward": 0},
        {"prompt_id": a, "reward": 1.0},
        {"prompt_id": b, "successes": 3, "n": 8},
    ]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert read_rollouts_file(path) == {a: (2, 3), b: (3, 8)}
    assert init_from_file(path, store.engine, "secret") == 2
    # The file names prompts as clients do: each is stored under its keyed hash.
    a, b = stored_prompt_id("secret", a), stored_prompt_id("secret", b)
    # a: 2 of 3 → α0 = 8·2.5/4 = 5, β0 = 3.
    assert (store.get(a).prior.alpha, store.get(a).prior.beta) == (5.0, 3.0)
    assert store.get(b).prior.alpha == pytest.approx(28 / 9)
