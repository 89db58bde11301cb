"""The adapter table per policy (``server.adapters``; pure, no engine): adapters keyed by
(policy, version), a current adapter per policy, one set of slots for all of them.

The table's single-policy rules are in tests/integration/test_engine_adapters.py and tests/unit/server/test_canary.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.policies import GLOBAL
from server.adapters import AdapterTable, TableFull


def load(table: AdapterTable, version: int, policy: str = GLOBAL, hold: bool = False):
    """Reserve a slot and finish the load of ``policy``'s ``version``: ``(adapter, removable)``."""
    return table.loaded(
        table.reserve(),
        version,
        Path(f"/{policy}/v{version}"),
        f"{policy}-{version}",
        hold=hold,
        policy=policy,
    )


def test_two_policies_current_adapters_coexist_and_the_global_one_stays_current():
    table = AdapterTable(capacity=4)
    g1, gone = load(table, 1)
    a1, gone2 = load(table, 1, "acme")
    assert gone == gone2 == []
    assert table.current is g1 and table.current_of(GLOBAL) is g1 and table.current_of("acme") is a1
    assert table.current_of("beta") is None  # no adapter: the base weights serve beta
    # A higher version of acme never displaces the global current one, nor the other way round.
    a5, gone = load(table, 5, "acme")
    assert table.current is g1 and table.current_of("acme") is a5 and gone == [a1]
    g2, gone = load(table, 2)
    assert table.current is g2 and table.current_of("acme") is a5 and gone == [g1]


def test_a_same_version_number_in_two_policies_is_two_adapters():
    table = AdapterTable(capacity=4)
    g3, _ = load(table, 3)
    a3, _ = load(table, 3, "acme")
    assert g3 is not a3 and (g3.lora_id, a3.lora_id) == (1, 2)
    assert table.find(3) is g3 and table.find(3, "acme") is a3 and table.find(3, "beta") is None
    # vLLM's prefix cache keys blocks by name: the names differ, and hold the policy.
    assert (g3.name, a3.name) == ("policy-v3-1", "policy-acme-v3-2")
    assert table.acquire(3) is g3 and table.acquire(3, "acme") is a3
    assert (g3.users, a3.users) == (1, 1)
    # Unpinning or releasing one leaves the other as it was.
    table.pin(3, policy="acme")
    assert a3.pinned and not g3.pinned


def test_releasing_or_removing_one_policys_old_version_never_touches_anothers_current():
    table = AdapterTable(capacity=5)
    g1, _ = load(table, 1)
    a1, _ = load(table, 1, "acme")
    held = table.acquire(policy="acme")  # an acme request starts on acme's version 1
    assert held is a1
    a2, gone = load(table, 2, "acme")
    assert table.current_of("acme") is a2 and gone == []  # acme's 1 still serves that request
    assert table.release(held) == [a1]  # removable: unused, not acme's current, not pinned
    assert table.current is g1 and g1.lora_id in table.adapters  # the global one stays
    table.removed(a1.lora_id)
    # acme's base again: only acme's current adapter goes; the global one serves on.
    assert table.clear_current("acme") == [a2]
    assert table.acquire(policy="acme") is None and table.acquire() is g1
    # A request dispatched at a version its policy no longer holds gets its policy's current
    # adapter, never another policy's adapter of that number.
    load(table, 7)
    b1, _ = load(table, 1, "beta")
    assert table.acquire(7, "beta") is b1 and table.acquire(1, "beta") is b1


def test_pinning_is_per_policy_and_names_the_policy_when_missing():
    table = AdapterTable(capacity=4)
    g4, _ = load(table, 4)
    a4, _ = load(table, 4, "acme", hold=True)
    assert a4.pinned and table.current_of("acme") is None  # a hold is never current
    assert table.pin(4, pinned=False) == []  # the global 4 is current: not removable
    assert table.pin(4, pinned=False, policy="acme") == [a4]
    with pytest.raises(KeyError, match="no adapter of version 4 of policy 'beta' is loaded"):
        table.pin(4, policy="beta")
    assert table.current is g4


def test_a_full_table_refuses_with_every_policys_adapters_serving():
    table = AdapterTable(capacity=4)
    old = [load(table, 1)[0], load(table, 1, "acme")[0]]
    users = [table.acquire(), table.acquire(policy="acme")]  # one request on each
    assert users == old
    new = [load(table, 2)[0], load(table, 2, "acme")[0]]
    # 4 slots, shared: two in use (old versions), two current (new ones).
    assert table.occupied() == 4
    with pytest.raises(TableFull, match="all 4 adapter slots are taken \\(4 loaded, 0 loading"):
        table.reserve()
    assert [table.current, table.current_of("acme")] == new
    assert table.acquire() is new[0] and table.acquire(1, "acme") is old[1]
    # Both acme requests on version 1 end: it frees a slot, which any policy's load may take.
    assert table.release(users[1]) == []  # one of its two users left
    assert table.release(users[1]) == [old[1]]
    table.removed(old[1].lora_id)
    b1, _ = load(table, 1, "beta")
    assert table.current_of("beta") is b1 and table.occupied() == 4


def test_a_table_bound_to_a_policy_sees_that_policy_and_shares_the_slots():
    table = AdapterTable(capacity=3)
    acme = table.of("acme")
    g1, _ = load(table, 1)
    lora_id = acme.reserve()
    a1, gone = acme.loaded(lora_id, 1, Path("/acme/v1"), "a1")
    assert gone == [] and a1.policy == "acme"
    assert acme.current is a1 and acme.find(1) is a1 and table.current is g1
    assert (acme.capacity, acme.occupied()) == (3, 2)  # the whole table's
    assert table.of(GLOBAL).find(1) is g1 and table.of(GLOBAL).current is g1
    assert acme.acquire() is a1 and acme.release(a1) == []  # still acme's current
    acme.pin(1)
    assert acme.clear_current() == [] and a1.pinned  # pinned: stays
    assert acme.pin(1, pinned=False) == [a1]
    acme.removed(a1.lora_id)
    assert acme.occupied() == 1 and acme.current is None
