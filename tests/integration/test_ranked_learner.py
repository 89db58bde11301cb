"""The learner over 2 gloo ranks under torchrun (issue 38, ``learner.distributed``): it trains and
publishes as one learner does, a rank killed with SIGKILL mid-step commits nothing and a restart
trains every feedback exactly once, and a checkpoint written by 2 ranks resumes (on 1 rank: DCP
reshards).

Each life is ``python -m torch.distributed.run --standalone --nproc-per-node N`` on a launcher
that runs ``learner.distributed.run_ranked`` (``saoserve learn --ranks N`` without its model
preparation, which would replace the tiny random Llama of ``tests.learner_harness`` by the real
model), against a SQLite database and the SQL-table log fed with hand-made records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from sqlalchemy import func, select

from core.db import LearnerSample, LearnerStep, PolicyVersion, make_engine, migrate
from core.logbus import open_log
from learner.config import LearnerConfig
from learner.distributed import CHECKPOINT_DIR, CHECKPOINT_POINTER, META_FILE
from testing import ROOT
from testing.learner import BATCH, feed, tiny_model_dir

pytestmark = pytest.mark.slow

LAUNCHER = """
import sys
from core.settings import Settings
from learner.config import LearnerConfig
from learner.distributed import run_ranked

run_ranked(Settings(), LearnerConfig.model_validate_json(open(sys.argv[1]).read()))
"""


class Home:
    """A learner home: tiny model, SQLite database and log, and a way to run a ranked life."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.db = f"sqlite:///{tmp_path / 'db.sqlite'}"
        migrate(self.db)
        self.model = tiny_model_dir(tmp_path / "model")
        self.policies = tmp_path / "policies"
        self.launcher = tmp_path / "launch.py"
        self.launcher.write_text(LAUNCHER)
        self.log = open_log(self.db)
        self.engine = make_engine(self.db)

    def _command(self, ranks: int, max_steps: int | None, fault: str, fault_rank: str, **config):
        fields = {"batch_size": BATCH, "checkpoint_every": 2, "poll_s": 0.02, "device": "cpu"}
        cfg = LearnerConfig(**(fields | {"max_steps": max_steps} | config))
        path = self.tmp / "learner.json"
        path.write_text(cfg.to_json())
        env = os.environ | {
            "PYTHONPATH": str(ROOT),
            "SAOSERVE_HOME": str(self.tmp),
            "SAOSERVE_DATABASE_URL": self.db,
            "SAOSERVE_MODEL_DIR": str(self.model),
            "SAOSERVE_POLICY_DIR": str(self.policies),
            "SAOSERVE_FAULT_POINT": fault,
            "SAOSERVE_FAULT_RANK": fault_rank,
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        return [*command, str(self.launcher), str(path)], env

    def life(self, ranks: int, max_steps: int | None, fault: str = "", fault_rank: str = "", **config) -> int:
        """One learner life of ``ranks`` ranks, until ``max_steps`` steps (counted from the
        checkpoint's) or its fault point; its exit status."""
        command, env = self._command(ranks, max_steps, fault, fault_rank, **config)
        done = subprocess.run(command, cwd=ROOT, env=env, timeout=240, capture_output=True)
        if done.returncode != 0 and not fault:
            print(done.stdout.decode()[-3000:], done.stderr.decode()[-6000:])
        return done.returncode

    def until_trained(self, ranks: int, versions: int, **config) -> None:
        """A life without a step limit, stopped by SIGTERM (a clean stop: rank 0 writes the
        checkpoint with every rank, then tells them to stop) once ``versions`` versions are
        published. torchrun itself exits 1 when it is signalled, whatever its ranks did, so the
        caller checks the state they left."""
        command, env = self._command(ranks, None, "", "", **config)
        proc = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            rows = self.versions()
            if len(rows) == versions + 1 and {status for _, status in rows} == {"published"}:
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)

    def versions(self) -> list:
        with self.engine.connect() as conn:
            return conn.execute(select(PolicyVersion.version, PolicyVersion.status).order_by("version")).all()

    def steps(self) -> list:
        with self.engine.connect() as conn:
            return conn.execute(select(LearnerStep.version, LearnerStep.metrics).order_by("version")).all()

    def waiting(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one()


def test_two_ranks_train_and_a_two_rank_checkpoint_resumes_on_one(tmp_path):
    home = Home(tmp_path)
    fed = feed(home.log, 4 * BATCH, 0)
    # Life 1: 2 ranks, 2 steps; a checkpoint at step 2 (checkpoint_every 2) from both ranks.
    assert home.life(2, max_steps=2) == 0
    assert home.versions() == [(0, "published"), (1, "published"), (2, "published")]
    pointer = json.loads((home.policies / CHECKPOINT_POINTER).read_text())
    assert pointer == {"version": 2, "weights_version": 2, "folder": "v000002"}
    folder = home.policies / CHECKPOINT_DIR / "v000002"
    # One shard file per rank, and rank 0's small state.
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (folder / META_FILE).is_file()
    # Life 2: one rank resumes the 2-rank checkpoint (step count 2) and trains steps 3 and 4.
    assert home.life(1, max_steps=4) == 0
    steps = home.steps()
    assert [m["step"] for _, m in steps] == [1, 2, 3, 4] and [v for v, _ in steps] == [1, 2, 3, 4]
    trained = Counter(i for _, m in steps for i in m["sample_ids"])
    assert set(trained) == set(fed) and set(trained.values()) == {1} and home.waiting() == 0


# Rank 1 dies after its share of a step, before it reports; rank 0 at the points of its cycle.
# (The other points of rank 0's cycle are the single learner's: tests/system/test_learner_faults.py.)
KILLS = [("during_step", "1"), ("during_step", "0"), ("after_commit", "0")]


def test_a_rank_killed_mid_step_commits_nothing_and_a_restart_trains_each_feedback_once(tmp_path):
    home = Home(tmp_path)
    fed = feed(home.log, BATCH, 0)
    # Rank 1 killed (os._exit(137), as SIGKILL) mid-step: torchrun stops rank 0, which was waiting
    # for it; nothing of the step is committed.
    assert home.life(2, None, fault="during_step:1", fault_rank="1", algorithm={"name": "spo"}) != 0
    assert home.versions() == [(0, "published")] and home.steps() == []
    assert home.waiting() == BATCH and not (home.policies / "v000001").exists()
    # Then one life killed at each point (a new batch fed before each), every step checkpointed.
    for point, rank in KILLS[1:]:
        fed += feed(home.log, BATCH, len(fed))
        rc = home.life(2, None, f"{point}:1", rank, algorithm={"name": "spo"}, checkpoint_every=1)
        assert rc != 0, point
    # A clean life trains what is left (the version committed before the last kill announced at
    # its start); SIGTERM stops it.
    batches = len(fed) // BATCH
    home.until_trained(2, batches, algorithm={"name": "spo"}, checkpoint_every=1)
    versions = home.versions()
    assert [v for v, _ in versions] == list(range(batches + 1))
    assert {status for _, status in versions} == {"published"}
    steps = home.steps()
    assert [v for v, _ in steps] == list(range(1, batches + 1))
    trained = Counter(i for _, m in steps for i in m["sample_ids"])
    assert set(trained) == set(fed) and set(trained.values()) == {1} and home.waiting() == 0
    # Every step wrote the sharded checkpoint (checkpoint_every 1): it is at the last version.
    pointer = json.loads((home.policies / CHECKPOINT_POINTER).read_text())
    assert pointer["version"] == batches


def test_a_rollback_with_two_ranks_publishes_the_old_weights(tmp_path):
    """An operator's rollback (the ``rollback_to`` flag) on a 2-rank learner: every rank loads
    version 1's weights (broadcast from rank 0) and the new version 3 publishes them again."""
    from safetensors.torch import load_file

    from core.control import ROLLBACK_TO, set_flag
    from core.policy_store import WEIGHTS_FILE

    home = Home(tmp_path)
    feed(home.log, 2 * BATCH, 0)
    assert home.life(2, max_steps=2, algorithm={"name": "spo"}) == 0
    set_flag(home.engine, ROLLBACK_TO, "1")
    home.until_trained(2, 3, algorithm={"name": "spo"})
    assert [v for v, _ in home.versions()] == [0, 1, 2, 3]
    one = load_file(home.policies / "v000001" / WEIGHTS_FILE)
    three = load_file(home.policies / "v000003" / WEIGHTS_FILE)
    two = load_file(home.policies / "v000002" / WEIGHTS_FILE)
    assert one.keys() == three.keys() and all(torch.equal(one[k], three[k]) for k in one)
    assert any(not torch.equal(one[k], two[k]) for k in one)
