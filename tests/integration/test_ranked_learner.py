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
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import func, select

from core.db import LearnerSample, LearnerStep, PolicyVersion, make_engine, migrate
from core.logbus import open_log
from learner.config import LearnerConfig
from learner.distributed import CHECKPOINT_DIR, CHECKPOINT_POINTER, META_FILE
from tests.conftest import ROOT
from tests.learner_harness import BATCH, feed, tiny_model_dir

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

    def life(self, ranks: int, max_steps: int, fault: str = "", fault_rank: str = "", **config) -> int:
        """One learner life of ``ranks`` ranks, until ``max_steps`` steps (counted from the
        checkpoint's); its exit status."""
        cfg = LearnerConfig(
            batch_size=BATCH, checkpoint_every=2, poll_s=0.02, device="cpu", max_steps=max_steps, **config
        )
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
        done = subprocess.run(
            [*command, str(self.launcher), str(path)], cwd=ROOT, env=env, timeout=240, capture_output=True
        )
        if done.returncode != 0 and not fault:
            print(done.stdout.decode()[-3000:], done.stderr.decode()[-6000:])
        return done.returncode

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


def test_a_rank_killed_mid_step_commits_nothing_and_a_restart_trains_each_feedback_once(tmp_path):
    home = Home(tmp_path)
    fed = feed(home.log, 3 * BATCH, 0)
    # Rank 1 dies (os._exit(137), as SIGKILL) after its share of the first step, before it
    # reports: torchrun stops rank 0, which was waiting for it; nothing of the step is committed.
    rc = home.life(2, max_steps=3, fault="during_step:1", fault_rank="1", algorithm={"name": "spo"})
    assert rc != 0
    assert home.versions() == [(0, "published")] and home.steps() == []
    assert home.waiting() == 3 * BATCH
    assert not (home.policies / "v000001").exists()
    # The restart trains the three batches, each sample once.
    assert home.life(2, max_steps=3, algorithm={"name": "spo"}) == 0
    assert [v for v, _ in home.versions()] == [0, 1, 2, 3]
    trained = Counter(i for _, m in home.steps() for i in m["sample_ids"])
    assert set(trained) == set(fed) and set(trained.values()) == {1} and home.waiting() == 0
    # And rank 0 killed in the middle of a step (its update applied, nothing written).
    fed += feed(home.log, BATCH, len(fed))
    assert home.life(2, max_steps=4, fault="during_step:1", fault_rank="0", algorithm={"name": "spo"}) != 0
    assert [v for v, _ in home.versions()] == [0, 1, 2, 3]
    assert home.life(2, max_steps=4, algorithm={"name": "spo"}) == 0
    trained = Counter(i for _, m in home.steps() for i in m["sample_ids"])
    assert set(trained) == set(fed) and set(trained.values()) == {1}
