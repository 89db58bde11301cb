"""The settings of one learner run: one typed, validated config (pydantic), and named presets.

Everything a learner run reads is declared here once, with its bounds and meaning: the CLI maps
its options onto ``LearnerConfig`` (``saoserve learn --preset NAME`` plus overrides, or
``--config FILE.json``) and a spawned learner process receives it as JSON.

Validation happens here and only here: a learner is built from a ``LearnerConfig`` and reads
its fields without checking them again.

``algorithm`` is discriminated by ``name``: ``sao`` (critic + token GAE + DIS, SAO §2),
``running_mean`` (the SAO §3.4 comparison baseline with the DIS loss) or ``spo`` (SPO++,
papers 000/002); each model carries only its own fields, and ``learner.algo.registry.ALGORITHMS``
maps each model to the class that runs it, so a new algorithm is a model here, its class and
one registry entry. ``optimizer`` holds the AdamW settings every algorithm shares.
``correction`` is the off-policy correction of the policy loss (papers/004, docs/design.md §5.5).
``policy`` says what the learner trains: every weight (``full``) or a LoRA adapter on the frozen
base model (``lora``, ``learner.models.lora``, docs/lora.md).

Presets (``PRESETS``): ``paper`` (the papers' numbers: SAO §3 setup, papers/003 §三(一)),
``cpu`` (the defaults of ``saoserve learn`` for the 135M model on CPU; the model defaults here)
and ``demo`` (``saoserve demo``/``compare``: the bf16 learner where the CPU has bf16 units
(``core.hardware``), float32 where it has not; batch 16, policy lr 1e-4, critic
lr 2e-4, AdamW β1 0.5, KL anchor 0.04; measured in docs/log/2026-12-05-demo-runs.md). A preset's algorithm fields apply to the
chosen algorithm where it has them (``demo`` with ``spo`` takes its batch and learning rate but
has no KL anchor to set).
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.hardware import bf16_native
from learner.faults import BrokenLearner
from learner.guard.guard_config import GuardConfig

# allow_inf_nan: no learner setting is meaningful at ±inf or nan (a poll of inf seconds, an
# infinite time-out); a time-out that never fires is None.
_MODEL = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)


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

    @property
    def has_kl_anchor(self) -> bool:
        """Whether the policy loss has the KL anchor term (``kl_coef > 0``): the one place that
        decides it; the learner then loads the reference policy (``learner.algo.kl.KLAnchor``)."""
        return self.kl_coef > 0


class SAOAlgorithm(_DISLoss):
    """SAO: critic with frozen attention, K critic updates, skip-observation token GAE, DIS."""

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
    advantage_values: Literal["after_updates", "before_updates"] = "after_updates"
    """Critic values GAE scores the batch with: after its K updates on the batch (SAO §2.2) or
    from before them (ablation: a critic that has not seen the batch's rewards; docs/design.md
    §5.2)."""

    @model_validator(mode="after")
    def _increasing_range(self) -> SAOAlgorithm:
        if self.value_range is not None and not self.value_range[0] < self.value_range[1]:
            raise ValueError(f"value_range must be (low, high) with low < high, got {self.value_range}")
        return self


class RunningMeanAlgorithm(_DISLoss):
    """The SAO §3.4 comparison: A = R − mean of the prompt's last rewards; DIS loss; no critic."""

    name: Literal["running_mean"] = "running_mean"
    """Discriminator."""
    running_mean_window: int = Field(8, ge=1)
    """Rewards per prompt in the running mean (8)."""


class SPOAlgorithm(BaseModel):
    """SPO++: A = R − v̂ frozen at dispatch, action-token-measure normalisation, PPO objective."""

    model_config = _MODEL
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


class OptimizerConfig(BaseModel):
    """AdamW on float32 master weights (``learner.models.optim``), for every algorithm's policy; SAO's
    critic uses the same β1, weight decay and clip with its own learning rate
    (``SAOAlgorithm.critic_lr``)."""

    model_config = _MODEL
    policy_lr: float = Field(5e-5, ge=0.0)
    """Policy AdamW learning rate (CPU preset 5e-5; paper 1e-6)."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW first-moment decay for every model (momentum memory ≈ 1/(1 − β1) steps)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay (0: decay would pull pretrained weights to zero)."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max global L2 gradient norm per model."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven projections of a Llama-family decoder layer a LoRA adapter may target."""
LORA_LR_FACTOR = 10.0
"""A LoRA policy's default learning rate over the full fine-tuning one (``optimizer.policy_lr``):
"LoRA Without Regret" (Schulman et al., 2025) found the best LoRA rate about 10x the full one."""


class FullPolicy(BaseModel):
    """Full fine-tuning: every policy weight is trained and each version publishes them all."""

    model_config = _MODEL
    kind: Literal["full"] = "full"
    """Discriminator."""


class LoraPolicy(BaseModel):
    """A LoRA adapter ``W + (alpha/rank)·B·A`` on the frozen base model (``learner.models.lora``): only A
    and B are trained and each version publishes the adapter in PEFT's layout (docs/lora.md)."""

    model_config = _MODEL
    kind: Literal["lora"] = "lora"
    """Discriminator."""
    rank: int = Field(8, ge=1, le=256)
    """r, the inner dimension of B·A (8; rank 1 matches full fine-tuning in RL, "LoRA Without
    Regret"). The serving engine's ``max_lora_rank`` must be at least this."""
    alpha: float = Field(32.0, gt=0.0)
    """α: the update is scaled by α/r (32, as "LoRA Without Regret", which keeps the best learning
    rate nearly independent of the rank)."""
    target_modules: tuple[Literal[LORA_TARGETS], ...] = Field(LORA_TARGETS, min_length=1)  # type: ignore[valid-type]
    """Projections of every decoder layer that get an adapter (all seven by default; the paper
    found attention-only adapters worse)."""
    dropout: float = Field(0.0, ge=0.0, le=0.0)
    """LoRA dropout; only 0: the learner computes in eval mode so that its log-probabilities match
    the server's, where dropout never applies."""
    lr: float | None = Field(None, gt=0.0)
    """The adapter's AdamW learning rate (None: ``LORA_LR_FACTOR`` × ``optimizer.policy_lr``);
    with ``b_lr_ratio`` it is A's rate."""
    rslora: bool = False
    """rsLoRA (Kalajdzievski, 2023): scale the update by α/√r instead of α/r, so its size does not
    shrink as the rank grows (PEFT's ``use_rslora``; written to ``adapter_config.json``, which the
    servers honour)."""
    b_lr_ratio: float = Field(1.0, gt=0.0)
    """LoRA+ (Hayou, Ghosh and Yu, 2024): B's learning rate over A's (``lr``); 1 is plain LoRA, the
    paper's λ is about 16. B starts at 0, so with one rate B·A grows slowly from the start."""

    def changes_from(self, saved: LoraPolicy) -> str | None:
        """What this config changes of ``saved`` (the settings an adapter, a checkpoint or an
        optimizer state was made under) so that loading it would not resume it, as
        ``"alpha 32.0 → 16.0"`` (joined by ", "), or None. The rank, α and rsLoRA set the update
        ``scale·B·A`` that the same A and B compute (a changed α or scaling rule silently rescales
        a loaded adapter); ``b_lr_ratio`` 1 or not sets the optimizer's parameter groups (one, or
        A's and B's). A ratio changed between two values other than 1 is only a new rate: the
        learner takes its rates from the config."""
        changes = [
            f"{name} {getattr(saved, name)} → {getattr(self, name)}"
            for name in ("rank", "alpha", "rslora")
            if getattr(saved, name) != getattr(self, name)
        ]
        if (saved.b_lr_ratio == 1.0) != (self.b_lr_ratio == 1.0):
            changes.append(f"b_lr_ratio {saved.b_lr_ratio} → {self.b_lr_ratio}")
        return ", ".join(changes) or None

    @model_validator(mode="after")
    def _distinct_targets(self) -> LoraPolicy:
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"target_modules names a projection twice: {list(self.target_modules)}")
        return self


class Device(enum.StrEnum):
    """Where the learner's models, optimiser states and batches live (``learner.models.device``)."""

    AUTO = "auto"
    """A CUDA GPU where one is visible, else the CPU."""
    CPU = "cpu"
    """The CPU, even where a GPU is visible."""
    CUDA = "cuda"
    """A CUDA GPU (with N ranks, rank r takes GPU r of its host); refused where none is visible."""


PolicyConfig = Annotated[FullPolicy | LoraPolicy, Field(discriminator="kind")]


AlgorithmConfig = Annotated[SAOAlgorithm | RunningMeanAlgorithm | SPOAlgorithm, Field(discriminator="name")]


class DISCorrection(BaseModel):
    """SAO's DIS: one ratio πθ/μ against the logged behaviour logprobs, no old policy, one
    policy update per batch (``learner.algo.dis``)."""

    model_config = _MODEL
    kind: Literal["dis"] = "dis"
    """Discriminator."""


class _MISCorrection(BaseModel):
    """The MIS loss with an old policy π_old (papers/004 §4; ``learner.algo.mis``)."""

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
    = 3), which bounds every kept weight πθ/μ by c · dual_clip (``learner.algo.mis``)."""
    epochs: int = Field(1, ge=1)
    """Passes over each batch (PPO epochs); more than one update per batch makes r_s ≠ 1."""
    minibatches: int = Field(1, ge=1)
    """Policy updates per epoch, each on a contiguous 1/minibatches of the batch's rows."""


class MISSnapshotCorrection(_MISCorrection):
    """Exact π_old per token from snapshots (on the learner's device) of the last W + 1 versions (papers/004 §5.1);
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
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """AdamW settings (policy learning rate, β1, weight decay, gradient clip)."""
    policy: PolicyConfig = Field(default_factory=FullPolicy)
    """What the learner trains: every weight (``full``) or a LoRA adapter (``lora``)."""
    batch_size: int = Field(8, ge=1)
    """Samples (one rollout per prompt) per learner step."""
    device: Device = Device.AUTO
    """Where the policy, critic, KL reference, π_old copies and optimiser states live
    (``learner.models.device.resolve``): ``auto`` takes a CUDA GPU where one is visible. On a device with
    fast bf16 (CUDA with bf16 support) the presets compute in bf16 (``build_config``); on the
    CPU the rule of ``core.hardware`` stays. A learner under ``torchrun`` shards its models over
    the ranks (``learner.distributed``, docs/scaling.md)."""
    max_identity_share: float | None = Field(None, gt=0.0, le=1.0)
    """The most of a batch one identity (API key, else ``user`` field) may contribute: at most
    max(1, ⌊share·batch_size⌋) samples; the rest wait for later batches (``learner.data.identity_cap``,
    docs/tenants.md). E.g. 0.25: one key moves at most a quarter of each step, and a batch needs
    samples of 4 identities (anonymous samples, and those of a trusted key, ``saoserve admin keys
    trust``, each count as one). The guard's votes have their own cap, on by default for API
    keys (``GuardConfig.vote_identity_share``). None (the default): no cap, because a cap with
    fewer identities than 1/share in the traffic stops training, where a vote cap that cannot
    fill its windows only holds a verdict back."""
    autocast_bf16: bool = False
    """Run forward/backward under bf16 autocast (master weights stay float32)."""
    bf16: bool = False
    """bf16 models with float32 master weights and AdamW states, attention as batched matmuls
    (``learner.models.precision``, ``learner.models.attention``): the step on AMX-BF16 (docs/precision.md).
    Not together with ``autocast_bf16``."""
    compile_layers: bool = False
    """Compile the models' decoder layers with ``torch.compile`` (``learner.models.fused``); the first
    step compiles (about a minute on 2 cores)."""
    chunk_tokens: int = Field(512, ge=1)
    """Tokens per LM-head chunk when computing log-probabilities (memory ≈ chunk · V · 12 bytes)."""
    expire_s: float = Field(900.0, ge=1.0)
    """Seconds a trajectory waits for its feedback before it is dropped."""
    poll_s: float = Field(0.1, gt=0.0)
    """Seconds between polls of the log when there is nothing to do: part of the wait from the
    feedback that fills a batch to its step (each poll also waits up to 0.05 s per partition)."""
    checkpoint_every: int = Field(10, ge=1)
    """Write ``checkpoint.pt`` every this many steps."""
    keep_versions: int = Field(4, ge=0)
    """Version directories kept on disk (0: keep all)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many steps (None: run until stopped)."""
    guard: GuardConfig = Field(default_factory=GuardConfig)
    """The gate and the decision rule of the version lifecycle (docs/guard.md)."""
    broken_learner: BrokenLearner | None = None
    """FAULT INJECTION (``BrokenLearner``): a sign-flipped or scaled policy update, for measuring
    the guard. None, the default: the learner is correct."""

    @model_validator(mode="after")
    def _one_precision(self) -> LearnerConfig:
        if self.bf16 and self.autocast_bf16:
            raise ValueError("bf16 and autocast_bf16 exclude each other: choose one")
        return self

    @model_validator(mode="after")
    def _correction_fits(self) -> LearnerConfig:
        if self.correction.kind != "dis" and not isinstance(self.algorithm, _DISLoss):
            raise ValueError(
                f"the {self.correction.kind} correction applies to the sao and running_mean "
                f"algorithms, not {self.algorithm.name}"
            )
        return self

    @model_validator(mode="after")
    def _fault_fits(self) -> LearnerConfig:
        if self.broken_learner is not None and not isinstance(self.algorithm, _DISLoss):
            # The fault is applied in learner.algo.sao (SAOLearner.policy_step and its optimizer).
            raise ValueError(
                f"broken_learner applies to the sao and running_mean algorithms, not {self.algorithm.name}"
            )
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> LearnerConfig:
        if isinstance(self.policy, LoraPolicy) and self.correction.kind == "mis_ewma":
            # The proxy averages parameters; the average of two adapters' factors A and B is not
            # the average of their updates B·A.
            raise ValueError("the mis_ewma correction averages weights and does not apply to a lora policy")
        return self

    @property
    def policy_lr(self) -> float:
        """The policy optimizer's learning rate: ``optimizer.policy_lr``, or with a LoRA policy its
        ``lr`` (default ``LORA_LR_FACTOR`` × ``optimizer.policy_lr``); times ``broken_learner``'s
        ``lr_factor`` when that fault is injected."""
        if isinstance(self.policy, LoraPolicy):
            lr = self.policy.lr if self.policy.lr is not None else LORA_LR_FACTOR * self.optimizer.policy_lr
        else:
            lr = self.optimizer.policy_lr
        return lr * self.broken_learner.lr_factor if self.broken_learner is not None else lr

    @property
    def has_kl_anchor(self) -> bool:
        """Whether the policy loss has the KL anchor (``algorithm.has_kl_anchor``: sao or
        running_mean with ``kl_coef > 0``; SPO++ has none), so the learner can measure a
        policy's KL to the base (its steps' ``kl_ref``, the guard's drift veto)."""
        return isinstance(self.algorithm, _DISLoss) and self.algorithm.has_kl_anchor

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
    "paper": {"batch_size": 128, "optimizer": {"policy_lr": 1e-6}, "algorithm": {"critic_lr": 5e-6}},
    "cpu": {},
    # saoserve demo/compare, the values their options default to (measured in docs/log/2026-12-05-demo-runs.md): at
    # batch 8 one or two rewarded answers a step carried too little signal to follow a switch;
    # without the KL anchor answer quality fell within a few steps of a switch; a policy lr of
    # 2e-4 collapsed the text; AdamW's usual β1 0.9 kept pushing the old style after a switch.
    # bf16 took the demo-shaped step at batch 16 from 38 s to 12 s where the CPU has bf16 units;
    # without them (AVX2 only) a bf16 matmul is hundreds of times slower than float32, so the
    # preset follows the CPU (core.hardware). Compiled layers did not make the step faster (the
    # shared prefix's cached pass recompiles them) and cost a compile first. The anchor's weight:
    # both the DIS loss and the k3 term are token means, so a sequence pays kl_coef × its whole
    # KL (48 tokens × the per-token KL); at 0.1 that cost met the reward's gain near a target
    # share of 0.4, the report's threshold, and the share stalled there; 0.04 is GRPO's weight.
    "demo": {
        "bf16": bf16_native(),
        "batch_size": 16,
        "optimizer": {"policy_lr": 1e-4, "adam_beta1": 0.5},
        "algorithm": {"critic_lr": 2e-4, "kl_coef": 0.04},
    },
}
"""Named presets: overrides of the model defaults (which are the ``cpu`` preset)."""

SECTIONS = ("algorithm", "correction", "optimizer", "guard", "policy")
"""The nested models of ``LearnerConfig``, merged field by field by ``overlay``."""


def overlay(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a preset or a config as a dict) with ``fields`` laid over it: top-level fields
    replaced, each of ``SECTIONS`` merged field by field. Returns a new dict (neither argument is
    modified); nothing is validated here (``build_config`` does)."""
    out = dict(base) | {k: v for k, v in fields.items() if k not in SECTIONS}
    for key in SECTIONS:
        if key in fields:
            prior, given = dict(base.get(key) or {}), dict(fields[key] or {})
            if not given and key not in base:
                continue  # nothing set: the model's default, not an empty section
            if key == "policy" and "kind" in prior and given.get("kind", prior["kind"]) != prior["kind"]:
                prior = {}  # another kind of policy: the base's fields (a rank) are not its own
            out[key] = prior | given
    return out


class ConfigError(ValueError):
    """A learner config that cannot be built; the message names each bad field."""


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "union_tag_invalid":
            tag = err["ctx"]["tag"]
            field = loc.split(".")[0]
            parts.append(f"unknown {field} {tag!r}: choose {err['ctx']['expected_tags']}")
        else:
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _fast_bf16_device(device: Any) -> bool:
    """Whether the learner's device (a ``Device`` value, None for the default ``auto``) is a CUDA
    GPU with bf16 support: there the presets train in bf16 (the CPU presets' rule,
    ``core.hardware``, is the ``demo`` preset's own). An unknown value is left to the validation."""
    from core.hardware import cuda_bf16

    try:
        setting = Device(device if device is not None else Device.AUTO)
    except ValueError:
        return False
    return setting != Device.CPU and cuda_bf16()


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
        overrides: top-level fields, and ``algorithm``/``correction``/``optimizer`` as dicts
            of their fields (laid over the base's, ``overlay``). An override naming a field the
            chosen algorithm (correction) does not have is an error; the base's such fields are
            dropped.
        correction: the correction's kind; None keeps the base's (``dis`` by default).

    Where the device (``device``, ``auto`` by default) is a CUDA GPU with bf16 support, ``bf16``
    is set unless ``overrides`` set it or the config computes under ``autocast_bf16``.

    Raises:
        ConfigError: unknown preset, algorithm or correction, a field the algorithm or
            correction lacks, a value out of bounds; the message names the field.
    """
    if base is None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}: choose {', '.join(PRESETS)}")
        base = json.loads(json.dumps(PRESETS[preset]))
    overrides = dict(overrides or {})
    chosen = {"algorithm": overrides.pop("algorithm", None), "correction": overrides.pop("correction", None)}
    data = overlay(base, overrides)
    if "bf16" not in overrides and not data.get("autocast_bf16") and _fast_bf16_device(data.get("device")):
        data["bf16"] = True
    for kind, key, models, choice in (
        ("algorithm", "name", ALGORITHM_MODELS, algorithm),
        ("correction", "kind", CORRECTION_MODELS, correction),
    ):
        data[kind] = _merge(kind, key, models, dict(data.get(kind) or {}), choice, chosen[kind] or {})
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
    return build_config(
        algorithm=algorithm, overrides=overrides, base=read_config(path), correction=correction
    )


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``: a config, or some of its fields (not validated here).

    Raises ConfigError: the file cannot be read, is not JSON, is not a JSON object, or one of
    its ``SECTIONS`` is neither an object nor null.
    """
    try:
        base = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the config {path}: {exc}") from None
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: a config is a JSON object")
    for key in SECTIONS:
        if base.get(key) is not None and not isinstance(base[key], dict):
            raise ConfigError(f"{path}: {key} is a JSON object of its fields, not {json.dumps(base[key])}")
    return base
