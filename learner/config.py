"""The settings of one learner run: one typed, validated config (pydantic), and named presets.

Everything a learner run reads is declared here once, with its bounds and meaning: the CLI maps
its options onto ``LearnerConfig`` (``saoserve learn --preset NAME`` plus overrides, or
``--config FILE.json``) and a spawned learner process receives it as JSON.

``algorithm`` is discriminated by ``name``: ``sao`` (critic + token GAE + DIS, SAO §2),
``running_mean`` (the SAO §3.4 comparison baseline with the DIS loss) or ``spo`` (SPO++,
papers 000/002); each model carries only its own fields, and ``implementation`` names the module
and class that runs it (``learner.algorithm.build_algorithm``), so a new algorithm is a model
here plus its module. ``correction`` is the off-policy correction of the policy loss
(papers/004, DESIGN §5.5).

Presets (``PRESETS``): ``paper`` (the papers' numbers: SAO §3 setup, papers/003 §三(一)),
``cpu`` (the defaults of ``saoserve learn`` for the 135M model on CPU; the model defaults here)
and ``demo`` (``saoserve demo``/``compare``: batch 16, policy lr 1e-4, critic lr 2e-4, AdamW
β1 0.5, KL anchor 0.1; measured in docs/demo.md). A preset's algorithm fields apply to the
chosen algorithm where it has them (``demo`` with ``spo`` takes its batch and learning rate but
has no KL anchor to set).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_MODEL = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class _DISLoss(BaseModel):
    """Fields shared by the algorithms whose policy loss is SAO's DIS (sao, running_mean)."""

    model_config = _MODEL

    eps_low: float = Field(0.3, ge=0.0, le=1.0)
    """DIS lower bound ε_l: a token with ratio ≤ 1 − ε_l is masked (0.3, math/TIR preset)."""
    eps_high: float = Field(5.0, ge=0.0)
    """DIS upper bound ε_h: a token with ratio ≥ 1 + ε_h is masked (5.0, math/TIR preset)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL anchor to the base policy (0 = off, the paper). With it the learner
    also holds the base model (+540 MB for 135M, one more forward pass per step)."""


class SAOAlgorithm(_DISLoss):
    """SAO: critic with frozen attention, K critic updates, skip-observation token GAE, DIS."""

    implementation: ClassVar[str] = "learner.sao:SAOLearner"
    name: Literal["sao"] = "sao"
    """Discriminator."""
    critic_lr: float = Field(1e-4, ge=0.0)
    """Critic AdamW learning rate after warm-up (CPU preset 1e-4; paper 5e-6)."""
    critic_updates: int = Field(2, ge=1)
    """K, critic optimizer steps per policy step, done before the advantages (2)."""
    critic_warmup_steps: int = Field(10, ge=0)
    """Linear warm-up of the critic learning rate over this many learner steps (10)."""
    critic_trainable: Literal["mlp", "all"] = "mlp"
    """Critic parameters trained: mlp (frozen attention and embeddings, SAO) or all (ablation)."""
    gae_mode: Literal["token", "step_mean", "step_last"] = "token"
    """Advantage estimator: token GAE (SAO) or the step-level ablations (appendix A.1)."""
    lambda_alpha: float = Field(1.5, gt=0.0)
    """α of the length-adaptive λ_policy = 1 − 1/(α·L) (1.5)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount per action token (1.0)."""
    value_range: tuple[float, float] | None = (0.0, 1.0)
    """(low, high) the values fed to GAE are clamped to (the returns' range; None: no clamp)."""

    @model_validator(mode="after")
    def _increasing_range(self) -> SAOAlgorithm:
        if self.value_range is not None and not self.value_range[0] < self.value_range[1]:
            raise ValueError(f"value_range must be (low, high) with low < high, got {self.value_range}")
        return self


class RunningMeanAlgorithm(_DISLoss):
    """The SAO §3.4 comparison: A = R − mean of the prompt's last rewards; DIS loss; no critic."""

    implementation: ClassVar[str] = "learner.sao:SAOLearner"
    name: Literal["running_mean"] = "running_mean"
    """Discriminator."""
    running_mean_window: int = Field(8, ge=1)
    """Rewards per prompt in the running mean (8)."""


class SPOAlgorithm(BaseModel):
    """SPO++: A = R − v̂ frozen at dispatch, action-token-measure normalisation, PPO objective."""

    model_config = _MODEL
    implementation: ClassVar[str] = "learner.spo:SPOLearner"
    name: Literal["spo"] = "spo"
    """Discriminator."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip below 1 (0.2)."""
    clip_high: float = Field(0.28, ge=0.0)
    """PPO clip above 1 (0.28)."""
    rollout_is_cap: float = Field(2.0, ge=1.0)
    """Truncation of the rollout importance ratio π_old/μ (2)."""
    dual_clip: float = Field(2.0, ge=1.0)
    """Dual clip c on negative advantages (2; SPO used 10)."""
    normalize: Literal["token", "trajectory"] = "token"
    """Advantage normalisation: action-token measure (SPO++) or trajectory whitening (ablation)."""


AlgorithmConfig = Annotated[SAOAlgorithm | RunningMeanAlgorithm | SPOAlgorithm, Field(discriminator="name")]


class DISCorrection(BaseModel):
    """SAO's DIS: one ratio πθ/μ against the logged behaviour logprobs, no old policy, one
    policy update per batch (``learner.dis``)."""

    model_config = _MODEL
    kind: Literal["dis"] = "dis"
    """Discriminator."""


class _MISCorrection(BaseModel):
    """The MIS loss with an old policy π_old (papers/004 §4; ``learner.mis``)."""

    model_config = _MODEL
    window: int = Field(3, ge=1)
    """W, the staleness window (versions): the paper's maximum version gap (3, §6.1)."""
    c: float = Field(2.0, ge=1.0)
    """Discrepancy bound: a token is masked unless 1/c ≤ r_d = π_old/μ ≤ c. Not given in the
    write-up; 2 is a choice of this project."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """Drift bound for A < 0: masked unless r_s = πθ/π_old ≥ 1 − clip_low (PPO's ε, 0.2)."""
    clip_high: float = Field(0.28, ge=0.0)
    """Drift bound for A ≥ 0: masked unless r_s ≤ 1 + clip_high (0.28, as SPO++'s clip)."""
    dual_clip: float = Field(3.0, gt=1.0)
    """Dual clip for A < 0: masked when r_s > dual_clip (not in papers/004; verl's clip_ratio_c
    = 3), which bounds every kept weight πθ/μ by c · dual_clip (``learner.mis``)."""
    epochs: int = Field(1, ge=1)
    """Passes over each batch (PPO epochs); more than one update per batch makes r_s ≠ 1."""
    minibatches: int = Field(1, ge=1)
    """Policy updates per epoch, each on a contiguous 1/minibatches of the batch's rows."""


class MISSnapshotCorrection(_MISCorrection):
    """Exact π_old per token from CPU snapshots of the last W + 1 versions (papers/004 §5.1);
    samples with a token more than W versions old are dropped and counted."""

    kind: Literal["mis_snapshot"] = "mis_snapshot"
    """Discriminator."""


class MISEWMACorrection(_MISCorrection):
    """π_old replaced by the revised PPO-EWMA proxy θ_prox ← (β θ_prox + θ)/(β + 1), β = W/(W+2),
    with the hard reset θ_prox ← θ when ρ_t < τ (papers/004 §5.2)."""

    kind: Literal["mis_ewma"] = "mis_ewma"
    """Discriminator."""
    reset: bool = True
    """Apply the reset rule (off: the vanilla EWMA whose mask ratio collapses late, Figure 4)."""
    tau: float = Field(0.9, ge=0.0, le=1.0)
    """Reset threshold τ on the active-token fraction ρ_t (0.9, Appendix F)."""


Correction = Annotated[DISCorrection | MISSnapshotCorrection | MISEWMACorrection, Field(discriminator="kind")]
CORRECTION_MODELS = {
    "dis": DISCorrection,
    "mis_snapshot": MISSnapshotCorrection,
    "mis_ewma": MISEWMACorrection,
}


class LearnerConfig(BaseModel):
    """Settings of one learner run (``saoserve learn``); the defaults are the ``cpu`` preset.

    Learning rates: the paper's 1e-6 / 5e-6 are for a 30B model with batch 128 over thousands
    of steps; the 135M model on CPU moves within a demo's few hundred steps only at larger
    rates (presets ``cpu`` and ``demo``).
    """

    model_config = _MODEL

    algorithm: AlgorithmConfig = Field(default_factory=SAOAlgorithm)
    """The estimator and loss, discriminated by ``name`` (sao, running_mean, spo)."""
    correction: Correction = Field(default_factory=DISCorrection)
    """The off-policy correction of the policy loss (papers/004; ``dis``: SAO's, the default)."""
    batch_size: int = Field(8, ge=1)
    """Samples (one rollout per prompt) per learner step."""
    policy_lr: float = Field(5e-5, ge=0.0)
    """Policy AdamW learning rate (CPU preset 5e-5; paper 1e-6)."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW first-moment decay for every model (momentum memory ≈ 1/(1 − β1) steps)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay (0: decay would pull pretrained weights to zero)."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max global L2 gradient norm per model."""
    autocast_bf16: bool = False
    """Run forward/backward under bf16 autocast (master weights stay float32)."""
    chunk_tokens: int = Field(512, ge=1)
    """Tokens per LM-head chunk when computing log-probabilities (memory ≈ chunk · V · 12 bytes)."""
    expire_s: float = Field(900.0, ge=1.0)
    """Seconds a trajectory waits for its feedback before it is dropped."""
    poll_s: float = Field(0.5, gt=0.0)
    """Seconds between polls of the log when there is nothing to do."""
    checkpoint_every: int = Field(10, ge=1)
    """Write ``checkpoint.pt`` every this many steps."""
    keep_versions: int = Field(4, ge=0)
    """Version directories kept on disk (0: keep all)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many steps (None: run until stopped)."""

    @model_validator(mode="after")
    def _correction_fits(self) -> LearnerConfig:
        if self.correction.kind != "dis" and not isinstance(self.algorithm, _DISLoss):
            raise ValueError(
                f"the {self.correction.kind} correction applies to the sao and running_mean "
                f"algorithms, not {self.algorithm.name}"
            )
        return self

    def to_json(self) -> str:
        """The config as JSON (what a spawned ``saoserve learn --config`` reads)."""
        return self.model_dump_json(indent=1)


ALGORITHM_MODELS = {"sao": SAOAlgorithm, "running_mean": RunningMeanAlgorithm, "spo": SPOAlgorithm}


def _merge(kind: str, key: str, models: dict, base: dict, choice: str | None, extra: dict) -> dict:
    """The ``kind`` section (algorithm or correction): ``base``'s fields the chosen model has
    (its discriminator ``key`` set to ``choice`` or kept), then ``extra``, each of which must
    be a field of that model."""
    name = choice or base.get(key, next(iter(models)))
    if name not in models:
        raise ConfigError(f"unknown {kind} {name!r}: choose {', '.join(models)}")
    fields = set(models[name].model_fields)
    alien = sorted(set(extra) - fields)
    if alien:
        raise ConfigError(f"{', '.join(alien)} does not apply to the {name} {kind}")
    return {k: v for k, v in base.items() if k in fields} | {key: name} | extra


PRESETS: dict[str, dict[str, Any]] = {
    # SAO §3 setup (papers/003 §三(一)): batch 128, policy 1e-6, critic 5e-6 (10-step warm-up).
    "paper": {"batch_size": 128, "policy_lr": 1e-6, "algorithm": {"critic_lr": 5e-6}},
    "cpu": {},
    # saoserve demo/compare (docs/demo.md).
    "demo": {
        "batch_size": 16,
        "policy_lr": 1e-4,
        "adam_beta1": 0.5,
        "algorithm": {"critic_lr": 2e-4, "kl_coef": 0.1},
    },
}
"""Named presets: overrides of the model defaults (which are the ``cpu`` preset)."""


class ConfigError(ValueError):
    """A learner config that cannot be built; the message names each bad field."""


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "union_tag_invalid":
            tag = err["ctx"]["tag"]
            field = "algorithm" if loc.startswith("algorithm") else "correction"
            parts.append(f"unknown {field} {tag!r}: choose {err['ctx']['expected_tags']}")
        else:
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def build_config(
    preset: str = "cpu",
    algorithm: str | None = None,
    overrides: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
    correction: str | None = None,
) -> LearnerConfig:
    """A validated ``LearnerConfig``: ``base`` (e.g. a JSON file) or the named preset, then the
    ``algorithm`` and ``correction`` choices and ``overrides``.

    Args:
        preset: a key of ``PRESETS`` (ignored when ``base`` is given).
        algorithm: the algorithm's name; None keeps the base's (``sao`` by default).
        overrides: top-level fields, and ``algorithm``/``correction`` as dicts of their fields.
            An override naming a field the chosen algorithm (correction) does not have is an
            error; the base's such fields are dropped.
        correction: the correction's kind; None keeps the base's (``dis`` by default).

    Raises:
        ConfigError: unknown preset, algorithm or correction, a field the algorithm or
            correction lacks, a value out of bounds; the message names the field.
    """
    if base is None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}: choose {', '.join(PRESETS)}")
        base = json.loads(json.dumps(PRESETS[preset]))
    data = dict(base)
    overrides = dict(overrides or {})
    data["algorithm"] = _merge(
        "algorithm",
        "name",
        ALGORITHM_MODELS,
        dict(data.get("algorithm") or {}),
        algorithm,
        overrides.pop("algorithm", None) or {},
    )
    data["correction"] = _merge(
        "correction",
        "kind",
        CORRECTION_MODELS,
        dict(data.get("correction") or {}),
        correction,
        overrides.pop("correction", None) or {},
    )
    data |= overrides
    try:
        return LearnerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def load_config(
    path: Path,
    algorithm: str | None = None,
    overrides: dict[str, Any] | None = None,
    correction: str | None = None,
) -> LearnerConfig:
    """``build_config`` on a JSON file (e.g. written by ``LearnerConfig.to_json``).

    Raises ConfigError: unreadable or invalid JSON, or an invalid config.
    """
    try:
        base = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the config {path}: {exc}") from None
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: a config is a JSON object")
    return build_config(algorithm=algorithm, overrides=overrides, base=base, correction=correction)
