"""The KL anchor (learner.algo.kl) by hand, and its effect inside an SAO step."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.algo.critic import ValueModel
from learner.algo.dis import dis_loss
from learner.algo.kl import MAX_K3, MAX_LOG_RATIO, k3, k3_kl
from learner.algo.sao import SAOLearner
from learner.data.batch import policy_logprobs
from testing.models import make_batch, make_config, tiny_policy


def test_k3_by_hand():
    """k3 = exp(d) − d − 1 with d = log π_ref − log πθ, averaged over the mask.

    Row 0: d = −1.0 − (−2.0) = 1.0 → e − 1 − 1 = 0.718282; d = 0 → 0.
    Row 1: d = −3.0 − (−1.0) = −2.0 → e⁻² + 2 − 1 = 1.135335; the third token is masked.
    Mean over 3 tokens: (0.718282 + 0 + 1.135335) / 3 = 0.617872.
    """
    lp = torch.tensor([[-2.0, -0.5, 0.0], [-1.0, -4.0, 0.0]])
    ref = torch.tensor([[-1.0, -0.5, 0.0], [-3.0, -4.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected = ((math.e - 2) + 0.0 + (math.exp(-2) + 1)) / 3
    assert expected == pytest.approx(0.617872, abs=1e-6)
    assert k3_kl(lp, ref, mask).item() == pytest.approx(expected, abs=1e-6)


def test_k3_by_hand_is_what_the_diagnostics_report():
    """k3(x) = e^x − 1 − x: k3(ln 2) = 2 − 1 − ln 2 = 0.306853, k3(−ln 2) = 0.5 − 1 + ln 2 =
    0.193147. DIS's approx_kl over those two log-ratios is their mean, 0.25."""
    x = torch.tensor([math.log(2), -math.log(2)], dtype=torch.float64)
    assert k3(x).tolist() == pytest.approx([1 - math.log(2), math.log(2) - 0.5], abs=1e-12)
    assert k3(x).tolist() == pytest.approx([0.306853, 0.193147], abs=1e-6)
    lp = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]])
    rollout = torch.tensor([[0.0, math.log(0.25), math.log(0.5)]])  # log r = ±ln 2
    _, stats = dis_loss(lp, rollout, torch.ones(1, 3), torch.tensor([[0, 1, 1]]))
    assert stats["approx_kl"] == pytest.approx(0.25, abs=1e-6)


def test_k3_gradient_pulls_towards_the_reference():
    """∂k3/∂log πθ = 1 − exp(d): with d = 1 it is 1 − e = −1.718282 (raise log πθ), d = −2 gives
    1 − e⁻² = 0.864665 (lower it); divided by the 2 masked tokens."""
    lp = torch.tensor([[-2.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -3.0]])
    k3_kl(lp, ref, torch.ones(1, 2)).backward()
    assert lp.grad.tolist()[0] == pytest.approx([(1 - math.e) / 2, (1 - math.exp(-2)) / 2], abs=1e-6)


def test_k3_masked_positions_and_empty_mask():
    lp = torch.tensor([[float("nan"), -1.0]], requires_grad=True)
    ref = torch.tensor([[float("inf"), -1.0]])
    out = k3_kl(lp, ref, torch.tensor([[0, 1]]))
    assert out.item() == 0.0
    out.backward()
    assert lp.grad.tolist() == [[0.0, 0.0]]
    empty = k3_kl(lp, ref, torch.zeros(1, 2))
    assert empty.item() == 0.0 and empty.requires_grad


def test_k3_clips_the_log_ratio_and_the_estimate():
    """d = 0 − (−100) = 100 is read as 20, and e^20 − 20 − 1 ≈ 4.85e8 is clamped to 10;
    d = 2.5 stays: e^2.5 − 2.5 − 1 = 8.682494, under the clamp."""
    lp = torch.tensor([[-100.0, -2.5]], requires_grad=True)
    out = k3_kl(lp, torch.tensor([[0.0, 0.0]]), torch.tensor([[1, 0]]))
    assert MAX_LOG_RATIO == 20.0 and out.item() == MAX_K3 == 10.0
    out.backward()
    assert lp.grad.tolist() == [[0.0, 0.0]]  # clamped: the anchor does not pull on that token
    kept = k3_kl(torch.tensor([[-2.5]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    assert kept.item() == pytest.approx(math.exp(2.5) - 3.5, abs=1e-5)
    assert kept.item() == pytest.approx(8.682494, abs=1e-5)


def test_k3_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shapes differ"):
        k3_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-10, 10), min_size=1, max_size=20),
    st.lists(st.floats(-10, 10), min_size=1, max_size=20),
)
def test_k3_is_non_negative_and_zero_at_equality(a, b):
    """Tiny |d| included: exp(d) − d − 1 rounds below 0 in float32, expm1(d) − d does not."""
    n = min(len(a), len(b))
    lp, ref = torch.tensor([a[:n]]), torch.tensor([b[:n]])
    assert k3_kl(lp, ref, torch.ones(1, n)).item() >= 0.0
    assert k3_kl(lp, lp, torch.ones(1, n)).item() == 0.0
    tiny = torch.tensor([[1e-8, 3e-6, -4e-5, 2e-7]])
    assert k3_kl(torch.zeros(1, 4), tiny, torch.ones(1, 4)).item() >= 0.0


def test_sao_step_with_the_reference_equal_to_the_policy_has_zero_kl():
    """Before the first update πθ = π_ref, so kl_ref = 0 and the step equals the plain one: the
    anchor's gradient 1 − e^d is 0 at d = 0."""
    policy, plain_policy = tiny_policy(), tiny_policy()
    learner = SAOLearner(
        make_config(kl_coef=0.5, policy_lr=1e-2, critic_lr=1e-2, critic_warmup_steps=0),
        policy,
        ValueModel.from_policy(policy),
        reference=tiny_policy(),
    )
    plain = SAOLearner(
        make_config(policy_lr=1e-2, critic_lr=1e-2, critic_warmup_steps=0),
        plain_policy,
        ValueModel.from_policy(plain_policy),
    )
    metrics = learner.step(make_batch(policy))
    plain.step(make_batch(plain_policy))
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-9)
    for (name, p), q in zip(policy.named_parameters(), plain_policy.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    assert not any(p.requires_grad for p in learner.policy_update.anchor.reference.parameters())
    assert learner.step(make_batch(policy, seed=1))["kl_ref"] > 0.0


def test_the_no_grad_measure_is_the_kl_ref_the_next_step_records_on_that_batch():
    """``SAOLearner.reference_kl`` (the guard's drift veto measures a lineage's newest version
    with it): the policy's k3 KL to the reference on a batch, without an update, is what the next
    DIS step records as kl_ref on that batch (measured there before its update). Before any
    update πθ = π_ref: d = 0 on every token and k3 = e⁰ − 1 − 0 = 0."""
    policy = tiny_policy()
    learner = SAOLearner(
        make_config(kl_coef=0.5, policy_lr=1e-2, critic_lr=1e-2, critic_warmup_steps=0),
        policy,
        ValueModel.from_policy(policy),
        reference=tiny_policy(),
    )
    assert learner.reference_kl(make_batch(policy)) == 0.0
    learner.step(make_batch(policy))
    batch = make_batch(policy, seed=1)
    weights = {k: v.clone() for k, v in policy.state_dict().items()}
    kl = learner.reference_kl(batch)
    assert kl > 0.0 and learner.steps == 1
    assert all(torch.equal(v, weights[k]) for k, v in policy.state_dict().items())  # nothing moved
    assert learner.step(batch)["kl_ref"] == kl


def test_the_measure_needs_the_anchor():
    policy = tiny_policy()
    learner = SAOLearner(make_config(), policy, ValueModel.from_policy(policy))
    with pytest.raises(ValueError, match="the sao algorithm has no KL anchor"):
        learner.reference_kl(make_batch(policy))


def test_kl_alone_pulls_a_moved_policy_back_to_the_reference():
    """All rewards 0 and V clamped to 0 → every advantage is 0, so only the KL term moves the
    policy: the k3 estimate must fall step by step."""
    reference = tiny_policy(seed=0)
    policy = tiny_policy(seed=3)
    critic = ValueModel.from_policy(policy, head_bias=0.0)
    learner = SAOLearner(
        make_config(kl_coef=1.0, policy_lr=3e-3, critic_lr=0.0, critic_warmup_steps=0),
        policy,
        critic,
        reference=reference,
    )
    batch = make_batch(policy, rewards=(0.0, 0.0, 0.0, 0.0))
    kls = []
    for _ in range(5):
        with torch.no_grad():
            batch.rollout_logprobs = (
                policy_logprobs(policy, batch.input_ids, batch.attention_mask, batch.temperatures)
                * batch.action_mask
            )
        kls.append(learner.step(batch)["kl_ref"])
    assert all(b < a for a, b in zip(kls, kls[1:], strict=False)), kls


def test_kl_needs_a_reference_and_a_non_negative_coefficient():
    policy = tiny_policy()
    with pytest.raises(ValueError, match="needs a reference"):
        SAOLearner(make_config(kl_coef=0.1), policy, ValueModel.from_policy(policy))
    # A negative coefficient is refused where the config is made, naming the field.
    with pytest.raises(ValueError, match="kl_coef: Input should be greater than or equal to 0"):
        SAOLearner(make_config(kl_coef=-0.1), policy, ValueModel.from_policy(policy), reference=tiny_policy())
    with pytest.raises(ValueError, match="uses no reference policy"):
        SAOLearner(make_config(), policy, ValueModel.from_policy(policy), reference=tiny_policy())
