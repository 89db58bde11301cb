"""What the learner's tests share: a tiny random Llama saved as policy version 0, hand-made
trajectory and feedback records fed into the log (no vLLM), a learner loaded in this process on
them, and the reads that check what it committed.

Used by the kill -9 harness (tests/system/test_learner_faults.py), the restart and rollback tests
(tests/unit/learner/test_learner_restart.py, tests/unit/learner/guard/test_learner_rollback.py) and the lifecycle, dead-letter,
identity-cap, MIS and LoRA tests of the learner.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import load_file
from sqlalchemy import select

from core.db import LearnerStep, PolicyVersion, migrate
from core.lifecycle_store import set_step_metric
from core.policy_store import WEIGHTS_FILE
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, utcnow
from learner.config import LearnerConfig
from learner.process import Learner
from testing.guard import add_rated
from testing.models import byte_tokenizer, tiny_base, tiny_llama

VOCAB = 512
BATCH = 2


def tiny_model_dir(path: Path) -> Path:
    """A random 2-layer Llama saved as float32 safetensors (policy version 0)."""
    tiny_llama(VOCAB).save_pretrained(path, safe_serialization=True)
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


GATE_VOCAB = 258
"""The byte tokenizer's vocabulary (``testing.models.byte_tokenizer``): the gate needs a tokenizer."""


def gate_model_dir(path: Path) -> Path:
    """The gate's tiny Llama (``testing.models.tiny_base``, vocabulary 258) with its byte tokenizer, saved as a
    model folder the learner and its gate load."""
    tiny_base().save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path


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


def wait_for(condition, timeout_s: float = 120.0) -> bool:
    """Poll ``condition`` until true (True) or ``timeout_s`` passes (False); a guard, not a timing."""
    stop = threading.Event()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        stop.wait(0.05)
    return False


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


def lifecycles(learner: Learner) -> dict[int, str]:
    """Each version's lifecycle stage, as ``learner``'s database holds it."""
    with learner.db.connect() as conn:
        return dict(conn.execute(select(PolicyVersion.version, PolicyVersion.lifecycle)).all())


def rate(
    learner: Learner, version: int, rewards: list[float], at, first: int = 0, arm: str | None = None
) -> None:
    """Record rated single-turn answers dispatched by ``version`` at ``at`` (what the server's
    trajectory index and feedback claims hold), routed to the canary ``arm``, 1 ms apart."""
    with learner.db.begin() as conn:
        for i, r in enumerate(rewards, start=first):
            add_rated(conn, f"r{version}-{arm}-{i}", version, r, at + timedelta(milliseconds=i), arm=arm)


def set_kl_ref(learner: Learner, version: int, kl: float) -> None:
    """Write ``kl`` as the ``kl_ref`` metric of the step that trained ``version`` (the KL
    anchor's figure, which the drift veto reads: the tiny test learner runs without the anchor)."""
    with learner.db.begin() as conn:
        assert set_step_metric(conn, version, "kl_ref", kl) == 1
