"""The learner config (presets, bounds, JSON) and the algorithm contract (no engine)."""

from __future__ import annotations

import json

import pytest
import torch

from core.hardware import bf16_native
from learner.algo.algorithm import Algorithm
from learner.algo.critic import ValueModel
from learner.algo.registry import ALGORITHMS, build_algorithm
from learner.algo.sao import SAOLearner
from learner.algo.spo import SPOLearner
from learner.config import (
    ALGORITHM_MODELS,
    PRESETS,
    ConfigError,
    LearnerConfig,
    OptimizerConfig,
    SAOAlgorithm,
    build_config,
    load_config,
    overlay,
)
from testing.models import FAST, make_batch, make_config, tiny_policy

# Two SAO steps (the second batch sampled before the first step, so its ratios differ from 1)
# on tiny_policy() with a critic from its body (trainable="mlp") and FAST. Obtained by running
# SAOLearner(policy, ValueModel.from_policy(policy), SAOConfig(**FAST)) at commit 53049ca,
# before the config/contract refactor; timings are left out.
BEFORE_METRICS = [
    {
        "critic_loss": 0.21981221437454224,
        "critic_grad_norm": 1.257611870765686,
        "explained_variance": 0.0,
        "explained_variance_after": 0.65941978121089,
        "value_mean": 0.5523781180381775,
        "value_clamped_fraction": 0.0,
        "critic_lr": 0.01,
        "action_tokens": 24,
        "nonfinite_tokens": 0,
        "kept_fraction": 1.0,
        "mean_abs_log_ratio": 0.0,
        "approx_kl": 0.0,
        "policy_loss": 0.09690973162651062,
        "policy_grad_norm": 0.4544191360473633,
        "policy_lr": 0.01,
        "advantage_mean": 0.022265905514359474,
        "reward_mean": 0.5,
        "tokens": 38,
        "step": 1,
    },
    {
        "critic_loss": 0.18058956786990166,
        "critic_grad_norm": 1.6353577971458435,
        "explained_variance": -0.09336854973616249,
        "explained_variance_after": 0.9953768493907879,
        "value_mean": 0.5943681001663208,
        "value_clamped_fraction": 0.8333333134651184,
        "critic_lr": 0.01,
        "action_tokens": 24,
        "nonfinite_tokens": 0,
        "kept_fraction": 1.0,
        "mean_abs_log_ratio": 0.10290075341860454,
        "approx_kl": 0.008532667634672047,
        "policy_loss": -0.036461103707551956,
        "policy_grad_norm": 0.07493788003921509,
        "policy_lr": 0.01,
        "advantage_mean": -0.009374406188726425,
        "reward_mean": 0.5,
        "tokens": 38,
        "step": 2,
    },
]
BEFORE_WEIGHTS = {
    "policy_sum": 158.62102292486816,
    "policy_abs": 627.1909876144491,
    "critic_sum": 158.4269515169376,
    "q_proj_0_0": -0.015589522197842598,
    "embed_3_5": 0.029641639441251755,
}


def _fingerprint(policy, critic) -> dict[str, float]:
    return {
        "policy_sum": sum(float(v.double().sum()) for v in policy.state_dict().values()),
        "policy_abs": sum(float(v.double().abs().sum()) for v in policy.state_dict().values()),
        "critic_sum": sum(float(v.double().sum()) for v in critic.state_dict().values()),
        "q_proj_0_0": policy.model.layers[0].self_attn.q_proj.weight[0, 0].item(),
        "embed_3_5": policy.model.embed_tokens.weight[3, 5].item(),
    }


def _two_steps(learner, policy, critic) -> tuple[list[dict], dict]:
    batches = [make_batch(policy, seed=s) for s in (0, 1)]
    metrics = []
    for b in batches:
        m = learner.step(b)
        metrics.append({k: v for k, v in m.items() if k not in ("step_time_s", "tokens_per_s")})
    return metrics, _fingerprint(policy, critic)


def _assert_same(metrics, weights) -> None:
    for got, want in zip(metrics, BEFORE_METRICS, strict=True):
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for k, v in BEFORE_WEIGHTS.items():
        assert weights[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


def test_seeded_sao_step_is_unchanged_by_the_refactor():
    torch.manual_seed(0)
    policy = tiny_policy()
    critic = ValueModel.from_policy(policy, trainable="mlp")
    learner = SAOLearner(make_config(**FAST), policy, critic)
    _assert_same(*_two_steps(learner, policy, critic))


def test_the_config_path_builds_the_same_sao_step():
    """LearnerConfig → build_algorithm gives the learner SAOConfig(**FAST) gave before."""
    built = LearnerConfig(
        optimizer=OptimizerConfig(policy_lr=1e-2),
        algorithm=SAOAlgorithm(critic_lr=1e-2, critic_warmup_steps=0),
    )
    torch.manual_seed(0)
    learner = build_algorithm(built, tiny_policy)
    assert isinstance(learner, SAOLearner) and isinstance(learner, Algorithm)
    assert learner.config == make_config(**FAST)
    _assert_same(*_two_steps(learner, learner.policy, learner.critic))


def test_registry_picks_each_implementation():
    assert set(ALGORITHMS) == set(ALGORITHM_MODELS.values())  # every algorithm has a class
    for name, cls, critic in (("sao", SAOLearner, True), ("running_mean", SAOLearner, False)):
        algo = build_algorithm(build_config(algorithm=name), tiny_policy)
        assert type(algo) is cls and (algo.critic is not None) == critic
    spo = build_algorithm(build_config(algorithm="spo"), tiny_policy)
    assert type(spo) is SPOLearner and spo.config.optimizer.policy_lr == 5e-5
    kl = build_algorithm(build_config("demo"), tiny_policy)
    assert kl.policy_update.anchor is not None and kl.config.algorithm.kl_coef == 0.04


def test_presets():
    cpu = build_config("cpu")
    assert cpu == LearnerConfig()
    opt = cpu.optimizer
    assert (cpu.batch_size, opt.policy_lr, cpu.algorithm.critic_lr, opt.adam_beta1) == (8, 5e-5, 1e-4, 0.9)
    demo = build_config("demo")
    assert (demo.batch_size, demo.optimizer.policy_lr, demo.optimizer.adam_beta1) == (16, 1e-4, 0.5)
    assert (demo.algorithm.critic_lr, demo.algorithm.kl_coef) == (2e-4, 0.04)
    # The bf16 learner where the CPU has bf16 units, float32 where a bf16 matmul is the slow one;
    # eager: compiled layers were no faster at the demo's shape (docs/log/2026-12-05-demo-runs.md).
    assert (demo.bf16, demo.compile_layers, cpu.bf16) == (bf16_native(), False, False)
    paper = build_config("paper")
    assert (paper.batch_size, paper.optimizer.policy_lr, paper.algorithm.critic_lr) == (128, 1e-6, 5e-6)
    # A preset's algorithm fields apply where the algorithm has them: spo has no critic or KL.
    spo = build_config("demo", algorithm="spo")
    assert spo.algorithm.name == "spo" and spo.optimizer.policy_lr == 1e-4
    assert spo.bf16 == bf16_native()
    assert not hasattr(spo.algorithm, "kl_coef")
    assert set(PRESETS) == {"paper", "cpu", "demo"}


def test_json_round_trip(tmp_path):
    config = build_config("demo", algorithm="running_mean", overrides={"max_steps": 7})
    path = tmp_path / "learner.json"
    path.write_text(config.to_json())
    assert load_config(path) == config
    # Overrides on top of a file: the algorithm switch keeps only the fields the new one has.
    switched = load_config(path, algorithm="sao", overrides={"algorithm": {"critic_lr": 3e-4}})
    assert switched.algorithm.kl_coef == 0.04 and switched.algorithm.critic_lr == 3e-4


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"algorithm": "ppo"}, "unknown algorithm 'ppo'"),
        ({"preset": "fast"}, "unknown preset 'fast'"),
        (
            {"algorithm": "spo", "overrides": {"algorithm": {"kl_coef": 0.1}}},
            "kl_coef does not apply to the spo",
        ),
        ({"overrides": {"algorithm": {"critic_trainable": "attn"}}}, "algorithm.sao.critic_trainable"),
        ({"overrides": {"algorithm": {"gae_mode": "steps"}}}, "algorithm.sao.gae_mode"),
        ({"overrides": {"batch_size": 0}}, "batch_size: Input should be greater than or equal to 1"),
        ({"overrides": {"algorithm": {"eps_low": 1.5}}}, "eps_low: Input should be less than or equal to 1"),
        ({"overrides": {"algorithm": {"value_range": (1.0, 0.0)}}}, "value_range must be (low, high)"),
        ({"overrides": {"correction": {"kind": "vtrace"}}}, "unknown correction 'vtrace'"),
        (
            {"overrides": {"optimizer": {"policy_lr": -1.0}}},
            "optimizer.policy_lr: Input should be greater than or equal to 0",
        ),
        ({"overrides": {"optimizer": {"lr": 0.1}}}, "optimizer.lr: Extra inputs are not permitted"),
        # The guard's rule: a margin over half the reward range, or an error rate over one half.
        ({"overrides": {"guard": {"delta": 0.6}}}, "guard.delta: Input should be less than or equal to 0.5"),
        ({"overrides": {"guard": {"alpha": 0.9}}}, "guard.alpha: Input should be less than or equal to 0.5"),
        # No learner setting takes inf or nan: a poll or time-out that never fires is None.
        ({"overrides": {"poll_s": float("inf")}}, "poll_s: Input should be a finite number"),
        (
            {"overrides": {"guard": {"max_seconds": float("inf")}}},
            "guard.max_seconds: Input should be a finite",
        ),
    ],
)
def test_config_errors_name_the_field(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        build_config(**kwargs)
    assert needle in str(err.value)


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text(json.dumps([1]))
    with pytest.raises(ConfigError, match="a config is a JSON object"):
        load_config(tmp_path / "list.json")


def test_an_optimizer_override_keeps_the_presets_other_optimizer_fields():
    """The sections are merged field by field: demo's β1 0.5 survives a new learning rate."""
    config = build_config("demo", overrides={"optimizer": {"policy_lr": 3e-4}})
    assert (config.optimizer.policy_lr, config.optimizer.adam_beta1) == (3e-4, 0.5)
    assert config.algorithm.kl_coef == 0.04


def test_policy_fields_without_a_kind_join_the_kind_laid_over_them():
    """A file's ``{"policy": {"rank": 4, "b_lr_ratio": 16}}`` under ``--policy lora`` keeps its
    rank and ratio (they were dropped as another kind's); a base of another kind still drops its
    own fields (a LoRA rank under ``full``)."""
    fields = overlay({"batch_size": 16}, {"policy": {"rank": 4, "b_lr_ratio": 16}})
    assert overlay(fields, {"policy": {"kind": "lora"}})["policy"] == {
        "rank": 4,
        "b_lr_ratio": 16,
        "kind": "lora",
    }
    lora = {"policy": {"kind": "lora", "rank": 4}}
    assert overlay(lora, {"policy": {"kind": "full"}})["policy"] == {"kind": "full"}
    assert overlay(lora, {"policy": {"rank": 2}})["policy"] == {"kind": "lora", "rank": 2}
