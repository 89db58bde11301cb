"""The learner under faults (issue 13, docs/design.md §8): kill -9 at each named point of its
cycle and of the version lifecycle; every run audited from the database. Failed commits, pause
and clean stops are in tests/unit/learner/test_learner_restart.py, rollbacks in tests/unit/learner/guard/test_learner_rollback.py.

The harness runs the learner against a tiny random Llama (2 layers, hidden 32;
``testing.learner``), the database and the SQL-table log, fed with hand-made trajectory and
feedback records (no vLLM). Each learner life is a child forked from a fork server that has
imported torch, transformers and the learner but touched no database and run no torch op: a
fresh process in all but the import time, which would otherwise dominate each life. The child arms one fault
point (``learner.faults``) and dies there with ``os._exit(137)``; the next child restarts from
whatever the dead one left on disk and in the database. After the point kills, one life in
seven more is sent SIGKILL at a random moment.

``SAOSERVE_FAULT_KILLS`` sets the point kills per database (default 70: 10 per point); figures
for larger counts are in docs/reliability.md.

The lifecycle's points (``learner.faults.LIFECYCLE_POINTS``) are passed only when the gate or
the guard acts: three scenarios make them act on every version (a gate that rejects every
candidate; ratings that make the guard reject, or promote, every lineage), each killed at its
points and audited for the lifecycle too (``run_lifecycle_harness``).
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from sqlalchemy import func, select

from core.db import (
    DeadLetter,
    LearnerCounter,
    LearnerSample,
    LearnerStep,
    PendingJoin,
    PolicyVersion,
    QuarantinedSample,
    VersionStatusEvent,
    make_engine,
    migrate,
)
from core.lifecycle import ALLOWED, Stage
from core.logbus import open_log
from core.policy_store import CHECKPOINT_FILE, Layout, layout
from core.records import TOPIC_FEEDBACK, TOPIC_POLICY, utcnow
from learner.faults import CYCLE_POINTS, EXIT_CODE
from learner.resume import read_state
from testing.guard import add_rated
from testing.learner import BATCH, GATE_VOCAB, feed, gate_model_dir, tiny_model_dir
from testing.learner_faults import Lives
from testing.logs import read_topic

# Fed once per life: a feedback record the joiner cannot parse, set aside as a dead letter.
MALFORMED = b'{"schema": "saoserve.feedback/1", "reward": 2}'


# -------------------------------------------------------------------------------------- fork server


# -------------------------------------------------------------------------------------------- audit


def audit(engine, log, policy_dir: Path, fed: list[str], malformed: list[int]) -> dict:
    """Everything the database, log and disk must say after the last life; returns figures."""
    with engine.connect() as conn:
        versions = conn.execute(
            select(*PolicyVersion.__table__.columns).order_by(PolicyVersion.version)
        ).all()
        steps = conn.execute(
            select(LearnerStep.version, LearnerStep.metrics).order_by(LearnerStep.version)
        ).all()
        pending = conn.execute(select(PendingJoin.key, PendingJoin.kind)).all()
        waiting = conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one()
        letters = conn.execute(select(DeadLetter.kind, DeadLetter.topic, DeadLetter.log_offset)).all()
    top = versions[-1].version
    # Every malformed record set aside exactly once: its dead letter commits with the offsets.
    assert sorted(tuple(r) for r in letters) == [("malformed", TOPIC_FEEDBACK, o) for o in sorted(malformed)]
    # No version gap, parent chain consistent, every version published.
    assert [v.version for v in versions] == list(range(top + 1))
    assert [v.parent_version for v in versions] == [None, *range(top)]
    assert {v.status for v in versions} == {"published"}
    # Every feedback joined once and every sample trained exactly once, in exactly one version.
    assert waiting == 0
    assert {k for k, kind in pending if kind == "joined"} >= set(fed)
    assert [k for k, kind in pending if kind != "joined"] == []
    assert [s.version for s in steps] == list(range(1, top + 1))
    trained = Counter(i for _, m in steps for i in m["sample_ids"])
    assert set(trained) == set(fed) and set(trained.values()) == {1}
    assert top == len(fed) // BATCH
    # Every version announced; the events carry the committed checksums.
    events = {}
    for e in read_topic(log, TOPIC_POLICY):
        event = json.loads(e.value)
        events.setdefault(event["version"], set()).add(event["sha256"])
    assert sorted(events) == list(range(1, top + 1))
    assert all(events[v.version] == {v.sha256} for v in versions[1:])
    # Disk: no directory above the committed version, kept ones match their rows, the
    # checkpoint is not ahead of the database.
    from saoserve.model import weights_sha256

    on_disk = sorted(int(d.name[1:]) for d in policy_dir.glob("v[0-9]*"))
    assert on_disk and on_disk[-1] == top and all(d.name[1:].isdigit() for d in policy_dir.glob("v*"))
    for v in on_disk:
        assert weights_sha256(policy_dir / f"v{v:06d}") == versions[v].sha256
    assert torch.load(policy_dir / CHECKPOINT_FILE, weights_only=False)["version"] <= top
    return {"versions": top, "samples": len(fed), "dead_letters": len(letters)}


def harness_job(tmp_path: Path, db_url: str, model_dir: Path, estimator: str, **extra) -> dict:
    """What a learner life of the harness is given (``Lives``): its home, database, model, the
    policy folder ``tmp_path/policies``, the estimator and ``extra`` (``policy``, ``guard``)."""
    return dict(
        home=str(tmp_path),
        db=db_url,
        model_dir=str(model_dir),
        policy_dir=str(tmp_path / "policies"),
        estimator=estimator,
        **extra,
    )


def run_harness(tmp_path: Path, db_url: str, estimator: str, kills: int, policy: dict | None = None) -> dict:
    migrate(db_url)
    policy_dir = tmp_path / "policies"
    job = harness_job(tmp_path, db_url, tiny_model_dir(tmp_path / "model"), estimator, policy=policy)
    log = open_log(db_url)
    engine = make_engine(db_url)
    fed: list[str] = []
    malformed: list[int] = []
    outcomes: Counter = Counter()
    lives = Lives(job)
    try:
        for i in range(kills):
            point = CYCLE_POINTS[i % len(CYCLE_POINTS)]
            # 4 new samples = 2 steps of work: the step points are passed at least twice.
            n = (
                1 + (i // len(CYCLE_POINTS)) % 2
                if point not in ("after_read", "after_join_commit", "after_checkpoint")
                else 1
            )
            fed += feed(log, 4, len(fed), duplicate_feedback=i % 5 == 0)
            malformed.append(log.append(TOPIC_FEEDBACK, "p0", MALFORMED)[1])
            rc = lives.run(f"{point}:{n}")
            assert rc == EXIT_CODE, f"life {i} ({point}:{n}) ended with {rc}, not at its fault point"
            outcomes[point] += 1
        # kill -9 at random moments too: one life in seven, after 0.2-2 s (fixed seed).
        rng = random.Random(13)
        for _ in range(kills // len(CYCLE_POINTS)):
            fed += feed(log, 4, len(fed))
            rc = lives.run(None, kill_after_s=rng.uniform(0.2, 2.0))
            assert rc in (-signal.SIGKILL, 0)
            outcomes["random_sigkill" if rc else "random_finished"] += 1
        assert lives.run(None) == 0
    finally:
        lives.close()
    figures = audit(engine, log, policy_dir, fed, malformed)
    engine.dispose()
    log.close()
    return figures | {"kills": dict(outcomes)}


KILLS = int(os.environ.get("SAOSERVE_FAULT_KILLS", "70"))


@pytest.mark.slow
def test_kill_at_every_point_sqlite_sao(tmp_path):
    figures = run_harness(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", "sao", KILLS)
    assert sum(figures["kills"][p] for p in CYCLE_POINTS) == KILLS
    assert all(figures["kills"][p] for p in CYCLE_POINTS)
    print(figures)


@pytest.mark.slow
def test_kill_at_every_point_postgres_spo(tmp_path, pg_url):
    figures = run_harness(tmp_path, pg_url, "spo", KILLS)
    assert sum(figures["kills"][p] for p in CYCLE_POINTS) == KILLS
    assert all(figures["kills"][p] for p in CYCLE_POINTS)
    print(figures)


@pytest.mark.slow
def test_kill_at_every_point_sqlite_sao_lora(tmp_path):
    """The adapter path (issue 20): versions publish LoRA adapters, checkpoints hold them; two
    kills per point."""
    kills = 2 * len(CYCLE_POINTS)
    policy = {"kind": "lora", "rank": 2}
    figures = run_harness(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", "sao", kills, policy)
    assert all(figures["kills"][p] == 2 for p in CYCLE_POINTS)
    assert all(layout(d) == Layout.ADAPTER for d in (tmp_path / "policies").glob("v[0-9]*"))
    print(figures)


# --------------------------------------------------------------------------- the lifecycle's points


def rate_versions(engine, versions, reward: float, n: int, at) -> None:
    """``n`` rated single-turn answers with ``reward`` for each of ``versions``, dispatched at
    ``at`` (what the server's trajectory index and feedback claims hold; the guard reads them)."""
    with engine.begin() as conn:
        for v in versions:
            for i in range(n):
                add_rated(conn, f"r{v}-{i}", v, reward, at)


# Each scenario: the guard's config, the points its lives die at (each twice), and the stage of
# every trained version at the end. ``ratings``: (versions, reward, count, hours from now).
LIFECYCLE_SCENARIOS = {
    # min_length_ratio 100: no answer is 100 times the base's length, so every candidate is
    # rejected by the gate (deterministically, unlike a KL bound at the noise floor).
    "gate_rejects": dict(
        guard={"gate": {"min_length_ratio": 100.0, "max_new_tokens": 8}, "check_s": 0.0},
        points=("after_gate_reject", "after_commit", "during_step"),
        trained=Stage.REJECTED,
        ratings=(),
    ),
    # 30 wins of version 0 an hour ago against 30 losses of each later version (dated a day
    # ahead, so never in a promoted version's window): upper(Δ) < 0 at once, every lineage
    # is rejected and version 0's weights published again (tests/unit/learner/test_lifecycle_learner.py).
    "guard_rejects": dict(
        guard={"check_s": 0.0},
        points=("during_guard_reject", "after_rollback_commit", "after_policy_event"),
        trained=Stage.REJECTED,
        ratings=(([0], 1.0, 30, -1), (range(1, 60), 0.0, 30, 24)),
    ),
    # 60 wins each, δ = 0.5: lower(Δ) > −δ at once, every lineage is promoted.
    "guard_promotes": dict(
        guard={"check_s": 0.0, "delta": 0.5},
        points=("during_guard_promote", "after_guard_promote"),
        trained=Stage.PROMOTED,
        ratings=(([0], 1.0, 60, -1), (range(1, 40), 1.0, 60, 24)),
    ),
}


def run_lifecycle_harness(tmp_path: Path, db_url: str, scenario: str) -> dict:
    """Lives killed twice at each of the scenario's points (4 new samples each), then one that
    runs until everything is trained and decided; returns ``lifecycle_audit``'s figures."""
    case = LIFECYCLE_SCENARIOS[scenario]
    migrate(db_url)
    job = harness_job(tmp_path, db_url, gate_model_dir(tmp_path / "model"), "sao", guard=case["guard"])
    log = open_log(db_url)
    engine = make_engine(db_url)
    now = utcnow()
    for versions, reward, n, hours in case["ratings"]:
        rate_versions(engine, versions, reward, n, now + timedelta(hours=hours))
    fed: list[str] = []
    kills: Counter = Counter()
    lives = Lives(job)
    try:
        for point in [p for p in case["points"] for _ in range(2)]:
            fed += feed(log, 4, len(fed), vocab=GATE_VOCAB)
            rc = lives.run(f"{point}:1")
            assert rc == EXIT_CODE, f"a life armed at {point} ended with {rc}, not there"
            kills[point] += 1
        assert lives.run(None) == 0
    finally:
        lives.close()
    figures = lifecycle_audit(engine, log, fed, case["trained"])
    figures["restores_kept"] = kept_states_audit(engine, tmp_path / "policies")
    engine.dispose()
    log.close()
    return figures | {"kills": dict(kills)}


def kept_states_audit(engine, policy_dir: Path) -> int:
    """Every restore's kept learner state (``learner.resume.write_state``, written before its
    commit) is the state kept for the version it restores: policy, critic, both optimizers,
    step count, baselines, tensor for tensor, however the lives died (issue 40, item 5);
    returns how many restores' states were compared (the prune keeps the newest)."""
    with engine.connect() as conn:
        restores = {
            v: m["rollback_to"]
            for v, m in conn.execute(select(PolicyVersion.version, PolicyVersion.metrics))
            if (m or {}).get("rollback_to") is not None
        }
    compared = 0
    for v, target in restores.items():
        kept, source = read_state(policy_dir, v), read_state(policy_dir, target)
        if kept is None or source is None:
            continue
        assert same(kept["learner"], source["learner"]), (v, target)
        compared += 1
    return compared


def same(a, b) -> bool:
    """Two states equal: the same nesting, keys and values, tensors equal element for element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def lifecycle_audit(engine, log, fed: list[str], trained_stage: Stage) -> dict:
    """What must hold after the lives of a lifecycle scenario: nothing lost or trained twice,
    every version's stage the end of a valid path of recorded transitions (no transition twice),
    nothing on probation, the quarantine exactly the samples of the rejected versions, every
    rejected lineage restored once, and only versions not rejected announced."""
    with engine.connect() as conn:
        versions = conn.execute(
            select(*PolicyVersion.__table__.columns).order_by(PolicyVersion.version)
        ).all()
        steps = dict(conn.execute(select(LearnerStep.version, LearnerStep.metrics)).all())
        events = conn.execute(
            select(
                VersionStatusEvent.version, VersionStatusEvent.from_status, VersionStatusEvent.to_status
            ).order_by(VersionStatusEvent.id)
        ).all()
        quarantined = dict(conn.execute(select(QuarantinedSample.sample_id, QuarantinedSample.version)).all())
        waiting = conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one()
        counter = conn.execute(
            select(LearnerCounter.value).where(LearnerCounter.name == "quarantined")
        ).scalar_one_or_none()
    top = versions[-1].version
    assert [v.version for v in versions] == list(range(top + 1)) and waiting == 0
    # Nothing lost or trained twice: each fed sample in exactly one step.
    trained = Counter(i for m in steps.values() for i in m["sample_ids"])
    assert set(trained) == set(fed) and set(trained.values()) == {1}
    # Each version's transitions: one path from nothing, each move allowed, none recorded twice,
    # ending at its stage.
    assert len(set(events)) == len(events)
    for v in versions:
        path = [(f, t) for ver, f, t in events if ver == v.version]
        assert path and path[0][0] is None
        for (_, before), (after_from, after_to) in zip(path, path[1:], strict=False):
            assert after_from == before and Stage(after_to) in ALLOWED[Stage(before)]
        assert path[-1][1] == v.lifecycle
    # Nothing on probation, and every trained version ended as the scenario decides it.
    rows = {v.version: v for v in versions}
    assert {rows[v].lifecycle for v in steps} == {trained_stage.value}
    assert all(v.lifecycle in (Stage.PROMOTED, Stage.REJECTED) for v in versions)
    # The quarantine: exactly the samples of the rejected versions, each with its version, counted.
    rejected = [v.version for v in versions if v.lifecycle == Stage.REJECTED]
    assert quarantined == {i: v for v in rejected for i in steps[v]["sample_ids"]}
    assert (counter or 0) == len(quarantined)
    # A restore (rollback_to) after each lineage the guard rejected, never two; the gate's
    # rejections restore nothing (the learner goes back to the parent in memory).
    restores = [v for v in versions if (v.metrics or {}).get("rollback_to") is not None]
    assert all(
        r.lifecycle == Stage.PROMOTED and r.parent_version == r.metrics["rollback_to"] for r in restores
    )
    # A trained version's parent is the newest version not rejected before it.
    for v in steps:
        assert rows[v].parent_version == max(u for u in range(v) if rows[u].lifecycle != Stage.REJECTED)
    # Announced and published: every version (version 0 excepted) but those the gate rejected,
    # which never are (the guard rejects versions that served on probation).
    announced = {json.loads(e.value)["version"] for e in read_topic(log, TOPIC_POLICY)}
    by_gate = {ver for ver, f, t in events if (f, t) == (Stage.CANDIDATE, Stage.REJECTED)}
    shown = {v.version for v in versions[1:]} - by_gate
    assert announced == shown and all(rows[v].status == "published" for v in shown)
    assert all(rows[v].status == "committed" for v in by_gate)
    return {
        "versions": top,
        "samples": len(fed),
        "rejected_by_gate": len(by_gate),
        "rejected": len(rejected),
        "restores": len(restores),
        "quarantined": len(quarantined),
    }


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(LIFECYCLE_SCENARIOS))
def test_kill_at_the_lifecycle_points_sqlite(tmp_path, scenario):
    figures = run_lifecycle_harness(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", scenario)
    points = LIFECYCLE_SCENARIOS[scenario]["points"]
    assert figures["kills"] == {p: 2 for p in points}
    n_steps = figures["samples"] // BATCH  # 4 samples a life, BATCH 2: 2 steps a killed life
    if scenario == "gate_rejects":
        # Every step rejected by the gate: versions 1..n, no restore, all its samples quarantined.
        assert (figures["versions"], figures["rejected"], figures["restores"]) == (n_steps, n_steps, 0)
        assert figures["rejected_by_gate"] == n_steps and figures["quarantined"] == figures["samples"]
    elif scenario == "guard_rejects":
        # Each step's version rejected by the guard (after serving on probation) and followed by
        # one restore of the promoted version's weights (version 0's, republished).
        assert figures["rejected_by_gate"] == 0
        assert (figures["versions"], figures["rejected"], figures["restores"]) == (
            2 * n_steps,
            n_steps,
            n_steps,
        )
        assert figures["quarantined"] == figures["samples"]
        assert figures["restores_kept"] >= 1
    else:
        assert (figures["versions"], figures["rejected"], figures["quarantined"]) == (n_steps, 0, 0)
    print(figures)


@pytest.mark.slow
def test_kill_at_the_guards_rejection_postgres(tmp_path, pg_url):
    figures = run_lifecycle_harness(tmp_path, pg_url, "guard_rejects")
    assert figures["restores"] == figures["rejected"] == figures["samples"] // BATCH
