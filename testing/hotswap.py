"""Hot-swap checks on the real engine: the learner's recomputation of the served logprobs
(``learner_logprobs``), the bound they must meet per precision pair (``LOGPROB_BOUND``) and a
perturbed copy of the model to swap to (``perturb_model``)."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from learner.data.batch import policy_logprobs
from learner.models.precision import MasterWeights, prepare_compute

# Largest |served − learner| log-probability of a token (nats) on the same weights, per (serving
# dtype, learner precision). Measured by bench/bench_serving_precision.py over 1,507–1,536 tokens
# of 32 answers per pair (docs/precision.md, "Serving in bf16"); a stale LM head gives > 1 nat.
LOGPROB_BOUND = {
    # Measured max 4.3e-5 (p99 2.5e-5). 1e-3, not 2 × 4.3e-5: float32 rounding between vLLM's
    # kernels and torch's grows with the logits, and the perturbed version's are not the measured
    # ones. 1e-3 is still 0.161 / 1e-3 = 161× under the bf16 pairs' p99, so an engine serving bf16
    # by mistake (mean gap 0.04) would fail it.
    ("float32", "float32"): 1e-3,
    ("float32", "bf16"): 0.75,  # measured max 0.368 (p99 0.165): 2 × 0.368 = 0.736, rounded up
    ("bfloat16", "float32"): 0.8,  # measured max 0.392 (p99 0.161): 2 × 0.392 = 0.784, rounded up
    ("bfloat16", "bf16"): 0.8,  # measured max 0.384 (p99 0.215): 2 × 0.384 = 0.768, rounded up
}


def learner_logprobs(model_dir, prompt_ids, response_ids, temperature, precision):
    """The learner's recomputation (``learner.data.batch.policy_logprobs``) of each response token's
    log-probability, its policy in float32 or, for ``bf16``, cast as the bf16 learner casts it
    (``MasterWeights``: bf16 parameters, float32 buffers; ``prepare_compute``: grouped attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if precision == "bf16":
        MasterWeights(model)
        prepare_compute(model, bf16=True, compiled=False)
    ids = torch.tensor([prompt_ids + response_ids])
    positions = torch.zeros_like(ids)
    positions[0, len(prompt_ids) :] = 1
    with torch.no_grad():
        lp = policy_logprobs(model, ids, torch.ones_like(ids), torch.tensor([temperature]), positions)
    return lp[0, len(prompt_ids) :].tolist()


def perturb_model(model_dir, out):
    """A copy of the model in ``out`` with every weight scaled by 1 + 5 % Gaussian noise (seed 1);
    returns ``out``."""
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    noisy = {
        k: (v.float() * (1 + 0.05 * torch.randn(v.shape, generator=gen))).to(v.dtype)
        for k, v in weights.items()
    }
    assert "model.embed_tokens.weight" in noisy  # tied: the LM head is the embedding
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out
