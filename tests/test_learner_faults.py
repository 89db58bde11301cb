"""The learner under faults (issue 13, docs/design.md §8): kill -9 at each named point, failed commits,
pause, rollback; every run audited from the database.

The harness runs the learner against a tiny random Llama (2 layers, hidden 32) saved by the test,
the database and the SQL-table log, fed with hand-made trajectory and feedback records (no
vLLM). Each learner life is a child forked from a fork server that has imported torch,
transformers and the learner but touched no database and run no torch op: a fresh process in
all but the import time, which would otherwise dominate each life. The child arms one fault
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
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import func, select

from core.control import PAUSED, ROLLBACK_TO, get_flag, set_flag
from core.db import (
    ConsumerOffset,
    DeadLetter,
    LearnerCounter,
    LearnerSample,
    LearnerStep,
    LogRecord,
    PendingJoin,
    PolicyVersion,
    QuarantinedSample,
    VersionStatusEvent,
    make_engine,
    migrate,
)
from core.lifecycle import ALLOWED, Stage
from core.logbus import open_log
from core.policy_store import CHECKPOINT_FILE, WEIGHTS_FILE, Layout, layout
from core.records import (
    TOPIC_FEEDBACK,
    TOPIC_POLICY,
    TOPIC_TRAJECTORIES,
    FeedbackRecord,
    TrajectoryRecord,
    utcnow,
)
from learner.faults import CYCLE_POINTS, EXIT_CODE, POINTS, parse
from learner.process import Learner, LearnerConfig, storable
from tests.conftest import ROOT
from tests.logutil import read_topic
from tests.ratings import add_rated

VOCAB = 512
BATCH = 2
# Fed once per life: a feedback record the joiner cannot parse, set aside as a dead letter.
MALFORMED = b'{"schema": "saoserve.feedback/1", "reward": 2}'


def tiny_model_dir(path: Path) -> Path:
    """A random 2-layer Llama saved as float32 safetensors (policy version 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def feed(log, n: int, start: int, duplicate_feedback: bool = False, vocab: int = VOCAB) -> list[str]:
    """Append ``n`` trajectories (ids ``t<start>``…) and a feedback for each; returns the ids.

    Rollout logprobs are −log(vocab) (≈ −6.24 for 512), near what the random model gives, so DIS
    keeps most tokens and the steps move the weights.
    """
    ids = []
    g = torch.Generator().manual_seed(start)
    for i in range(start, start + n):
        tid = f"t{i:05d}"
        prompt_id = f"p{i % 7}"
        response = torch.randint(0, vocab, (4,), generator=g).tolist()
        rec = TrajectoryRecord(
            id=tid,
            prompt_id=prompt_id,
            created_at=utcnow(),
            model="tiny",
            prompt_token_ids=torch.randint(0, vocab, (5,), generator=g).tolist(),
            response_token_ids=response,
            rollout_logprobs=[-math.log(vocab)] * len(response),
            token_versions=[(0, len(response))],
            dispatch_version=0,
            sampling={"temperature": 1.0, "max_tokens": 8},
            finish_reason="stop",
        )
        log.append(TOPIC_TRAJECTORIES, prompt_id, rec.to_json())
        fb = FeedbackRecord(trajectory_id=tid, prompt_id=prompt_id, reward=float(i % 2), received_at=utcnow())
        log.append(TOPIC_FEEDBACK, prompt_id, fb.to_json())
        if duplicate_feedback:
            again = FeedbackRecord(trajectory_id=tid, prompt_id=prompt_id, reward=0.5, received_at=utcnow())
            log.append(TOPIC_FEEDBACK, prompt_id, again.to_json())
        ids.append(tid)
    return ids


def caught_up(engine) -> bool:
    """Every log record joined, no sample waiting, the newest version not rejected published
    (a rejected version is never announced)."""
    with engine.connect() as conn:
        ends = dict(
            conn.execute(select(LogRecord.topic, func.max(LogRecord.offset)).group_by(LogRecord.topic)).all()
        )
        offsets = dict(
            conn.execute(
                select(ConsumerOffset.topic, ConsumerOffset.next_offset).where(
                    ConsumerOffset.consumer == "learner"
                )
            ).all()
        )
        waiting = conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one()
        status = conn.execute(
            select(PolicyVersion.status)
            .where(PolicyVersion.lifecycle != Stage.REJECTED.value)
            .order_by(PolicyVersion.version.desc())
            .limit(1)
        ).scalar()
    joined = all(offsets.get(t, 0) > ends[t] for t in (TOPIC_TRAJECTORIES, TOPIC_FEEDBACK) if t in ends)
    return joined and waiting == 0 and status == "published"


# ------------------------------------------------------------------------------ fork server
def _child(job: dict) -> None:
    from core.settings import Settings
    from learner import faults

    faults.arm(job["fault"])
    settings = Settings(
        home=Path(job["home"]),
        database_url=job["db"],
        model_dir=Path(job["model_dir"]),
        policy_dir=Path(job["policy_dir"]),
    )
    config = LearnerConfig(
        batch_size=BATCH,
        algorithm={"name": job["estimator"]},
        checkpoint_every=2,
        poll_s=0.02,
        keep_versions=3,
        **({"guard": job["guard"]} if job.get("guard") else {}),
        **({"policy": job["policy"]} if job.get("policy") else {}),
    )
    learner = Learner(settings, config)
    stop = threading.Event()

    def watch() -> None:
        engine = make_engine(job["db"])
        while not stop.wait(0.05):
            # With the guard acting: also until nothing is left on probation (it decides each).
            if (
                learner.algorithm is not None
                and caught_up(engine)
                and (not job.get("guard") or settled(engine))
            ):
                stop.set()

    threading.Thread(target=watch, daemon=True).start()
    learner.run(stop)


def fork_server() -> None:
    """Import the learner's dependencies once, then fork one child per job line on stdin.

    Each child's exit status is written back as one JSON line ``{"rc": status}``. A job with
    ``kill_after_s`` is also sent SIGKILL after that many seconds if it still runs (status −9).
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    import learner.critic  # noqa: F401
    import learner.sao  # noqa: F401
    import learner.spo  # noqa: F401

    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(job)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stderr.flush()
            os._exit(code)
        timer = None
        if job.get("kill_after_s") is not None:
            timer = threading.Timer(job["kill_after_s"], os.kill, (pid, signal.SIGKILL))
            timer.start()
        _, status = os.waitpid(pid, 0)
        if timer is not None:
            timer.cancel()
            timer.join()
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


class Lives:
    """Drives the fork server: ``run(fault)`` starts one learner life and returns its status."""

    def __init__(self, job: dict):
        self.job = job
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.test_learner_faults import fork_server; fork_server()"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"SAOSERVE_FAULT_POINT": ""},
        )

    def run(self, fault: str | None, kill_after_s: float | None = None) -> int:
        self.proc.stdin.write(json.dumps(self.job | {"fault": fault, "kill_after_s": kill_after_s}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["rc"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------------------------ audit
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


# ------------------------------------------------------------------------ the lifecycle's points
GATE_VOCAB = 258
"""The byte tokenizer's vocabulary (tests/test_gate.py): the gate needs a tokenizer."""


def gate_model_dir(path: Path) -> Path:
    """tests/test_gate.py's tiny Llama (vocabulary 258) with its byte tokenizer, saved as a
    model folder the learner and its gate load."""
    from tests.test_gate import byte_tokenizer, tiny_base

    tiny_base().save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path


def settled(engine) -> bool:
    """Nothing on probation: no version is a candidate or a canary."""
    with engine.connect() as conn:
        return not conn.execute(
            select(func.count())
            .select_from(PolicyVersion)
            .where(PolicyVersion.lifecycle.in_((Stage.CANDIDATE.value, Stage.CANARY.value)))
        ).scalar_one()


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
    # is rejected and version 0's weights published again (tests/test_lifecycle_learner.py).
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
    engine.dispose()
    log.close()
    return figures | {"kills": dict(kills)}


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
    else:
        assert (figures["versions"], figures["rejected"], figures["quarantined"]) == (n_steps, 0, 0)
    print(figures)


@pytest.mark.slow
def test_kill_at_the_guards_rejection_postgres(tmp_path, pg_url):
    figures = run_lifecycle_harness(tmp_path, pg_url, "guard_rejects")
    assert figures["restores"] == figures["rejected"] == figures["samples"] // BATCH


# ------------------------------------------------------------------------- in-process tests
def in_process(tmp_path: Path, db_url: str, model_dir: Path | None = None, **config) -> Learner:
    """A loaded learner on ``model_dir`` (default: ``tiny_model_dir``) and ``db_url``."""
    from core.settings import Settings

    migrate(db_url)
    settings = Settings(
        home=tmp_path,
        database_url=db_url,
        model_dir=model_dir or tiny_model_dir(tmp_path / "model"),
        policy_dir=tmp_path / "policies",
    )
    learner = Learner(settings, LearnerConfig(batch_size=BATCH, poll_s=0.01, **config))
    learner.load()
    return learner


def committed_weights(learner: Learner, version: int) -> dict[str, torch.Tensor]:
    with learner.db.connect() as conn:
        path = conn.execute(select(PolicyVersion.path).where(PolicyVersion.version == version)).scalar_one()
    return load_file(Path(path) / WEIGHTS_FILE)


def assert_policy_is(learner: Learner, weights: dict[str, torch.Tensor]) -> None:
    state = learner.algorithm.policy.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())


def trained_ids(learner: Learner) -> Counter:
    with learner.db.connect() as conn:
        return Counter(
            i for m in conn.execute(select(LearnerStep.metrics)).scalars() for i in m["sample_ids"]
        )


def test_fault_point_spec_is_checked():
    assert parse("after_commit:3") == ("after_commit", 3) and parse("during_step") == ("during_step", 1)
    assert parse("") is None and parse(None) is None
    assert [parse(p) for p in POINTS] == [(p, 1) for p in POINTS] and len(set(POINTS)) == 12
    for bad in ("after_lunch:1", "after_commit:0", "after_commit:x"):
        with pytest.raises(ValueError):
            parse(bad)


def test_storable_replaces_non_finite_numbers_with_null():
    metrics = {
        "a": math.nan,
        "b": math.inf,
        "c": -math.inf,
        "d": 1.5,
        "e": 3,
        "h": {"0": math.nan},
        "l": [1.0, math.inf],
    }
    assert storable(metrics) == {
        "a": None,
        "b": None,
        "c": None,
        "d": 1.5,
        "e": 3,
        "h": {"0": None},
        "l": [1.0, None],
    }


def test_failed_commit_reloads_the_committed_state(tmp_path, monkeypatch):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=1)
    log = open_log(learner.settings.resolved_database_url)
    fed = feed(log, 4, 0)
    learner.poll_once()
    assert learner.train_step() is not None and learner.version == 1
    real = learner._commit_version

    def refuse(*args, **kwargs):
        monkeypatch.setattr(learner, "_commit_version", real)
        raise RuntimeError("the database refused the commit")

    monkeypatch.setattr(learner, "_commit_version", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        learner.train_step()
    # The step was applied in memory and v000002 written, but nothing committed: the models are
    # dropped, the samples still wait.
    assert learner.algorithm is None and learner.waiting_samples() == 2
    assert (tmp_path / "policies" / "v000002").is_dir()
    learner.load()
    assert learner.version == 1 and not (tmp_path / "policies" / "v000002").exists()
    assert_policy_is(learner, committed_weights(learner, 1))
    assert learner.train_step() is not None and learner.version == 2
    assert trained_ids(learner) == Counter(fed)


def test_checkpoint_and_directory_ahead_of_the_database_are_ignored(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=1)
    feed(open_log(learner.settings.resolved_database_url), 2, 0)
    learner.poll_once()
    learner.train_step()
    # What the old order left after a kill before the commit: checkpoint and directory of v2.
    ahead = {"version": 2, "learner": learner.algorithm.state_dict() | {"step": 99}, "config": {}}
    torch.save(ahead, tmp_path / "policies" / CHECKPOINT_FILE)
    (tmp_path / "policies" / "v000002").mkdir()
    restarted = Learner(learner.settings, learner.config)
    restarted.load()
    assert restarted.version == 1 and restarted.algorithm.steps == 0
    assert not (tmp_path / "policies" / "v000002").exists()
    assert_policy_is(restarted, committed_weights(restarted, 1))


def test_pause_joins_without_training_and_resume_trains(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    set_flag(learner.db, PAUSED, "1")
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    stop = threading.Event()
    thread = threading.Thread(target=learner.run, args=(stop,))
    thread.start()
    try:
        assert wait_for(lambda: learner.waiting_samples() == 4)
        assert learner._latest_version().version == 0
        set_flag(learner.db, PAUSED, None)
        assert wait_for(lambda: learner._latest_version().version == 2)
    finally:
        stop.set()
        thread.join(60)
    assert learner.waiting_samples() == 0


def wait_for(condition, timeout_s: float = 120.0) -> bool:
    """Poll ``condition`` until true (True) or ``timeout_s`` passes (False); a guard, not a timing."""
    stop = threading.Event()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        stop.wait(0.05)
    return False


def test_rollback_publishes_the_old_weights_as_a_new_version(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    learner.poll_once()
    learner.train_step()
    learner.train_step()
    set_flag(learner.db, ROLLBACK_TO, "1")
    assert learner.rollback(1) == 3
    with learner.db.connect() as conn:
        row = conn.execute(select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == 3)).one()
    assert row.parent_version == 1 and row.metrics == {"rollback_to": 1} and row.status == "published"
    assert get_flag(learner.db, ROLLBACK_TO) is None and learner.algorithm.policy_opt.state == {}
    v1 = committed_weights(learner, 1)
    assert all(torch.equal(committed_weights(learner, 3)[k], v) for k, v in v1.items())
    assert_policy_is(learner, v1)


def test_rollback_to_an_unknown_version_is_refused_and_cleared(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    set_flag(learner.db, ROLLBACK_TO, "7")
    assert learner.rollback(7) is None
    assert get_flag(learner.db, ROLLBACK_TO) is None and learner.version == 0
    with learner.db.connect() as conn:
        refused = conn.execute(
            select(LearnerCounter.value).where(LearnerCounter.name == "rollback_refused")
        ).scalar()
    assert refused == 1


def test_a_rollback_request_that_is_no_version_number_is_refused_and_cleared(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    set_flag(learner.db, ROLLBACK_TO, "v1")
    assert learner._requested_rollback() is True
    assert get_flag(learner.db, ROLLBACK_TO) is None and learner.version == 0
    with learner.db.connect() as conn:
        refused = conn.execute(
            select(LearnerCounter.value).where(LearnerCounter.name == "rollback_refused")
        ).scalar()
    assert refused == 1 and learner._requested_rollback() is False


def test_non_finite_metrics_are_stored_as_null_on_postgres(tmp_path, pg_url, monkeypatch):
    learner = in_process(tmp_path, pg_url)
    feed(open_log(pg_url), 2, 0)
    learner.poll_once()
    step = learner.algorithm.step

    def poisoned(*args):
        return step(*args) | {"approx_kl": math.nan, "tokens_per_s": math.inf, "by": {"1": -math.inf}}

    monkeypatch.setattr(learner.algorithm, "step", poisoned)
    assert learner.train_step() is not None
    with learner.db.connect() as conn:
        version = conn.execute(select(PolicyVersion.metrics).where(PolicyVersion.version == 1)).scalar_one()
        metrics = conn.execute(select(LearnerStep.metrics)).scalar_one()
    assert version["approx_kl"] is None and version["tokens_per_s"] is None
    assert metrics["approx_kl"] is None and metrics["by"] == {"1": None}
    assert metrics["sample_ids"] == ["t00000", "t00001"]


# ------------------------------------------------------------------- issue 23 (findings 2, 11)
def run_until(learner: Learner, condition, timeout_s: float = 60.0) -> bool:
    """Run the learner's loop in a thread until ``condition()``, then stop it cleanly."""
    stop = threading.Event()
    thread = threading.Thread(target=learner.run, args=(stop,))
    thread.start()
    try:
        return wait_for(condition, timeout_s)
    finally:
        stop.set()
        thread.join(60)


def versions(learner: Learner) -> list[tuple]:
    with learner.db.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                select(PolicyVersion.version, PolicyVersion.parent_version, PolicyVersion.metrics).order_by(
                    PolicyVersion.version
                )
            )
        ]


def test_a_rollback_requested_while_another_runs_is_carried_out(tmp_path, monkeypatch):
    """Finding 2: rollback to 1, then to 0 while the first is being carried out; the first's
    commit cleared the flag, so the second never happened."""
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    learner.poll_once()
    learner.train_step()
    learner.train_step()
    set_flag(learner.db, ROLLBACK_TO, "1")
    real = learner._write_version
    written = []

    def second_request_meanwhile(version: int):
        if not written:  # POST /admin/rollback {"version": 0} while version 3 is being written
            set_flag(learner.db, ROLLBACK_TO, "0")
        written.append(version)
        return real(version)

    monkeypatch.setattr(learner, "_write_version", second_request_meanwhile)
    assert run_until(learner, lambda: learner._latest_version().version == 4, 30)
    assert written == [3, 4]
    assert versions(learner)[3:] == [(3, 1, {"rollback_to": 1}), (4, 0, {"rollback_to": 0})]
    assert get_flag(learner.db, ROLLBACK_TO) is None


def test_a_rollback_is_logged_and_prunes_the_version_folders(tmp_path, caplog):
    """Finding 11: rollbacks were not logged and did not prune (more folders than keep_versions)."""
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", keep_versions=4)
    feed(open_log(learner.settings.resolved_database_url), 8, 0)
    learner.poll_once()
    for _ in range(4):
        learner.train_step()
    caplog.set_level("INFO", logger="learner.process")
    # Versions 5, 6, 7 republish 3, 4, 3; after each, only the newest 4 folders stay.
    assert [learner.rollback(v) for v in (3, 4, 3)] == [5, 6, 7]
    assert sorted(d.name for d in (tmp_path / "policies").glob("v[0-9]*")) == [
        "v000004",
        "v000005",
        "v000006",
        "v000007",
    ]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("rolled back")] == [
        "rolled back to version 3: its weights are published as version 5",
        "rolled back to version 4: its weights are published as version 6",
        "rolled back to version 3: its weights are published as version 7",
    ]


def restarted(learner: Learner) -> Learner:
    again = Learner(learner.settings, learner.config)
    again.load()
    return again


def test_a_clean_stop_writes_the_checkpoint_at_the_last_committed_version(tmp_path):
    """Finding 11: a restarted learner lost its critic, optimizer state and step count (the
    checkpoint was written every checkpoint_every steps only)."""
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=10)
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    assert run_until(learner, lambda: learner._latest_version().version == 2)
    state = torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)
    assert state["version"] == 2
    again = restarted(learner)
    assert again.version == 2 and again.algorithm.steps == 2
    # The optimizer moments came back: 2 AdamW steps recorded for every parameter.
    moments = again.algorithm.policy_opt.state
    assert moments and all(int(s["step"]) == 2 for s in moments.values())


def test_ctrl_c_writes_the_checkpoint_and_a_step_cut_short_does_not(tmp_path, monkeypatch):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=10)
    feed(open_log(learner.settings.resolved_database_url), 6, 0)
    train = learner.train_step

    def ctrl_c_at_version_2():
        if learner.version == 2:
            raise KeyboardInterrupt
        return train()

    monkeypatch.setattr(learner, "train_step", ctrl_c_at_version_2)
    with pytest.raises(KeyboardInterrupt):
        learner.run()
    assert torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)["version"] == 2
    # Ctrl-C in the middle of the third step: the update is in memory only, so nothing is
    # written (the checkpoint stays at 2, never claiming the uncommitted step).
    monkeypatch.setattr(learner, "train_step", train)
    step = learner._step

    def ctrl_c_in_the_step(batch):
        step(batch)
        raise KeyboardInterrupt

    monkeypatch.setattr(learner, "_step", ctrl_c_in_the_step)
    with pytest.raises(KeyboardInterrupt):
        learner.run()
    assert learner.algorithm is None and learner._latest_version().version == 2
    assert torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)["version"] == 2
    assert restarted(learner).algorithm.steps == 2


def test_sigterm_stops_saoserve_learn_cleanly_with_a_checkpoint(tmp_path):
    from learner.process import run_learner

    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", checkpoint_every=10)
    feed(open_log(learner.settings.resolved_database_url), 2, 0)
    engine = make_engine(learner.settings.resolved_database_url)

    def term_at_version_1() -> None:
        wait_for(lambda: versions_of(engine) == [0, 1], 60)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_at_version_1, daemon=True).start()
    before = signal.getsignal(signal.SIGTERM)
    run_learner(learner.settings, learner.config)
    assert signal.getsignal(signal.SIGTERM) is before
    assert torch.load(tmp_path / "policies" / CHECKPOINT_FILE, weights_only=False)["version"] == 1
    engine.dispose()


def versions_of(engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(select(PolicyVersion.version).order_by(PolicyVersion.version)).scalars())
