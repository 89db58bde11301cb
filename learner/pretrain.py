"""Value pretraining from logged rollouts (SAO §2.3; DESIGN §5.2): ``saoserve pretrain-critic``.

Cold start is the paper's main critic bottleneck: before RL, fit V on rollouts that already
have rewards. Here those are the trajectories in the log joined with their feedback (user or
judge). The fitted critic is saved as ``<policy dir>/critic_pretrained.pt``; a learner that
starts without a checkpoint loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.logbus import LogTransport
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord
from learner.samples import NotLearnable, Sample, collate, single_turn_sample

PRETRAINED_CRITIC = "critic_pretrained.pt"


def read_all(log: LogTransport, topic: str) -> list[bytes]:
    out: list[bytes] = []
    for p in log.partitions(topic):
        offset = 0
        while batch := log.read(topic, p, offset, 500, 0.2):
            out.extend(e.value for e in batch)
            offset = batch[-1].offset + 1
    return out


def logged_samples(log: LogTransport) -> list[Sample]:
    """Single-turn trajectories of the log joined with their first feedback (first wins)."""
    rewards: dict[str, float] = {}
    for raw in read_all(log, TOPIC_FEEDBACK):
        fb = FeedbackRecord.model_validate_json(raw)
        if fb.trajectory_id is not None:
            rewards.setdefault(fb.trajectory_id, fb.reward)
    samples: dict[str, Sample] = {}
    for raw in read_all(log, TOPIC_TRAJECTORIES):
        rec = TrajectoryRecord.model_validate_json(raw)
        if rec.id in rewards and rec.id not in samples and rec.episode_id is None:
            try:
                samples[rec.id] = single_turn_sample(rec, rewards[rec.id])
            except NotLearnable:
                continue
    return list(samples.values())


def pretrain_from_log(
    log: LogTransport,
    model_dir: Path,
    out_dir: Path,
    epochs: int = 2,
    batch_size: int = 8,
    lr: float = 5e-5,
    trainable: str = "mlp",
) -> tuple[Path, list[float]]:
    """Fit a fresh critic (from the policy at ``model_dir``) on the logged samples.

    Returns (saved path, loss per optimizer step). Raises ValueError if the log holds no
    trajectory with feedback.
    """
    from learner.critic import ValueModel
    from learner.sao import pretrain_critic

    samples = logged_samples(log)
    if not samples:
        raise ValueError("the log holds no trajectory with feedback to pretrain on")
    critic = ValueModel.from_pretrained(model_dir, trainable=trainable)
    batches = [collate(samples[i : i + batch_size], 0) for i in range(0, len(samples), batch_size)]
    losses = pretrain_critic(critic, batches, epochs=epochs, lr=lr)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PRETRAINED_CRITIC
    torch.save(critic.state_dict(), path)
    return path, losses
