"""Value pretraining (SAO §2.3; docs/design.md §5.2): ``pretrain_critic`` on batches, and
``saoserve pretrain-critic`` on the logged rollouts.

Cold start is the paper's main critic bottleneck: before RL, fit V on rollouts that already
have rewards. Here those are the trajectories in the log joined with their feedback (user or
judge). The fitted critic is saved as ``<policy dir>/critic_pretrained.pt``; a learner that
starts without a checkpoint loads it (``learner.algo.sao.SAOLearner.warm_start``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.logbus import LogTransport
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord
from core.sealing import Shredded, SubjectKeys, is_sealed
from learner.algo.gae import token_gae
from learner.algo.metrics import masked_mse
from learner.data.samples import NotLearnable, Sample, collate, single_turn_sample
from learner.models.optim import make_adamw, optimizer_step

if TYPE_CHECKING:
    from learner.algo.critic import ValueModel
    from learner.data.batch import Batch

PRETRAINED_CRITIC = "critic_pretrained.pt"
"""The pretrained critic's file name in the policy directory."""


def pretrain_critic(
    critic: ValueModel,
    batches: Sequence[Batch],
    epochs: int = 1,
    lr: float = 5e-6,
    gamma: float = 1.0,
    grad_clip: float = 1.0,
    autocast_bf16: bool = False,
    weight_decay: float = 0.0,
) -> list[float]:
    """Fit ``V`` to the Monte-Carlo return (λ = 1) on every action token with masked MSE, one
    AdamW step per batch (β1 0.9), ``epochs`` passes over ``batches`` in order (SAO §2.3
    "扩大 value pretraining"). Only ``critic.trainable_parameters()`` move (``trainable="mlp"``
    keeps attention frozen, as in RL).

    Args:
        critic: the value model (its parameters should be float32 master weights).
        batches: rollouts with rewards; only input_ids, attention_mask, action_mask, rewards are read.
        epochs: passes over ``batches`` (>= 1).
        lr: AdamW learning rate.
        gamma: discount per action token for the return.
        grad_clip: max global gradient L2 norm.
        autocast_bf16: forward/backward under bf16 autocast.
        weight_decay: AdamW weight decay.

    Returns:
        The value loss (float, before each step) of every optimizer step, in order.

    Raises:
        ValueError: epochs < 1 or an invalid batch (``Batch.validate``).
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    device = next(critic.parameters()).device
    params = critic.trainable_parameters()
    opt = make_adamw(params, lr, weight_decay)
    losses = []
    for _ in range(epochs):
        for raw in batches:
            batch = raw.to(device)
            batch.validate()
            mask = batch.action_mask.bool()
            rewards = batch.token_rewards()
            _, returns = token_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                v = critic(batch.input_ids, batch.attention_mask)
            loss = masked_mse(v, returns, mask)
            optimizer_step(opt, loss, params, grad_clip)
            losses.append(loss.item())
    return losses


def read_all(log: LogTransport, topic: str) -> list[bytes]:
    """Every record value of ``topic``, partition by partition, in offset order."""
    out: list[bytes] = []
    for p in log.partitions(topic):
        offset = 0
        while batch := log.read(topic, p, offset, 500, 0.2):
            out.extend(e.value for e in batch)
            offset = batch[-1].offset + 1
    return out


def logged_samples(
    log: LogTransport,
    forgotten: frozenset[str] = frozenset(),
    keys: SubjectKeys | None = None,
    opted_out: frozenset[str] = frozenset(),
) -> list[Sample]:
    """Single-turn trajectories of the log joined with their first feedback (first wins).

    ``forgotten``: trajectory ids ``saoserve admin forget`` tombstoned (a Kafka log still holds
    their records), never read; trajectories that opted out of training are skipped as
    NotLearnable. ``keys``: the data keys sealed records are opened with (``core.sealing``);
    a record whose key a forget destroyed is skipped. The answers of the identities in
    ``opted_out`` (the keys whose training is off now, ``core.keys.opted_out_keys``: an opt-out
    reaches the answers logged before it) are left out too.
    """
    rewards: dict[str, float] = {}
    for raw in read_all(log, TOPIC_FEEDBACK):
        fb = FeedbackRecord.model_validate_json(raw)
        if fb.trajectory_id is not None and fb.trajectory_id not in forgotten:
            rewards.setdefault(fb.trajectory_id, fb.reward)
    samples: dict[str, Sample] = {}
    for raw in read_all(log, TOPIC_TRAJECTORIES):
        if keys is not None and is_sealed(raw):
            try:
                raw = keys.open(raw)
            except Shredded:
                continue
        rec = TrajectoryRecord.model_validate_json(raw)
        if rec.identity is not None and rec.identity in opted_out:
            continue
        if rec.id in rewards and rec.id not in samples and rec.episode_id is None:
            try:
                samples[rec.id] = single_turn_sample(rec, rewards[rec.id])
            except NotLearnable:
                continue
    return list(samples.values())


def opted_out_keys_now(keys_database_url: str) -> frozenset[str]:
    """The identities of the keys whose training is off now (``core.keys.opted_out_keys``), read
    from the database of the API keys at ``keys_database_url``."""
    from core.db import make_engine
    from core.keys import opted_out_keys

    engine = make_engine(keys_database_url)
    try:
        with engine.connect() as conn:
            return opted_out_keys(conn)
    finally:
        engine.dispose()


def pretrain_from_log(
    log: LogTransport,
    model_dir: Path,
    out_dir: Path,
    epochs: int = 2,
    batch_size: int = 8,
    lr: float = 5e-5,
    trainable: str = "mlp",
    forgotten: frozenset[str] = frozenset(),
    keys: SubjectKeys | None = None,
    opted_out: frozenset[str] = frozenset(),
) -> tuple[Path, list[float]]:
    """Fit a fresh critic (from the policy at ``model_dir``) on the logged samples
    (:func:`logged_samples`, without ``forgotten`` nor the identities ``opted_out``, sealed
    records opened with ``keys``).

    Returns (saved path, loss per optimizer step). Raises ValueError if the log holds no
    trajectory with feedback.
    """
    from learner.algo.critic import ValueModel

    samples = logged_samples(log, forgotten, keys, opted_out)
    if not samples:
        raise ValueError("the log holds no trajectory with feedback to pretrain on")
    critic = ValueModel.from_pretrained(model_dir, trainable=trainable)
    batches = [collate(samples[i : i + batch_size], 0) for i in range(0, len(samples), batch_size)]
    losses = pretrain_critic(critic, batches, epochs=epochs, lr=lr)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PRETRAINED_CRITIC
    torch.save(critic.state_dict(), path)
    return path, losses
