"""The gate's settings (``learner.guard.gate``, docs/guard.md, "The gate"), apart from the gate so
that the learner's config (``learner.config``) is read and validated without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GateConfig(BaseModel):
    """The gate's bounds and its generation settings. Figures are per action token (nats) or
    shares in [0, 1]; the defaults are measured on SmolLM2-135M (docs/guard.md, The gate)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)
    max_kl_base: float = Field(0.6, gt=0.0)
    """Largest k3 estimate of KL(candidate ‖ base), nats per answer token. The learner's
    legitimate drift must fit under it (the demo runs ended at 0.006–0.37, docs/demo.md); the
    broken models measured start at 0.66 (docs/guard.md, The gate)."""
    max_kl_promoted: float = Field(0.5, gt=0.0)
    """Largest k3 estimate of KL(candidate ‖ promoted version), nats per answer token: the jump
    of one version over the one serving now (the base when no other version is promoted). A
    whole first AdamW step at learning rate 1e-4 measured 0.29–0.33."""
    max_empty_share: float = Field(0.25, ge=0.0, le=1.0)
    """Largest share of probes answered with no token before the end of sequence."""
    min_length_ratio: float = Field(0.5, ge=0.0)
    """Smallest ratio of the candidate's mean answer length to the base model's on the same
    probes with the same seed (length collapse)."""
    max_repetition_rate: float = Field(0.2, ge=0.0, le=1.0)
    """Largest share of the answers' n-grams that repeat an earlier n-gram of the same answer."""
    repetition_ngram: int = Field(4, ge=1)
    """n of the repetition rate's n-grams (tokens)."""
    min_quality: float | None = Field(None, ge=0.0, le=1.0)
    """Smallest mean quality the judge may give the answers (None: no judge is asked)."""
    sampling: Literal["sampled", "greedy"] = "sampled"
    """How the candidate answers: sampled at temperature 1 with ``seed`` (the KL figures are
    then unbiased estimates of the KL) or greedy (then they are divergences on the greedy
    path only)."""
    seed: int = 0
    """Seed of the sampled answers; the base answers with the same seed."""
    max_new_tokens: int = Field(32, ge=1)
    """Answer tokens per probe (the gate's cost grows with it; 32 takes seconds on CPU)."""
    probes: Path | None = None
    """A probe set JSON file (``ProbeSet``); None: the one shipped, ``learner/guard/probes.json``."""
