"""The gate before a version serves (learner.guard.gate): its statistics by hand, then the whole gate
on a tiny random Llama with a byte-level tokenizer (issue 22: "a candidate with a doubled KL
rejected by the gate before it serves")."""

import copy
import json
import math
from importlib import resources

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaForCausalLM

from learner.guard.gate import (
    GateConfig,
    GateError,
    GateResult,
    answer_tokens,
    decide,
    empty_share,
    kl_estimates,
    length_ratio,
    load_probes,
    mean_length,
    nonfinite_count,
    reference_answers,
    repetition_rate,
    run_gate,
)
from testing.models import EOS, byte_tokenizer, tiny_base

# ----------------------------------------------------------------------------- pure statistics


def test_answer_tokens_cut_at_the_first_end_of_sequence():
    assert answer_tokens([5, 6, 2, 7, 2], {2}) == ([5, 6], True)
    assert answer_tokens([5, 6], {2}) == ([5, 6], False)  # ran to the token limit
    assert answer_tokens([2, 2, 2], {2}) == ([], True)
    assert answer_tokens([9, 3, 1], {1, 3}) == ([9], True)


def test_empty_share_and_mean_length():
    answers = [[], [1], [], [1, 2]]
    assert empty_share(answers) == 2 / 4
    assert mean_length(answers) == (0 + 1 + 0 + 2) / 4
    assert empty_share([]) == 0.0
    assert mean_length([]) == 0.0


def test_length_ratio_is_the_mean_length_over_the_reference_mean_length():
    # means 1.5 and (4 + 2) / 2 = 3
    assert length_ratio([[1, 2], [3]], [[1, 2, 3, 4], [5, 6]]) == 1.5 / 3
    # an empty reference leaves no length to collapse from
    assert length_ratio([[1]], [[], []]) == 1.0
    assert length_ratio([[], []], [[1, 2]]) == 0.0


def test_repetition_rate_counts_repeated_ngrams_within_each_answer():
    # 4-grams of [1,2,3,4,1,2,3,4]: 1234, 2341, 3412, 4123, 1234 -> 5, the last repeats the first
    assert repetition_rate([[1, 2, 3, 4, 1, 2, 3, 4]], n=4) == 1 / 5
    # pooled with [7]*5 (7777 twice: 2 grams, 1 repeated) and [1,2,3] (no 4-gram): (1+1)/(5+2)
    assert repetition_rate([[1, 2, 3, 4, 1, 2, 3, 4], [7] * 5, [1, 2, 3]], n=4) == 2 / 7
    # the same n-gram in two answers is no repetition
    assert repetition_rate([[1, 2, 3, 4], [1, 2, 3, 4]], n=4) == 0.0
    # unigrams of [1,1,2]: the second 1 repeats
    assert repetition_rate([[1, 1, 2]], n=1) == 1 / 3
    assert repetition_rate([[1, 2]], n=4) == 0.0
    assert repetition_rate([], n=4) == 0.0


def test_repetition_rate_refuses_n_below_one():
    with pytest.raises(ValueError, match="n must be >= 1"):
        repetition_rate([[1, 2]], n=0)


def test_nonfinite_count():
    assert nonfinite_count(torch.tensor([[0.0, math.nan], [math.inf, -math.inf]])) == 3
    assert nonfinite_count(torch.zeros(4, 5)) == 0


def test_kl_estimates_is_the_k3_mean_per_reference():
    # d = log ref − log p = [log(0.25/0.5), log(0.5/0.25)] = [−ln 2, ln 2];
    # k3 = e^d − 1 − d = [0.5 − 1 + ln 2, 2 − 1 − ln 2], sum 0.5, mean 0.25
    lp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    (kl, same), unusable = kl_estimates(lp, [ref, lp.clone()])
    assert kl == pytest.approx(0.25, abs=1e-6)
    assert same == 0.0
    assert unusable == 0


def test_kl_estimates_leave_out_tokens_unusable_under_any_model():
    lp = torch.log(torch.tensor([0.5, 0.25, 0.5, 0.5]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.5, 0.5]))
    ref[2] = math.nan
    other = lp.clone()
    other[3] = -1000.0  # below learner.algo.finite.LOGPROB_FLOOR
    (kl, kl_other), unusable = kl_estimates(lp, [ref, other])
    # tokens 0 and 1 remain: the 0.25 of the test above; the other reference equals lp there
    assert kl == pytest.approx(0.25, abs=1e-6)
    assert kl_other == 0.0
    assert unusable == 2


def test_kl_estimates_without_a_usable_token_is_none():
    lp = torch.full((3,), math.nan)
    assert kl_estimates(lp, [torch.zeros(3), torch.zeros(3)]) == ([None, None], 3)


def test_kl_estimates_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="differ"):
        kl_estimates(torch.zeros(3), [torch.zeros(4)])
    with pytest.raises(ValueError, match=r"must be \[N\]"):
        kl_estimates(torch.zeros(2, 3), [torch.zeros(2, 3)])


BOUNDS = GateConfig(
    max_kl_base=1.0,
    max_kl_promoted=0.5,
    max_empty_share=0.25,
    min_length_ratio=0.5,
    max_repetition_rate=0.2,
    min_quality=0.6,
)
PASSING = dict(
    kl_base=0.9,
    kl_promoted=0.4,
    nonfinite_logits=0,
    empty=0.25,
    ratio=0.5,
    repetition=0.2,
    quality=0.6,
)


def test_decide_passes_figures_at_the_bounds():
    assert decide(BOUNDS, **PASSING) == []


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("kl_base", 1.01, "KL to the base 1.01 nats/token > 1"),
        ("kl_promoted", 0.6, "KL to the promoted version 0.6 nats/token > 0.5"),
        ("kl_base", None, "KL to the base: no answer token has a usable logprob"),
        ("nonfinite_logits", 7, "7 logits are not finite"),
        ("empty", 0.5, "empty answers 0.5 > 0.25"),
        ("ratio", 0.4, "length ratio to the base 0.4 < 0.5"),
        ("repetition", 0.3, "repetition rate (4-grams) 0.3 > 0.2"),
        ("quality", 0.5, "judge quality 0.5 < 0.6"),
    ],
)
def test_decide_names_each_bound_passed(field, value, reason):
    assert decide(BOUNDS, **(PASSING | {field: value})) == [reason]


def test_decide_ignores_the_quality_without_a_floor():
    assert decide(BOUNDS.model_copy(update={"min_quality": None}), **(PASSING | {"quality": 0.0})) == []


def test_gate_config_validates_its_bounds():
    with pytest.raises(ValidationError, match="max_empty_share"):
        GateConfig(max_empty_share=1.5)
    with pytest.raises(ValidationError, match="max_kl_base"):
        GateConfig(max_kl_base=0.0)
    with pytest.raises(ValidationError, match="sampling"):
        GateConfig(sampling="beam")
    with pytest.raises(ValidationError, match="max_kl"):
        GateConfig(max_kl=1.0)  # not a field


def test_gate_result_is_json_and_flattens_for_the_version_row():
    result = GateResult(
        probes=16,
        answer_tokens=500,
        kl_base=None,
        kl_promoted=0.1,
        unusable_tokens=0,
        nonfinite_logits=3,
        empty_share=0.0,
        mean_length=30.0,
        reference_mean_length=30.0,
        length_ratio=1.0,
        repetition_rate=0.0,
        quality=None,
        elapsed_s=1.5,
        passed=False,
        reasons=["3 logits are not finite"],
    )
    stored = json.loads(json.dumps(result.model_dump(mode="json")))
    assert GateResult.model_validate(stored) == result
    flat = result.version_metrics()
    assert flat["gate_passed"] is False
    assert flat["gate_kl_base"] is None
    assert flat["gate_nonfinite_logits"] == 3
    assert "gate_reasons" not in flat
    assert len(flat) == len(GateResult.model_fields) - 1


# ----------------------------------------------------------------------------- the probe set


def test_the_shipped_probe_set_is_the_simulations_prompt_and_requests():
    from judge.styles import NAMED_SCHEDULES, system_prompt

    probes = load_probes()
    assert len(probes.requests) == 16
    assert len(set(probes.requests)) == 16
    # The learner's own copy of the simulation's prompt (learner/ never imports judge/): a
    # change there shows here, and the bounds are then re-measured (docs/guard.md, The gate).
    assert probes.system == system_prompt(NAMED_SCHEDULES["default"])
    pool = json.loads(resources.files("judge.data").joinpath("requests.json").read_text(encoding="utf-8"))
    assert set(probes.requests) <= set(pool)


def test_load_probes_names_a_bad_file(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(GateError, match="none.json"):
        load_probes(missing)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"about": "x", "system": "s", "requests": []}))
    with pytest.raises(GateError, match="requests"):
        load_probes(bad)
    bad.write_text("{not json")
    with pytest.raises(GateError, match="bad.json"):
        load_probes(bad)


# ----------------------------------------------------------------------------- the gate on a tiny model


def shifted(model: LlamaForCausalLM, direction: dict[str, torch.Tensor], scale: float) -> LlamaForCausalLM:
    """A copy of ``model`` with ``scale · direction[name]`` added to each parameter."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in out.named_parameters():
            w.add_(scale * direction[name])
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.fixture(scope="module")
def direction(base):
    g = torch.Generator().manual_seed(1)
    return {n: w.detach().std() * torch.randn(w.shape, generator=g) for n, w in base.named_parameters()}


OPEN = GateConfig(max_kl_base=100.0, max_kl_promoted=100.0)
# Along ``direction``, a step this long is in the quadratic regime of the KL (about 0.07 nats/token).
STEP = 0.05


def test_the_base_as_candidate_passes_with_kl_zero(base, tokenizer):
    result = run_gate(base, base, None, tokenizer, GateConfig())
    assert result.passed, result.reasons
    assert result.kl_base == 0.0
    assert result.kl_promoted == 0.0
    assert result.length_ratio == 1.0  # the same answers: same model, same seed
    assert result.nonfinite_logits == 0
    assert result.unusable_tokens == 0
    assert result.probes == 16
    assert result.mean_length == result.reference_mean_length > 0
    # every answer token plus an end of sequence for each answer that ended before the limit
    assert 16 * result.mean_length <= result.answer_tokens <= 16 * result.mean_length + 16


def test_the_gate_is_seeded(base, tokenizer, direction):
    candidate = shifted(base, direction, STEP)
    first = run_gate(candidate, base, None, tokenizer, OPEN).model_dump(exclude={"elapsed_s"})
    second = run_gate(candidate, base, None, tokenizer, OPEN).model_dump(exclude={"elapsed_s"})
    assert first == second
    other = run_gate(candidate, base, None, tokenizer, OPEN.model_copy(update={"seed": 1}))
    assert other.kl_base != first["kl_base"]


def test_a_candidate_with_a_doubled_kl_is_rejected_before_it_serves(base, tokenizer, direction):
    # KL ≈ ½ δᵀFδ for a small step δ: a step √2 times longer along the same direction doubles it.
    near = shifted(base, direction, STEP)
    far = shifted(base, direction, STEP * math.sqrt(2))
    k = run_gate(near, base, None, tokenizer, OPEN).kl_base
    k2 = run_gate(far, base, None, tokenizer, OPEN).kl_base
    assert 1.6 < k2 / k < 2.4, (k, k2)
    bound = 1.25 * k  # k is just under the bound; 2k is well over it
    config = GateConfig(max_kl_base=bound, max_kl_promoted=bound)
    passing = run_gate(near, base, None, tokenizer, config)
    assert passing.passed, passing.reasons
    assert passing.kl_base == pytest.approx(k, rel=1e-6)
    rejected = run_gate(far, base, None, tokenizer, config)
    assert not rejected.passed
    assert rejected.kl_base == pytest.approx(k2, rel=1e-6)
    # promoted None: the base is what serves, so both KL bounds are passed
    assert rejected.reasons == [
        f"KL to the base {k2:.4g} nats/token > {bound:g}",
        f"KL to the promoted version {k2:.4g} nats/token > {bound:g}",
    ]


def test_the_kl_to_the_promoted_version(base, tokenizer, direction):
    near = shifted(base, direction, STEP)
    far = shifted(base, direction, STEP * math.sqrt(2))
    itself = run_gate(near, base, near, tokenizer, OPEN)
    assert itself.kl_promoted == 0.0
    assert itself.kl_base > 0
    as_base = run_gate(near, base, base, tokenizer, OPEN)
    assert as_base.kl_promoted == as_base.kl_base == itself.kl_base
    # far, one step past near: close to the promoted version, further from the base
    step = run_gate(far, base, near, tokenizer, OPEN)
    assert 0 < step.kl_promoted < step.kl_base
    bound = (step.kl_promoted + step.kl_base) / 2
    rejected = run_gate(
        far, base, near, tokenizer, OPEN.model_copy(update={"max_kl_promoted": 0.5 * step.kl_promoted})
    )
    assert [r.split(" ")[3] for r in rejected.reasons] == ["promoted"]
    assert run_gate(far, base, near, tokenizer, OPEN.model_copy(update={"max_kl_base": bound})).reasons == [
        f"KL to the base {step.kl_base:.4g} nats/token > {bound:g}"
    ]


def test_a_candidate_answering_only_end_of_sequence_is_rejected(base, tokenizer):
    # Every embedding row gets a large component 0, so every hidden state points along it after
    # the final norm; the end-of-sequence row's is larger, so its logit leads by tens of nats.
    silent = copy.deepcopy(base)
    with torch.no_grad():
        emb = silent.get_input_embeddings().weight
        emb[:, 0] = 100.0
        emb[EOS, 0] = 110.0
    result = run_gate(silent, base, None, tokenizer, OPEN)
    assert result.empty_share == 1.0
    assert result.mean_length == 0.0
    assert result.length_ratio == 0.0
    assert result.answer_tokens == 16  # one end of sequence per probe
    assert not result.passed
    assert result.reasons == ["empty answers 1 > 0.25", "length ratio to the base 0 < 0.5"]


def test_nan_in_the_weights_is_rejected_as_non_finite(base, tokenizer):
    broken = copy.deepcopy(base)
    with torch.no_grad():
        broken.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    result = run_gate(broken, base, None, tokenizer, OPEN)
    assert not result.passed
    # the NaN reaches the residual stream, then every logit through the norms
    assert result.nonfinite_logits == result.answer_tokens * 258
    assert result.kl_base is None
    assert result.unusable_tokens == result.answer_tokens
    assert result.reasons[0] == f"{result.answer_tokens * 258} logits are not finite"
    assert "KL to the base: no answer token has a usable logprob" in result.reasons


def test_the_judge_sees_the_answers_and_its_floor_rejects(base, tokenizer):
    seen = {}

    def judge(requests, answers):
        seen["requests"], seen["answers"] = requests, answers
        return 0.3

    config = GateConfig(min_quality=0.5)
    result = run_gate(base, base, None, tokenizer, config, judge=judge)
    assert seen["requests"] == load_probes().requests
    assert len(seen["answers"]) == 16 and all(isinstance(a, str) for a in seen["answers"])
    assert result.quality == 0.3
    assert result.reasons == ["judge quality 0.3 < 0.5"]
    assert run_gate(base, base, None, tokenizer, GateConfig(), judge=judge).passed  # no floor


def test_reference_answers_stand_in_for_the_base_generation(base, tokenizer, direction):
    candidate = shifted(base, direction, STEP)
    reference = reference_answers(base, tokenizer, OPEN)
    assert len(reference) == 16
    given = run_gate(candidate, base, None, tokenizer, OPEN, reference=reference)
    computed = run_gate(candidate, base, None, tokenizer, OPEN)
    assert given.model_dump(exclude={"elapsed_s"}) == computed.model_dump(exclude={"elapsed_s"})
    # half the reference length doubles the ratio
    halved = [r[: len(r) // 2] for r in reference]
    ratio = run_gate(candidate, base, None, tokenizer, OPEN, reference=halved).length_ratio
    assert ratio == pytest.approx(computed.mean_length / mean_length(halved))


def test_run_gate_names_its_errors(base, tokenizer, tmp_path):
    with pytest.raises(GateError, match="min_quality is set but no judge"):
        run_gate(base, base, None, tokenizer, GateConfig(min_quality=0.5))
    with pytest.raises(GateError, match="no end-of-sequence token"):
        run_gate(base, base, None, byte_tokenizer(eos=False), GateConfig())
    with pytest.raises(GateError, match="reference holds 2 answers for 16 probes"):
        run_gate(base, base, None, tokenizer, GateConfig(), reference=[[1], [2]])
    with pytest.raises(GateError, match="cannot load the probe set"):
        run_gate(base, base, None, tokenizer, GateConfig(probes=tmp_path / "none.json"))


def test_probes_sharing_no_prefix(base, tokenizer, tmp_path):
    # A template rendering only the user's text: "Apple" and "Banana" share no first token, so
    # generation runs without a prefix cache.
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = "{{ messages[1]['content'] }}"
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps({"about": "two", "system": "s", "requests": ["Apple", "Banana"]}))
    result = run_gate(base, base, None, bare, GateConfig(probes=probes))
    assert result.probes == 2
    assert result.passed, result.reasons
    assert result.kl_base == 0.0
