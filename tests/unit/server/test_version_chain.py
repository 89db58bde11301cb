"""Served versions only go forward and never beyond the chain the database records (issue 23
finding 3), and evidence placed far ahead of a reader does not break reads.

The tester's case: ``POST /admin/load_policy`` of version 100000, one answer rated (its result
at version 100000 in ``prompt_evidence``), then version 0 loaded: every chat with that prompt
and both admin evidence routes failed, since re-expressing the evidence 100000 versions back
(``ρ^-100000``) overflows a double. Now the first load is refused (404: not recorded), a load
older than the served version is refused (409), and a row already holding such evidence is
read with its value intact and its mass capped (``EvidenceState.at_bounded``).

Admin routes run on the real app, database and log with ``testing.fakes.FakeEngine``;
the chat path's read of the same row is in tests/system/test_real_clients.py.
"""

from __future__ import annotations

import math

import httpx
import pytest

from core.db import make_engine, migrate
from core.evidence import RHO, EvidenceState
from core.evidence_store import EvidenceStore
from testing.fakes import FakeEngine, record_versions
from testing.servers import ADMIN, make_settings, running_server

SHA = {v: f"{v:064x}" for v in range(5)}


@pytest.fixture
async def chain(tmp_path):
    """A server serving version 3 of a recorded chain 0..3; yields (url, engine, settings)."""
    settings = make_settings(tmp_path)
    engine = FakeEngine(version=3)
    async with running_server(settings, engine, watch_policy=False) as url:
        record_versions(settings, {v: SHA[v] for v in range(4)})
        yield url, engine, settings


async def load(url: str, version: int, sha: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.post(
            "/admin/load_policy",
            headers=ADMIN,
            json={"version": version, "path": f"/policies/v{version}", "sha256": sha},
        )


async def test_a_version_not_recorded_is_refused(chain):
    url, engine, _ = chain
    r = await load(url, 100_000, SHA[0])
    assert r.status_code == 404 and r.headers["x-should-retry"] == "false"
    assert r.json()["error"] == {
        "message": "no policy version 100000 is recorded (GET /admin/policy_versions lists them): "
        "only a version the learner published can be served",
        "type": "invalid_request_error",
        "param": "version",
        "code": "not_found",
    }
    assert engine.swaps == [] and engine.version == 3


async def test_a_version_older_than_served_is_refused(chain):
    url, engine, _ = chain
    for version in (0, 2):
        r = await load(url, version, SHA[version])
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "version_behind" and r.json()["error"]["param"] == "version"
        assert (
            f"policy version {version} is older than the version served (3)" in r.json()["error"]["message"]
        )
    assert engine.swaps == []


async def test_a_checksum_other_than_the_recorded_one_is_refused(chain):
    url, engine, _ = chain
    r = await load(url, 3, SHA[4])
    assert r.status_code == 422 and r.json()["error"]["param"] == "sha256"
    assert engine.swaps == []


async def test_a_recorded_version_at_or_after_the_served_one_is_loaded(chain):
    url, engine, settings = chain
    record_versions(settings, {4: SHA[4]})
    r = await load(url, 3, SHA[3])  # the served version again: a reload
    assert r.status_code == 200, r.text
    r = await load(url, 4, SHA[4])
    assert r.status_code == 200 and r.json()["policy_version"] == 4
    assert [v for v, _, _ in engine.swaps] == [3, 4]


async def test_version_0_is_the_prepared_model_before_any_learner_recorded_it(tmp_path):
    settings = make_settings(tmp_path)
    engine = FakeEngine(version=0)
    async with running_server(settings, engine, watch_policy=False) as url:
        assert (await load(url, 0, SHA[0])).status_code == 200
        assert (await load(url, 1, SHA[1])).status_code == 404
    assert [v for v, _, _ in engine.swaps] == [0]


# ------------------------------------------------------------------ evidence far ahead


def poisoned_store(tmp_path) -> EvidenceStore:
    """A prompt rated once (R = 1) on an answer generated at version 100000: its row holds the
    default prior (4, 4) and the result (1, 0), all placed at version 100000."""
    url = f"sqlite:///{tmp_path / 'ev.db'}"
    migrate(url)
    store = EvidenceStore(make_engine(url))
    with store.engine.begin() as conn:
        store.add_results(conn, [("p", 1.0, 100_000)])
    return store


def test_evidence_far_ahead_of_the_reader_is_read_with_its_value(tmp_path):
    store = poisoned_store(tmp_path)
    # At version 100000: α = 4 + 1 = 5, β = 4 + 0 = 4, value 5/9.
    at_ref = store.read("p", 100_000)
    assert (at_ref.alpha, at_ref.beta, at_ref.value) == (5.0, 4.0, 5 / 9)
    # At version 0 the formula's factor ρ^-100000 = e^13353 overflows: α and β are re-expressed
    # k versions before 100000, the most for which α = 5·ρ^-k stays <= e^700:
    # k = floor((700 - ln 5)/-ln ρ) = floor((700 - 1.6094)/0.13353) = floor(5230.2).
    with pytest.raises(ValueError, match="overflow"):
        EvidenceState(5.0, 4.0, 100_000).at(0)
    k = math.floor((700 - math.log(5)) / -math.log(RHO))
    assert k == 5230
    b = store.read("p", 0)
    assert b.value == 5 / 9 and (b.version, b.z) == (0, 0.0)
    assert b.alpha == pytest.approx(5 * RHO**-k, rel=1e-12) and b.beta == pytest.approx(
        4 * RHO**-k, rel=1e-12
    )
    assert math.exp(700) * RHO < b.alpha <= math.exp(700)
    assert [(p, bl.value) for p, bl in store.top_uncertain(5, 0)] == [("p", 5 / 9)]


async def test_the_admin_evidence_routes_read_evidence_far_ahead(tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(version=0), watch_policy=False) as url:
        store = EvidenceStore(make_engine(settings.resolved_database_url))
        with store.engine.begin() as conn:
            store.add_results(conn, [("p", 1.0, 100_000)])
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=ADMIN) as http:
            one = await http.get("/admin/evidence/p")
            top = await http.get("/admin/evidence", params={"top": 5})
    assert one.status_code == 200, one.text
    assert one.json()["known"] is True and one.json()["at_version"]["value"] == 5 / 9
    assert top.status_code == 200, top.text
    assert [(p["prompt_id"], p["value"]) for p in top.json()["prompts"]] == [("p", 5 / 9)]
