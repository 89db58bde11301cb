"""The guard's settings (docs/guard.md, "The lifecycle"), apart from the learner's algorithm,
correction, optimiser and policy settings (``learner.config``, which nests them as ``guard``),
and from the guard itself (``learner.guard.guard``), so that a config is read and validated without
importing torch.
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.sequential import Decision, RuleParams
from learner.guard.gate_config import GateConfig


class VoteCap(enum.StrEnum):
    """Which senders the identity cap on votes binds (``GuardConfig.vote_cap``;
    ``learner.guard.guard_votes``; docs/guard.md, "Who votes")."""

    KEYS = "keys"
    """API keys not trusted: the identities a client cannot choose once keys are required. A
    ``user`` field or an anonymous answer votes as an identity of its own (a client could set
    ``user`` to anything, or leave it out, to evade a cap anyway)."""
    IDENTITIES = "identities"
    """Every identity, API keys and ``user`` fields alike; answers without one do not vote. For
    a deployment whose raters are many and named by ``user`` (the simulation's 200 users)."""


_MODEL = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)


class GuardConfig(BaseModel):
    """The guard (docs/guard.md, "The lifecycle"): the gate each new version must pass before it
    is announced, and the decision rule that promotes or rejects the lineage on probation
    (``core.sequential``, ``core.lifecycle``). The rule's defaults are ``core.sequential``'s."""

    model_config = _MODEL
    enabled: bool = True
    """Run the lifecycle (off: no gate, every version is promoted when recorded; an operator's
    ``saoserve admin guard off`` turns it off at run time too)."""
    gate: GateConfig | None = None
    """The gate's bounds and generation settings (``learner.guard.gate``; ``{}``: its defaults);
    None: no gate, the version goes to probation unchecked. Off by default: a gate costs about
    as much as a learner step on this machine (docs/guard.md, "The gate", Cost). It holds the
    base model and the parent's weights (+540 MB each for 135M)."""
    delta: float = Field(0.05, gt=0.0, le=0.5)
    """Non-inferiority margin δ, reward units (rewards in [0, 1]). At most 0.5: a wider margin
    promotes a candidate that loses half the reward range to the promoted version, so the rule
    would promote on its first ``min_samples`` ratings whatever they are."""
    alpha: float = Field(0.05, gt=0.0, le=0.5)
    """Error rate α of each decision. At most 0.5: above it each bound is more often wrong than
    right, and a decision at that confidence is not one."""
    min_samples: int = Field(20, ge=1)
    """Rated answers each arm needs before a bound decides."""
    max_samples: int | None = Field(50_000, ge=1)
    """Time-out: the lineage's rated answers (None: never on count)."""
    max_seconds: float | None = Field(None, gt=0.0)
    """Time-out: seconds since the lineage's first version was recorded (None: never on time)."""
    on_timeout: Literal["reject", "promote"] = "reject"
    """The decision at a time-out no bound decided (reject: a lineage that cannot show it is not
    worse is not promoted)."""
    promoted_window: int = Field(2000, ge=1)
    """Rated answers of the promoted versions (the newest, from before the lineage) that form the
    probation's comparison arm."""
    check_s: float = Field(5.0, ge=0.0)
    """Seconds between two evaluations of the lineage by the learner's loop."""
    min_answer_tokens: int | None = Field(4, ge=1)
    """The health veto (docs/guard.md, "The health veto"): the lineage is rejected when its
    share of sound answers (``core.lifecycle.healthy``: cut by the budget, or ended by the model
    after at least this many tokens) is surely below the promoted versions' (the same rule on
    every answer served, rated or not). None: no veto."""
    vote_identity_share: float | None = Field(0.01, gt=0.0, le=1.0)
    """The identity cap on votes (docs/guard.md, "Who votes"; ``learner.guard.guard_votes``): in
    each arm's stream of rated (and of ended) answers, one bound sender (``vote_cap``: by
    default an API key) has at most ``max(1, ⌊share·W⌋)`` votes per window of ``W =
    max(batch_size, ⌈1/share⌉)``, so it moves each arm's mean by at most the share (Δ by at
    most ``share·(1 + |Δ|)``); a trusted key (``saoserve admin keys trust``: a backend relaying
    its users, a judge) is never bound. 0.01 kept every simulated verdict under a flooding
    attacker. A verdict on keys' ratings alone needs at least ``1/share`` keys not trusted
    rating *each arm* (with sticky arms and a canary share c, about ``1/(share·c)`` in all):
    with fewer no window fills, each counts its first ``k`` votes only and the rest are held
    back (``saoserve_guard_votes_held_back``), and neither the rule nor the health veto decides
    (``max_samples`` counts voting answers) until the operator trusts the keys that rate for
    many people. None: no cap, and one client that floods the ratings can decide a verdict."""
    vote_cap: VoteCap = VoteCap.KEYS
    """Which senders ``vote_identity_share`` binds: ``keys`` (the API keys not trusted; answers
    without a key vote as identities of their own, so the embedded default, with no keys, is
    not capped) or ``identities`` (keys and ``user`` fields; answers without either do not
    vote)."""
    max_kl_ref: float | None = Field(0.6, gt=0.0)
    """The drift veto (docs/guard.md, "The drift veto"): the lineage is rejected when one of its
    versions measured more than this KL to the base (nats per action token) beyond the promoted
    version's, on a batch it had not trained on: the KL anchor's ``kl_ref`` of the step trained
    from it, and for the newest, before the lineage is promoted, the learner's same measure on
    the next batch it would train (``core.lifecycle.drifted``). The gate's ``max_kl_base``,
    measured for free on every step; only with the anchor on (the ``demo`` preset; without it
    nothing measures the KL and the veto never fires). None: no veto."""

    @model_validator(mode="after")
    def _timeout_after_min(self) -> GuardConfig:
        if self.max_samples is not None and self.max_samples < self.min_samples:
            raise ValueError(f"max_samples ({self.max_samples}) must be >= min_samples ({self.min_samples})")
        return self

    def health_params(self) -> RuleParams:
        """The health veto's parameters: the rule's α and minimum samples, no time-out (the veto
        only ever rejects, on evidence)."""
        return RuleParams(delta=self.delta, alpha=self.alpha, min_samples=self.min_samples, max_samples=None)

    def rule_params(self) -> RuleParams:
        """The decision rule's parameters (``core.sequential.RuleParams``)."""
        return RuleParams(
            delta=self.delta,
            alpha=self.alpha,
            min_samples=self.min_samples,
            max_samples=self.max_samples,
            max_seconds=self.max_seconds,
            on_timeout=Decision(self.on_timeout),
        )
