"""Calibration of the gate's bounds (``learner.guard.gate``): its figures for the base model and for
broken copies of it, side by side in one run.

Usage: ``python bench/gate_calibration.py [MODEL_DIR] [--threads 2] [--seed 0]``. MODEL_DIR
defaults to ``var/model`` (``saoserve prepare-model``).

Candidates, each a float32 copy of the base model:

- ``base``: the base itself (the KL is 0 by construction; the other figures are the base's);
- ``noise s``: every weight tensor ``w`` plus ``s · std(w) · N(0, 1)`` (seeded);
- ``step η`` / ``flipped step η``: one sign-descent step ``w − η · sign(∇)`` (AdamW's first step
  at learning rate η has this size) on the NLL of the base's own probe answers, and the same
  step with its sign flipped (``w + η · sign(∇)``, ascending the NLL: a learner bug);
- ``scaled c``: every weight tensor times c;
- ``final norm ×c``: the final RMSNorm's weight times c, so every logit is c times the base's
  (sampling at temperature 1/c);
- ``end-of-sequence row ×c``: the end-of-sequence token's embedding row (tied to the LM head)
  times c.

Each row runs ``run_gate`` with the default ``GateConfig`` (the base's answers computed once,
``reference_answers``); the table shows the figures, the verdict and the first answer's start.
The results are in docs/guard.md, "The gate".
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.guard.gate import GateConfig, load_probes, reference_answers, render_probes, run_gate


def nll_gradient_sign(base, prompts: list[list[int]], answers: list[list[int]]) -> dict[str, torch.Tensor]:
    """``sign(∇ NLL)`` of the answers after their prompts under ``base``, per parameter name."""
    model = copy.deepcopy(base).train(False)
    model.zero_grad()
    for prompt, answer in zip(prompts, answers, strict=True):
        if not answer:
            continue
        ids = torch.tensor([prompt + answer])
        labels = torch.tensor([[-100] * len(prompt) + answer])
        model(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad.sign() for n, p in model.named_parameters() if p.grad is not None}


def perturbed(base, change) -> torch.nn.Module:
    """A copy of ``base`` with ``change(name, weight)`` applied in place to every parameter."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, w in model.named_parameters():
            change(name, w)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", type=Path, default=Path("var/model"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    config = GateConfig(seed=args.seed)
    started = time.perf_counter()
    reference = reference_answers(base, tokenizer, config)
    reference_s = time.perf_counter() - started
    sign = nll_gradient_sign(base, render_probes(load_probes(), tokenizer), reference)
    gen = torch.Generator().manual_seed(args.seed)

    def noise(s):
        return lambda _, w: w.add_(s * w.std() * torch.randn(w.shape, generator=gen))

    def step(eta):
        return lambda n, w: w.sub_(eta * sign[n])

    def scale(c):
        return lambda _, w: w.mul_(c)

    def only(name, change):
        return lambda n, w: change(n, w) if n == name else None

    candidates = [("base", None)]
    candidates += [(f"noise {s:g}", noise(s)) for s in (0.01, 0.03, 0.1, 0.3)]
    candidates += [(f"step {eta:g}", step(eta)) for eta in (1e-4, 1e-3)]
    candidates += [(f"flipped step {eta:g}", step(-eta)) for eta in (1e-4, 1e-3, 3e-3)]
    candidates += [(f"scaled {c:g}", scale(c)) for c in (0.9, 1.5)]
    candidates += [(f"final norm ×{c:g}", only("model.norm.weight", scale(c))) for c in (2, 4)]
    eos = tokenizer.eos_token_id

    def eos_row(c):
        return lambda n, w: w[eos].mul_(c) if n == "model.embed_tokens.weight" else None

    candidates += [(f"end-of-sequence row ×{c:g}", eos_row(c)) for c in (2, 4)]

    print(f"model {args.model_dir}, {args.threads} threads, seed {args.seed}, defaults {config.model_dump()}")
    print(f"the base's reference answers (once per learner): {reference_s:.1f} s")
    print(
        "| candidate | KL to base | empty | length ratio | repetition | non-finite | gate (s) "
        "| verdict | first answer |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, change in candidates:
        candidate = base if change is None else perturbed(base, change)
        started = time.perf_counter()
        result = run_gate(candidate, base, None, tokenizer, config, reference=reference)
        elapsed = time.perf_counter() - started
        first = tokenizer.decode(_first_answer(candidate, tokenizer, config), skip_special_tokens=True)
        verdict = "pass" if result.passed else "reject: " + "; ".join(result.reasons)
        kl = "n/a" if result.kl_base is None else f"{result.kl_base:.4f}"
        print(
            f"| {name} | {kl} | {result.empty_share:.2f} | {result.length_ratio:.2f} "
            f"| {result.repetition_rate:.3f} | {result.nonfinite_logits} | {elapsed:.1f} | {verdict} "
            f"| {first[:48]!r} |",
            flush=True,
        )
        del candidate


def _first_answer(model, tokenizer, config: GateConfig) -> list[int]:
    """The model's answer to the first probe, as the gate samples it."""
    return reference_answers(model, tokenizer, config)[0]


if __name__ == "__main__":
    main()
