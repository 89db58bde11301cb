"""Replicas that swap together (issue 14, docs/design.md §3): two ``saoserve serve`` processes and one
``saoserve learn`` over PostgreSQL and a Kafka log (tansu), started as a user starts them.

The traffic goes round robin over the two replicas and each answer's feedback goes to either
one (a user behind a load balancer): every accepted feedback is trained exactly once, both
replicas serve each published version, a replica started after the last version comes up on
it, and prompt evidence written through one replica is what the other freezes at dispatch.
The delay from each policy event to the replicas serving it is printed with the test's output.
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import select, text

from core.db import FeedbackClaim, LearnerSample, LearnerStep, PolicyVersion, alembic_config, make_engine
from core.evidence import RHO
from testing import ROOT
from testing.dependencies import TansuBroker, fresh_pg_database
from testing.replicas import ADMIN, Deployment, Replica, metric, policy_events, swap_delays, wait_serving

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.kafka]

BATCH = 4
ROUNDS = 3
MAX_TOKENS = 8
# Chat k of a round goes to replica k % 2 and its feedback to replica FEEDBACK_TO[k]: A→B, B→B,
# A→A, B→A, so every round has feedback taken by the other replica and by the same one.
FEEDBACK_TO = (1, 1, 0, 0)
EVIDENCE_PROMPT = "replica-evidence"
# Per round: (chat index that asks EVIDENCE_PROMPT, its reward). Round 1 writes a success
# through A, round 2 reads it on B and writes a failure through B, round 3 reads both on A.
EVIDENCE = {1: (2, 1.0), 2: (1, 0.0), 3: (2, 1.0)}
# Seconds allowed from a version's publication to both replicas serving it: a 1 s poll, the
# sha256 of the weights and the reload, on two busy cores.
SWAP_BOUND_S = 30.0


def expected_baseline(round_: int) -> dict:
    """The frozen baseline of round ``round_``'s evidence chat, dispatched at version round−1.

    Default prior (4, 4) at the version of the prompt's first result (0). Round 1: no result,
    the prior itself. Round 2 (at v1): R=1 from v0 → α = 5ρ, β = 4ρ. Round 3 (at v2): R=1 from
    v0 and R=0 from v1 → α = 4ρ² + ρ², β = 4ρ² + ρ.
    """
    v = round_ - 1
    alpha, beta = {1: (4.0, 4.0), 2: (5 * RHO, 4 * RHO), 3: (5 * RHO**2, 4 * RHO**2 + RHO)}[round_]
    return {
        "alpha": alpha,
        "beta": beta,
        "value": alpha / (alpha + beta),
        "version": v,
        "z": -v * math.log(RHO),
    }


def chat(replica: Replica, k: int, round_: int, prompt_id: str | None = None) -> dict:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": f"Round {round_}, question {k}: name a colour."}],
        "max_tokens": MAX_TOKENS,
    }
    if prompt_id is not None:
        body["prompt_id"] = prompt_id
    r = httpx.post(f"{replica.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert int(r.headers["x-policy-version"]) == out["policy_version"]
    return out


def feedback(replica: Replica, answer: dict, reward: float | None, thumbs: str | None = None) -> int:
    body = {"id": answer["id"], "feedback_token": answer["feedback_token"]}
    body |= {"reward": reward} if reward is not None else {"thumbs": thumbs}
    return httpx.post(f"{replica.url}/v1/feedback", json=body, timeout=60).status_code


def wait_published(db, version: int, timeout_s: float, learner) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with db.connect() as conn:
            status = conn.execute(
                select(PolicyVersion.status).where(PolicyVersion.version == version)
            ).scalar_one_or_none()
        if status == "published":
            return
        if not learner.alive():
            raise RuntimeError(f"the learner exited with {learner.proc.returncode}:\n{learner.tail()}")
        time.sleep(0.2)
    raise TimeoutError(f"version {version} not published within {timeout_s:.0f}s:\n{learner.tail()}")


def test_concurrent_migrations_on_a_fresh_database():
    """Replicas and the learner all migrate at start: four at once on an empty PostgreSQL
    database all succeed (before migrations/env.py took an advisory lock, all but one failed
    on tables another had just created)."""
    with fresh_pg_database() as url:
        code = f"from core.db import migrate; migrate({url!r})"
        procs = [
            subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True)
            for _ in range(4)
        ]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0, 0], [e[-500:] for e in errors]
        head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
        db = make_engine(url)
        with db.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [head]
        db.dispose()


def test_two_replicas_and_a_learner_swap_together(model_dir, tmp_path, capsys):
    t_start = time.time()
    broker = TansuBroker()
    broker.start()
    with fresh_pg_database("saoreplicas") as pg:
        dep = Deployment(home=tmp_path, database_url=pg, log_url=broker.url, model_dir=model_dir)
        db = make_engine(pg)
        try:
            run(dep, db, capsys, t_start)
        except BaseException:
            with capsys.disabled():
                print("\n" + dep.tails())
            raise
        finally:
            dep.stop()
            db.dispose()
            broker.kill()
            # Four float32 versions (2 GB); pytest keeps the last runs' folders.
            shutil.rmtree(tmp_path / "policies", ignore_errors=True)


def play_rounds(replicas: tuple[Replica, Replica], db, learner) -> dict:
    """ROUNDS rounds of BATCH chats over both replicas, their feedback, then the version the
    learner trains on them served by both. Returns the accepted ids, each round's ids, each
    version's swapped-at times per replica, and the evidence chats' frozen baselines."""
    a, b = replicas
    out = {"accepted": [], "round_ids": {}, "swapped": {}, "baselines": {}}
    with ThreadPoolExecutor(BATCH) as pool:
        for rnd in range(1, ROUNDS + 1):
            ev_k, ev_reward = EVIDENCE[rnd]
            answers = list(
                pool.map(
                    lambda k, rnd=rnd, ev_k=ev_k: chat(
                        replicas[k % 2], k, rnd, EVIDENCE_PROMPT if k == ev_k else None
                    ),
                    range(BATCH),
                )
            )
            # Both replicas serve the previous round's version (the learner can publish the
            # next one only from this round's feedback).
            assert [x["policy_version"] for x in answers] == [rnd - 1] * BATCH
            ids = [x["id"] for x in answers]
            for k, answer in enumerate(answers):
                if k == ev_k:
                    statuses = [feedback(replicas[FEEDBACK_TO[k]], answer, ev_reward)]
                elif rnd == 2 and k == 0:
                    # The same feedback sent to both replicas at once: first wins across replicas.
                    statuses = sorted(
                        pool.map(lambda r, answer=answer: feedback(r, answer, None, "up"), replicas)
                    )
                    assert statuses == [202, 409]
                    statuses = [202]
                else:
                    thumbs = "up" if (k + rnd) % 2 else "down"
                    statuses = [feedback(replicas[FEEDBACK_TO[k]], answer, None, thumbs)]
                assert statuses == [202], (rnd, k, statuses)
            if rnd == 1:
                # Chat 0's feedback went to B; the same feedback through A is a second one.
                assert feedback(a, answers[0], None, "up") == 409
            out["accepted"] += ids
            out["round_ids"][rnd] = ids
            # The evidence chat's record as logged, read through the replica that did not take it.
            other = replicas[(ev_k + 1) % 2]
            rec = httpx.get(f"{other.url}/admin/trajectories/{ids[ev_k]}", headers=ADMIN, timeout=30)
            assert rec.status_code == 200, rec.text
            out["baselines"][rnd] = rec.json()["baseline"]

            wait_published(db, rnd, 420, learner)
            out["swapped"][rnd] = wait_serving([a, b], rnd, timeout_s=120)
    return out


def run(dep: Deployment, db, capsys, t_start: float) -> None:
    a, b = dep.serve("replica-a"), dep.serve("replica-b")
    learner = dep.learn("--batch-size", str(BATCH))
    startup = dep.wait_ready([a, b])
    replicas = (a, b)
    played = play_rounds(replicas, db, learner)
    accepted, round_ids = played["accepted"], played["round_ids"]

    # A replica started after the last version comes up on it (PolicyWatcher.catch_up). The
    # learner has published its last version: stopping it leaves room for a third engine (a
    # learner and three replicas hold ~15 GB).
    learner.stop()
    c = dep.serve("replica-c")
    events = policy_events(dep.log_url)
    with db.connect() as conn:
        steps = conn.execute(
            select(LearnerStep.version, LearnerStep.metrics).order_by(LearnerStep.version)
        ).all()
        claims = dict(conn.execute(select(FeedbackClaim.target, FeedbackClaim.state)).all())
        waiting = conn.execute(select(LearnerSample.id)).scalars().all()
        versions = dict(conn.execute(select(PolicyVersion.version, PolicyVersion.created_at)).all())

    # Every accepted feedback trained exactly once, in the step of its round.
    assert [v for v, _ in steps] == list(range(1, ROUNDS + 1))
    trained = [sid for _, m in steps for sid in m["sample_ids"]]
    assert Counter(trained) == Counter(accepted) and len(accepted) == ROUNDS * BATCH
    assert [sorted(m["sample_ids"]) for _, m in steps] == [sorted(round_ids[r]) for r in range(1, ROUNDS + 1)]
    assert claims == {f"t:{i}": "received" for i in accepted}
    assert waiting == []

    # One event per version, in order, created with its database row.
    assert [e.version for e in events] == list(range(1, ROUNDS + 1))
    assert all(e.created_at == versions[e.version] for e in events)
    delays = {e.version: swap_delays(e.created_at.timestamp(), played["swapped"][e.version]) for e in events}
    for v, d in delays.items():
        assert 0 < d["replica-a"] < SWAP_BOUND_S and 0 < d["replica-b"] < SWAP_BOUND_S, (v, d)

    # Traffic and feedback reached both replicas; each swapped to every version exactly once.
    with httpx.Client() as client:
        pages = {r.name: client.get(f"{r.url}/metrics").text for r in replicas}
    per_replica = ROUNDS * BATCH // 2
    for name, page in pages.items():
        assert metric(page, "saoserve_requests_total", stream="false", outcome="ok") == per_replica, name
        assert metric(page, "saoserve_feedback_total", result="accepted") >= per_replica - 1, name
        assert metric(page, "saoserve_policy_swaps_total", result="ok") == ROUNDS, name
    assert sum(metric(p, "saoserve_feedback_total", result="accepted") for p in pages.values()) == len(
        accepted
    )
    # Round 1's second feedback through A, and the loser of round 2's race (A or B).
    assert sum(metric(p, "saoserve_feedback_total", result="duplicate") or 0 for p in pages.values()) == 2

    # Evidence written through one replica (the learner joined its feedback) is what the other
    # froze at dispatch, exactly as computed by hand; the prompt's row agrees on both.
    for rnd, got in played["baselines"].items():
        want = expected_baseline(rnd)
        assert got["version"] == want["version"], rnd
        for key in ("alpha", "beta", "value", "z"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (rnd, key)
    for r in replicas:
        ev = httpx.get(f"{r.url}/admin/evidence/{EVIDENCE_PROMPT}", headers=ADMIN, timeout=30).json()
        assert (ev["n_results"], ev["reward_sum"]) == (3, 2.0), r.name

    late = dep.wait_ready([c])
    version, since, swaps = c.serving()
    assert (version, swaps) == (ROUNDS, 1.0)
    assert since >= c.started_at
    assert chat(c, 0, ROUNDS + 1)["policy_version"] == ROUNDS

    step_s = [m["step_time_s"] for _, m in steps]
    lasts = [d["last"] for d in delays.values()]
    spreads = [d["spread"] for d in delays.values()]
    with capsys.disabled():
        print("\n\ntwo replicas + learner (PostgreSQL, tansu); event = the policy event's created_at")
        print(f"{'version':>8}{'event→A s':>11}{'event→B s':>11}{'event→last s':>14}{'spread s':>10}")
        for v, d in delays.items():
            print(
                f"{v:>8}{d['replica-a']:>11.2f}{d['replica-b']:>11.2f}{d['last']:>14.2f}{d['spread']:>10.2f}"
            )
        print(
            f"event→last replica: median {statistics.median(lasts):.2f} s, max {max(lasts):.2f} s; "
            f"spread: median {statistics.median(spreads):.2f} s, max {max(spreads):.2f} s"
        )
        print(
            f"start-up: A {startup['replica-a']:.0f} s, B {startup['replica-b']:.0f} s (together); "
            f"late replica C {late['replica-c']:.0f} s, serving v{version} "
            f"{since - c.started_at:.0f} s after its start; learner steps "
            + ", ".join(f"{s:.1f}" for s in step_s)
            + f" s; test wall {time.time() - t_start:.0f} s"
        )
