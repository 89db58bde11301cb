"""The MIS corrections: the loss by hand, exact π_old from snapshots, dropping too-stale samples,
the EWMA proxy's update and reset inside the learner, several updates per batch (no engine)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from learner.algo.mis import mis_loss
from learner.algo.registry import build_algorithm
from learner.config import ConfigError, build_config
from learner.data.batch import policy_logprobs
from testing.models import make_batch, tiny_policy


def test_mis_loss_by_hand():
    # Four action tokens (μ, π_old, πθ, A):
    #   t0 (0.5, 0.5, 0.5, +1): r_d = 1, r_s = 1          → kept, weight πθ/μ · A = 1
    #   t1 (0.1, 0.3, 0.3, +1): r_d = 3 > c = 2           → masked by r_d
    #   t2 (0.4, 0.4, 0.6, +1): r_s = 1.5 > 1 + 0.28      → masked by r_s
    #   t3 (0.4, 0.4, 0.6, −1): r_s = 1.5 ≥ 1 − 0.2, A < 0 → kept, weight 1.5 · (−1) = −1.5
    # L = −(1 · log 0.5 + (−1.5) · log 0.6) / 4 = −(−0.693147 + 0.766238) / 4 = −0.018273
    mu = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.4]]))
    old = torch.log(torch.tensor([[0.5, 0.3, 0.4, 0.4]]))
    new = torch.log(torch.tensor([[0.5, 0.3, 0.6, 0.6]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    loss, stats = mis_loss(new, old, mu, adv, torch.ones(1, 4), eps_low=0.2, eps_high=0.28, c=2.0)
    assert loss.item() == pytest.approx(-(math.log(0.5) - 1.5 * math.log(0.6)) / 4, rel=1e-5)
    assert loss.item() == pytest.approx(-0.018273, abs=1e-6)
    assert (stats["action_tokens"], stats["kept"], stats["masked_by_rd"], stats["masked_by_rs"]) == (
        4,
        2,
        1,
        1,
    )
    assert stats["sum_abs_log_rd"] == pytest.approx(math.log(3.0), rel=1e-6)
    loss.backward()
    # ∂L/∂log πθ = −weight / 4 on kept tokens: (−0.25, 0, 0, +0.375).
    assert new.grad.tolist()[0] == pytest.approx([-0.25, 0.0, 0.0, 0.375], abs=1e-6)


def test_dual_clip_bounds_negative_advantage_weights():
    # One token with A = −1, r_d = 1 and r_s = πθ/π_old = 0.8/0.2 = 4: the MIS mask keeps it
    # (A < 0 only needs r_s ≥ 0.8), with weight 4 · (−1); the dual clip at 3 masks it (4 > 3).
    mu = old = torch.log(torch.tensor([[0.2]]))
    new = torch.log(torch.tensor([[0.8]]))
    adv, ones = torch.tensor([[-1.0]]), torch.ones(1, 1)
    loss, stats = mis_loss(new, old, mu, adv, ones, eps_low=0.2, eps_high=0.28, c=2.0, dual_clip=None)
    # L = −(−4 · log 0.8) / 1 = 4 · (−0.223144) = −0.892574
    assert loss.item() == pytest.approx(4 * math.log(0.8), rel=1e-5) and stats["kept"] == 1
    loss, stats = mis_loss(new, old, mu, adv, ones, eps_low=0.2, eps_high=0.28, c=2.0, dual_clip=3.0)
    assert loss.item() == 0.0 and (stats["kept"], stats["masked_by_rs"]) == (0, 1)
    # r_s = 4 < 5: kept again under a looser dual clip.
    assert mis_loss(new, old, mu, adv, ones, eps_low=0.2, eps_high=0.28, c=2.0, dual_clip=5.0)[1]["kept"] == 1
    with pytest.raises(ValueError, match="dual_clip"):
        mis_loss(new, old, mu, adv, ones, eps_low=0.2, eps_high=0.28, c=2.0, dual_clip=1.0)


def test_mis_loss_drops_a_non_finite_old_logprob():
    mu = torch.zeros(1, 3) - 0.5
    old = torch.tensor([[-0.5, math.nan, -0.5]])
    new = torch.tensor([[-0.5, -0.5, -0.5]], requires_grad=True)
    loss, stats = mis_loss(
        new, old, mu, torch.ones(1, 3), torch.ones(1, 3), eps_low=0.2, eps_high=0.28, c=2.0
    )
    assert stats["nonfinite_tokens"] == 1 and stats["action_tokens"] == 2 and stats["kept"] == 2
    assert math.isfinite(loss.item())


def _learner(correction: str, **fields):
    cfg = build_config(
        correction=correction,
        overrides={
            "optimizer": {"policy_lr": 1e-2},
            "algorithm": {"critic_lr": 1e-2, "critic_warmup_steps": 0},
            "correction": fields,
        },
    )
    torch.manual_seed(0)
    return build_algorithm(cfg, tiny_policy)


def _on_policy(learner, seed: int, staleness=None):
    batch = make_batch(learner.policy, seed=seed)
    stale = torch.zeros_like(batch.input_ids) if staleness is None else staleness
    return replace(batch, token_staleness=stale)


def _half_off(batch):
    """``batch`` whose behaviour logprobs are 1 nat lower on every second position from 3 (the
    action tokens 3, 5, 7, 9): there r_d = π_old/μ = e ≈ 2.72 > c = 2, so about half the tokens
    are masked by r_d and ρ_t < 0.9."""
    shifted = batch.rollout_logprobs.clone()
    shifted[:, 3::2] -= 1.0
    return replace(batch, rollout_logprobs=shifted * batch.action_mask)


def test_snapshot_old_logprobs_equal_a_recomputation_with_each_versions_weights():
    learner = _learner("mis_snapshot", window=2)
    weights = {}
    learner.on_version(0)
    weights[0] = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    for v in (1, 2):
        learner.step(_on_policy(learner, seed=v))
        learner.on_version(v)
        weights[v] = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    assert not torch.equal(
        weights[0]["model.layers.0.mlp.up_proj.weight"], weights[2]["model.layers.0.mlp.up_proj.weight"]
    )
    # One multi-version record per row: actions at 3..9; tokens 3-4 by version 0, 5-6 by version
    # 1, 7-9 by version 2 (the learner is at version 2, so staleness 2, 1, 0).
    batch = make_batch(learner.policy, seed=5)
    mask = batch.action_mask.bool()
    versions = torch.full_like(batch.input_ids, 2)
    versions[:, 3:5], versions[:, 5:7] = 0, 1
    old, stats = learner.policy_update.old_policy.logprobs(batch, mask, versions, learner.logprobs)
    assert stats["snapshot_switches"] == 3
    want = torch.zeros_like(old)
    for v, w in weights.items():
        model = tiny_policy()
        model.load_state_dict(w)
        sel = mask & (versions == v)
        with torch.no_grad():
            lp = policy_logprobs(model, batch.input_ids, batch.attention_mask, batch.temperatures)
        want = torch.where(sel, lp, want)
    assert torch.allclose(old, want, atol=1e-6)
    # The live policy is the newest version, untouched by the switches.
    assert all(torch.equal(learner.policy.state_dict()[k], w) for k, w in weights[2].items())


def test_rows_with_a_token_older_than_the_window_are_dropped_and_counted():
    learner = _learner("mis_snapshot", window=1)
    learner.on_version(0)
    learner.step(_on_policy(learner, seed=1))
    learner.on_version(1)
    learner.step(_on_policy(learner, seed=2))
    learner.on_version(2)
    assert learner.policy_update.old_policy.store.versions() == [1, 2]  # W + 1 = 2 snapshots
    # Rows 0 and 2 carry a token of version 0 (staleness 2 > W = 1): dropped; rows 1, 3 train.
    batch = make_batch(learner.policy, seed=3)
    stale = torch.zeros_like(batch.input_ids)
    stale[0, 4] = stale[2, 9] = 2
    stale[1, 3] = 1
    m = learner.step(replace(batch, token_staleness=stale))
    assert m["dropped_stale_samples"] == 2
    # Row 1 has 5 action tokens (3-4, 7-9), row 3 has 5 (3-7): 10 tokens trained.
    assert m["action_tokens"] == 10 and m["policy_updates"] == 1
    # Every row too stale: no update at all, the step still counted.
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    m = learner.step(replace(batch, token_staleness=torch.full_like(stale, 5)))
    assert m["dropped_stale_samples"] == 4 and m["policy_loss"] == 0.0 and m["kept_fraction"] == 0.0
    assert all(torch.equal(learner.policy.state_dict()[k], v) for k, v in before.items())


def test_ewma_proxy_moves_by_beta_and_resets_below_tau():
    # W = 3: β = 3/5 = 0.6; θ_prox ← (0.6 θ_prox + θ) / 1.6.
    learner = _learner("mis_ewma", window=3)
    learner.on_version(0)
    theta0 = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    # On-policy batch, one update: r_d = r_s = 1 on every token, ρ_t = 1 ≥ 0.9, no reset.
    m = learner.step(_on_policy(learner, seed=1))
    learner.on_version(1)
    assert m["active_fraction"] == 1.0 and m["ewma_reset"] == 0 and m["ewma_resets"] == 0
    theta1 = learner.policy.state_dict()
    prox = learner.policy_update.old_policy.proxy.state_dict()
    key = "model.layers.0.mlp.up_proj.weight"
    assert torch.allclose(prox[key], (0.6 * theta0[key] + theta1[key]) / 1.6, atol=1e-7)
    # Behaviour logprobs 1 nat off on half the tokens: ρ_t < 0.9, so the reset θ_prox ← θ fires.
    m = learner.step(_half_off(_on_policy(learner, seed=2)))
    assert m["active_fraction"] < 0.9 and m["masked_by_rd_fraction"] > 0.1
    assert m["ewma_reset"] == 1 and m["ewma_resets"] == 1
    prox = learner.policy_update.old_policy.proxy.state_dict()
    assert all(torch.equal(prox[k], v) for k, v in learner.policy.state_dict().items())


def test_ewma_without_reset_keeps_averaging():
    learner = _learner("mis_ewma", window=1, reset=False)  # β = 1/3
    learner.on_version(0)
    theta0 = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    m = learner.step(_half_off(_on_policy(learner, seed=2)))
    assert m["active_fraction"] < 0.9 and m["ewma_reset"] == 0
    key = "model.layers.1.mlp.down_proj.weight"
    want = (theta0[key] / 3 + learner.policy.state_dict()[key]) / (4 / 3)
    assert torch.allclose(learner.policy_update.old_policy.proxy.state_dict()[key], want, atol=1e-7)


def test_several_updates_per_batch_move_r_s():
    learner = _learner("mis_snapshot", epochs=2, minibatches=2)
    learner.on_version(0)
    m = learner.step(_on_policy(learner, seed=1))
    # 2 epochs × 2 minibatches; on-policy, so r_s = 1 only at the first update of each row.
    assert m["policy_updates"] == 4 and m["mean_abs_log_ratio"] > 0.0
    assert m["active_fraction"] + m["masked_by_rd_fraction"] + m["masked_by_rs_fraction"] == pytest.approx(
        1.0
    )
    assert m["masked_by_rd_fraction"] == 0.0  # π_old is the snapshot of the version that sampled
    assert m["old_policy_bytes"] > 0 and m["correction_time_s"] >= 0.0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"algorithm": "spo", "correction": "mis_snapshot"},
            "the mis_snapshot correction applies to the sao",
        ),
        (
            {"correction": "mis_ewma", "overrides": {"correction": {"window": 0}}},
            "correction.mis_ewma.window",
        ),
        ({"overrides": {"correction": {"epochs": 2}}}, "epochs does not apply to the dis correction"),
        (
            {"correction": "mis_snapshot", "overrides": {"correction": {"reset": False}}},
            "reset does not apply",
        ),
        ({"correction": "mis_ewma", "overrides": {"correction": {"c": 0.5}}}, "correction.mis_ewma.c"),
    ],
)
def test_correction_config_errors(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        build_config(**kwargs)
    assert needle in str(err.value)


def test_the_learner_process_snapshots_each_version_and_drops_too_stale_samples(tmp_path):
    """In ``learner.process``: a snapshot per published version (W + 1 = 2 kept), samples of
    version 0 trained at version 1 (staleness 1 = W) and dropped at version 2 (staleness 2)."""
    from core.logbus import open_log
    from testing.learner import BATCH, feed, in_process

    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    learner = in_process(tmp_path, db, correction={"kind": "mis_snapshot", "window": 1})
    assert learner.algorithm.policy_update.old_policy.store.versions() == [0]
    log = open_log(db)
    feed(log, 2 * BATCH, 0)  # every token generated by version 0
    learner.poll_once()
    first = learner.train_step()
    second = learner.train_step()
    assert first["dropped_stale_samples"] == 0 and second["dropped_stale_samples"] == 0
    assert second["staleness_max"] == 1 and second["policy_updates"] == 1
    assert learner.algorithm.policy_update.old_policy.store.versions() == [1, 2]
    feed(log, BATCH, 100)
    learner.poll_once()
    third = learner.train_step()
    assert third["dropped_stale_samples"] == BATCH and third["policy_loss"] == 0.0
    assert learner.version == 3 and learner.waiting_samples() == 0
