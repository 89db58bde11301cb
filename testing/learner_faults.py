"""The fork server of the learner's kill -9 harness (tests/system/test_learner_faults.py): a
process that has imported the learner forks one learner life per job (``fork_server``), each
armed at one fault point (``learner.faults``) and run until the log is joined (``caught_up``) and,
with the guard acting, nothing is left on probation (``settled``); ``Lives`` drives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from sqlalchemy import func, select

from core.db import (
    ConsumerOffset,
    LearnerSample,
    LogRecord,
    PolicyVersion,
    make_engine,
)
from core.lifecycle import Stage
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES
from learner.config import LearnerConfig
from learner.process import Learner
from testing import ROOT
from testing.learner import BATCH


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

    import learner.algo.critic  # noqa: F401
    import learner.algo.sao  # noqa: F401
    import learner.algo.spo  # noqa: F401

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
            [sys.executable, "-c", "from testing.learner_faults import fork_server; fork_server()"],
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


def settled(engine) -> bool:
    """Nothing on probation: no version is a candidate or a canary."""
    with engine.connect() as conn:
        return not conn.execute(
            select(func.count())
            .select_from(PolicyVersion)
            .where(PolicyVersion.lifecycle.in_((Stage.CANDIDATE.value, Stage.CANARY.value)))
        ).scalar_one()
