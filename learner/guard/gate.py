"""The gate: a candidate policy version answers a fixed probe set before it may serve anyone.

Issue 22 (guarded online learning), docs/design.md §9.1: each version starts as a candidate;
before any traffic reaches it, the gate runs it on the probe prompts shipped with the package
(``learner/guard/probes.json``, the simulation's system prompt and 16 of its writing requests) and
rejects it when

- its KL to the base policy, or to the promoted version, passes a bound (``learner.algo.kl.k3_kl``
  on the candidate's own sampled answer tokens, teacher-forced through each model);
- its answers degenerate: too many empty answers, a mean length collapsed against the base
  model's on the same prompts, or repeated n-grams within an answer;
- any of its logits on the probe answers is not finite;
- a configured judge scores the answers' quality below a floor.

The bounds (``GateConfig``'s defaults) come from a measurement on SmolLM2-135M: the base model
and weight perturbations of growing size, recorded in docs/guard.md, "The gate". The figures and
the verdict (``GateResult``) are stored with the version.

The statistics (``answer_tokens`` … ``kl_estimates``, ``decide``) are pure: lists and tensors
in, numbers out. ``run_gate`` runs the models: one seeded ``generate`` batch for the candidate
(and one for the base unless its answers are given, ``reference_answers``) and one
teacher-forced batch per model, each running the probes' common prefix once (``learner.algo.prefix``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from learner.algo.finite import usable_tokens
from learner.algo.kl import k3_kl
from learner.algo.prefix import body_hidden, shared_prefix_length
from learner.guard.gate_config import GateConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_MODEL = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

Judge = Callable[[list[str], list[str]], float]
"""A quality judge: ``judge(requests, answers)`` → the answers' mean quality in [0, 1], where
``requests`` are the probe requests (user text) and ``answers`` the candidate's decoded answers."""


class GateError(ValueError):
    """The gate cannot run: an unreadable probe set, a tokenizer without an end-of-sequence
    token, or a quality floor without a judge. The message names the problem."""


class ProbeSet(BaseModel):
    """The probe prompts: one system prompt and the user requests, each probe one chat."""

    model_config = _MODEL
    about: str
    """What the set is and where it comes from (not shown to the models)."""
    system: str = Field(min_length=1)
    """The system prompt of every probe."""
    requests: list[str] = Field(min_length=1)
    """The user messages, one probe each."""


class GateResult(BaseModel):
    """The gate's figures and verdict, stored with the version (JSON: ``model_dump(mode="json")``;
    ``version_metrics`` for the version row's flat metrics)."""

    model_config = _MODEL
    probes: int
    """Probe prompts answered."""
    answer_tokens: int
    """The candidate's action tokens over all probes (answers plus their end-of-sequence token)."""
    kl_base: float | None
    """k3 estimate of KL(candidate ‖ base), nats per usable answer token (None: none usable)."""
    kl_promoted: float | None
    """k3 estimate of KL(candidate ‖ promoted), nats per usable answer token (None: none usable)."""
    unusable_tokens: int
    """Answer tokens left out of the KL figures: a logprob not finite or below
    ``learner.algo.finite.LOGPROB_FLOOR`` under one of the models."""
    nonfinite_logits: int
    """The candidate's logits (over the vocabulary, at every answer position) that are NaN or ±inf."""
    empty_share: float
    """Share of probes answered with no token."""
    mean_length: float
    """The candidate's mean answer length (tokens, end of sequence excluded)."""
    reference_mean_length: float
    """The base model's mean answer length on the same probes and seed (tokens)."""
    length_ratio: float
    """``mean_length / reference_mean_length`` (1 when the base's answers are all empty)."""
    repetition_rate: float
    """Share of the answers' n-grams repeating an earlier n-gram of the same answer."""
    quality: float | None
    """The judge's mean quality of the answers (None: no judge)."""
    elapsed_s: float
    """Seconds the gate took."""
    passed: bool
    """True when no reason rejects the candidate."""
    reasons: list[str]
    """Why the candidate is rejected, one bound per entry (empty when it passed)."""

    def version_metrics(self) -> dict[str, float | int | bool | None]:
        """The numeric figures and ``passed``, each key prefixed ``gate_``, for the flat
        metrics of the version's row (the reasons go with the step's metrics, which nest)."""
        return {
            f"gate_{k}": v
            for k, v in self.model_dump().items()
            if v is None or isinstance(v, int | float | bool)
        }


def load_probes(path: Path | None = None) -> ProbeSet:
    """The probe set at ``path``, or the one shipped with the package when None.

    Raises:
        GateError: the file cannot be read, is not JSON or is not a ``ProbeSet``.
    """
    try:
        if path is None:
            text = resources.files("learner.guard").joinpath("probes.json").read_text(encoding="utf-8")
        else:
            text = Path(path).read_text(encoding="utf-8")
        return ProbeSet.model_validate_json(text)
    except (OSError, ValidationError) as exc:
        raise GateError(f"cannot load the probe set {path or 'learner/guard/probes.json'}: {exc}") from None


def render_probes(probes: ProbeSet, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Each probe as prompt token ids: the system and user messages through the tokenizer's chat
    template, ending with the assistant's generation prompt (as the server renders a request)."""
    out = []
    for request in probes.requests:
        messages = [{"role": "system", "content": probes.system}, {"role": "user", "content": request}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def answer_tokens(generated: Sequence[int], eos_ids: Collection[int]) -> tuple[list[int], bool]:
    """``(answer, ended)``: the tokens of ``generated`` before its first end-of-sequence token,
    and whether one was generated (False: the answer ran to the token limit)."""
    for i, tok in enumerate(generated):
        if tok in eos_ids:
            return list(generated[:i]), True
    return list(generated), False


def empty_share(answers: Sequence[Sequence[int]]) -> float:
    """Share of ``answers`` (token id lists) with no token; 0 when there are none."""
    return sum(1 for a in answers if not a) / len(answers) if answers else 0.0


def mean_length(answers: Sequence[Sequence[int]]) -> float:
    """Mean number of tokens per answer; 0 when there are none."""
    return sum(len(a) for a in answers) / len(answers) if answers else 0.0


def length_ratio(answers: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """``mean_length(answers) / mean_length(reference)``: below 1 when the answers are shorter
    than the reference's on the same prompts. 1 when the reference's answers are all empty
    (there is no length to collapse from)."""
    ref = mean_length(reference)
    return mean_length(answers) / ref if ref > 0 else 1.0


def repetition_rate(answers: Sequence[Sequence[int]], n: int = 4) -> float:
    """Share of the answers' n-grams that repeat an earlier n-gram of the same answer.

    An answer of L tokens has ``max(L − n + 1, 0)`` n-grams; the rate pools them over all
    answers (``Σ repeated / Σ n-grams``), so a long looping answer weighs by its length. 0 when
    no answer has n tokens.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    total = repeated = 0
    for answer in answers:
        seen = set()
        for i in range(len(answer) - n + 1):
            gram = tuple(answer[i : i + n])
            repeated += gram in seen
            seen.add(gram)
            total += 1
    return repeated / total if total else 0.0


def nonfinite_count(logits: torch.Tensor) -> int:
    """Number of NaN or ±inf entries of ``logits`` (any shape, float)."""
    return int((~torch.isfinite(logits)).sum().item())


def kl_estimates(
    logprobs: torch.Tensor, references: Sequence[torch.Tensor]
) -> tuple[list[float | None], int]:
    """``(kls, unusable)``: the k3 estimate of KL(candidate ‖ reference) for each reference, over
    the same tokens: those whose logprobs are usable under the candidate and every reference.

    Args:
        logprobs: [N] float, the candidate's log-probabilities of its own sampled tokens (nats).
        references: [N] float tensors, each reference's log-probabilities of the same tokens.

    Returns:
        ``kls``: one ``learner.algo.kl.k3_kl`` per reference over the usable tokens
        (``learner.algo.finite.usable_tokens``), nats per token, None when no token is usable;
        ``unusable``: how many of the N tokens were left out.

    Raises:
        ValueError: a shape differs from ``logprobs``' or ``logprobs`` is not 1-D.
    """
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be [N], got {tuple(logprobs.shape)}")
    for ref in references:
        if ref.shape != logprobs.shape:
            raise ValueError(
                f"reference logprobs {tuple(ref.shape)} differ from logprobs {tuple(logprobs.shape)}"
            )
    lp = logprobs[None]
    refs = [ref[None] for ref in references]
    mask, unusable = usable_tokens(torch.ones_like(lp, dtype=torch.bool), lp, *refs)
    if not bool(mask.any()):
        return [None] * len(refs), unusable
    return [float(k3_kl(lp, ref, mask).item()) for ref in refs], unusable


def decide(
    config: GateConfig,
    kl_base: float | None,
    kl_promoted: float | None,
    nonfinite_logits: int,
    empty: float,
    ratio: float,
    repetition: float,
    quality: float | None,
) -> list[str]:
    """The reasons to reject a candidate with these figures (empty: it passes); each reason
    names the figure, its value and the bound of ``config`` it passes."""
    reasons = []
    if nonfinite_logits:
        reasons.append(f"{nonfinite_logits} logits are not finite")
    for name, kl, bound in (
        ("base", kl_base, config.max_kl_base),
        ("promoted version", kl_promoted, config.max_kl_promoted),
    ):
        if kl is None:
            reasons.append(f"KL to the {name}: no answer token has a usable logprob")
        elif kl > bound:
            reasons.append(f"KL to the {name} {kl:.4g} nats/token > {bound:g}")
    if empty > config.max_empty_share:
        reasons.append(f"empty answers {empty:.3g} > {config.max_empty_share:g}")
    if ratio < config.min_length_ratio:
        reasons.append(f"length ratio to the base {ratio:.3g} < {config.min_length_ratio:g}")
    if repetition > config.max_repetition_rate:
        reasons.append(
            f"repetition rate ({config.repetition_ngram}-grams) {repetition:.3g} > {config.max_repetition_rate:g}"
        )
    if config.min_quality is not None and quality is not None and quality < config.min_quality:
        reasons.append(f"judge quality {quality:.3g} < {config.min_quality:g}")
    return reasons


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: [B, T] long, the rows right-padded with ``pad``."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    return ids, attention


def _generate(
    model: PreTrainedModel, prompts: list[list[int]], config: GateConfig, eos: int, pad: int
) -> list[list[int]]:
    """The model's generated tokens per prompt (``max_new_tokens``, padding after the end of
    sequence included), from one batch under a seeded, forked RNG.

    The prompts' common prefix (chat template and system prompt, most of each probe) runs once
    and its cache is repeated over the batch; each row is then ``prefix, padding, remainder``,
    and ``generate`` counts positions over attended tokens only.
    """
    from transformers import GenerationConfig

    ids, attention = _padded(prompts, pad, model.device)
    # Every row keeps a token after the prefix: generation starts from its logits.
    shared = min(shared_prefix_length(ids, attention), min(len(p) for p in prompts) - 1)
    width = max(len(p) for p in prompts)
    rows = [p[:shared] + [pad] * (width - len(p)) + p[shared:] for p in prompts]
    ids = torch.tensor(rows, device=model.device)
    attention = torch.tensor(
        [[1] * shared + [0] * (width - len(p)) + [1] * (len(p) - shared) for p in prompts],
        device=model.device,
    )
    generation = GenerationConfig(
        max_new_tokens=config.max_new_tokens,
        do_sample=config.sampling == "sampled",
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=eos,
        pad_token_id=pad,
        # NaN logits would stop the sampler; the scoring pass counts them instead.
        remove_invalid_values=True,
    )
    with torch.random.fork_rng(), torch.inference_mode():
        cache = None
        if shared:
            cache = model(input_ids=ids[:1, :shared], use_cache=True).past_key_values
            cache.batch_repeat_interleave(len(prompts))
        torch.manual_seed(config.seed)
        out = model.generate(
            input_ids=ids, attention_mask=attention, past_key_values=cache, generation_config=generation
        )
    return out[:, width:].tolist()


#: Answer tokens per LM-head chunk of the scoring pass ([chunk, V] float32 logits at a time).
SCORE_CHUNK = 256


def _score(
    model: PreTrainedModel, prompts: list[list[int]], actions: list[list[int]], pad: int
) -> tuple[torch.Tensor, int]:
    """``(logprobs, nonfinite)``: the [N] float32 log-probabilities (temperature 1) of every
    row's ``actions`` after its prompt under ``model``, rows concatenated in order (N = total
    actions), and how many of the N × V logits at those positions are not finite.

    One teacher-forced pass of the right-padded batch (``learner.algo.prefix.body_hidden``: the
    shared prefix once), then the LM head on the answer positions only, in chunks.
    """
    ids, attention = _padded([p + a for p, a in zip(prompts, actions, strict=True)], pad, model.device)
    rows = torch.tensor([i for i, a in enumerate(actions) for _ in a], device=model.device)
    cols = torch.tensor([len(p) + j for p, a in zip(prompts, actions, strict=True) for j in range(len(a))])
    cols = cols.to(model.device)
    head = model.get_output_embeddings()
    out, nonfinite = [], 0
    with torch.inference_mode():
        hidden = body_hidden(model.base_model, ids, attention)
        for s in range(0, rows.numel(), SCORE_CHUNK):
            r, c = rows[s : s + SCORE_CHUNK], cols[s : s + SCORE_CHUNK]
            logits = head(hidden[r, c - 1]).float()
            nonfinite += nonfinite_count(logits)
            out.append(torch.log_softmax(logits, dim=-1).gather(1, ids[r, c][:, None]).squeeze(1))
    return torch.cat(out).cpu(), nonfinite


def _probe_prompts(
    tokenizer: PreTrainedTokenizerBase, config: GateConfig
) -> tuple[ProbeSet, list[list[int]]]:
    """The probe set and its rendered prompts; raises GateError as ``run_gate``."""
    if tokenizer.eos_token_id is None:
        raise GateError("the tokenizer has no end-of-sequence token")
    probes = load_probes(config.probes)
    return probes, render_probes(probes, tokenizer)


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def reference_answers(
    base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: GateConfig
) -> list[list[int]]:
    """The base model's answers to the probes (token ids, end of sequence excluded), as
    ``run_gate`` generates them for the length ratio. They depend only on the base, the
    tokenizer and ``config``: a learner computes them once and passes them to every gate.

    Raises:
        GateError: as ``run_gate``.
    """
    _, prompts = _probe_prompts(tokenizer, config)
    eos = tokenizer.eos_token_id
    return [answer_tokens(g, {eos})[0] for g in _generate(base, prompts, config, eos, _pad_id(tokenizer))]


def run_gate(
    candidate: PreTrainedModel,
    base: PreTrainedModel,
    promoted: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    config: GateConfig,
    judge: Judge | None = None,
    reference: list[list[int]] | None = None,
) -> GateResult:
    """Run the gate on ``candidate``: answer the probes, score them, decide.

    The candidate answers every probe (one batch, seed ``config.seed``; the base too, unless
    ``reference`` holds its answers); the candidate's action tokens (its answer and, when
    generated, the end-of-sequence token) are scored under the candidate, the base and the
    promoted version by teacher-forced forward passes, giving the KL figures and the non-finite
    logit count; the degeneration figures come from the answers' token ids (``answer_tokens`` …
    ``repetition_rate``). No model is changed.

    Cost on SmolLM2-135M, 16 probes, 32 new tokens, 2 CPU cores: docs/guard.md, The gate.

    Args:
        candidate: the new version's policy (any dtype and device; eval mode expected).
        base: the base policy (version 0), e.g. the KL anchor's reference.
        promoted: the version serving now; None when that is the base.
        tokenizer: the models' tokenizer, with a chat template and an end-of-sequence token.
        config: bounds and generation settings.
        judge: asked for the answers' quality when ``config.min_quality`` is set (also called,
            and its score recorded, when given without a floor).
        reference: the base's answers, ``reference_answers(base, tokenizer, config)`` (the same
            config); None: generated here.

    Returns:
        The ``GateResult``; ``passed`` is False with one reason per bound passed.

    Raises:
        GateError: the probe set cannot be loaded, the tokenizer has no end-of-sequence token,
            ``config.min_quality`` is set without a judge, or ``reference`` does not hold one
            answer per probe.
    """
    started = time.perf_counter()
    if config.min_quality is not None and judge is None:
        raise GateError("min_quality is set but no judge was given")
    probes, prompts = _probe_prompts(tokenizer, config)
    eos, pad = tokenizer.eos_token_id, _pad_id(tokenizer)
    if reference is None:
        reference = reference_answers(base, tokenizer, config)
    elif len(reference) != len(prompts):
        raise GateError(f"reference holds {len(reference)} answers for {len(prompts)} probes")

    answers, actions = [], []
    for generated in _generate(candidate, prompts, config, eos, pad):
        answer, ended = answer_tokens(generated, {eos})
        answers.append(answer)
        actions.append(answer + [eos] if ended else answer)

    logprobs, nonfinite = _score(candidate, prompts, actions, pad)
    references = [base] if promoted is None else [base, promoted]
    kls, unusable = kl_estimates(logprobs, [_score(m, prompts, actions, pad)[0] for m in references])
    kl_base, kl_promoted = kls[0], kls[-1]

    quality = None
    if judge is not None:
        quality = float(
            judge(list(probes.requests), tokenizer.batch_decode(answers, skip_special_tokens=True))
        )
    empty = empty_share(answers)
    ratio = length_ratio(answers, reference)
    repetition = repetition_rate(answers, config.repetition_ngram)
    reasons = decide(config, kl_base, kl_promoted, nonfinite, empty, ratio, repetition, quality)
    return GateResult(
        probes=len(prompts),
        answer_tokens=int(logprobs.numel()),
        kl_base=kl_base,
        kl_promoted=kl_promoted,
        unusable_tokens=unusable,
        nonfinite_logits=nonfinite,
        empty_share=empty,
        mean_length=mean_length(answers),
        reference_mean_length=mean_length(reference),
        length_ratio=ratio,
        repetition_rate=repetition,
        quality=quality,
        elapsed_s=time.perf_counter() - started,
        passed=not reasons,
        reasons=reasons,
    )
