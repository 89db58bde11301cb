"""The options of the commands that run the simulation (``simulate``, ``demo``, ``compare``;
saoserve/run_commands.py): each declared once with its type, bounds and help, and what they
become: the simulation's traffic fields, its judge, schedule and adversary, the learner's
fault injection.

Each function turns a refused option into a CLI error (``saoserve.usage.fail``: one line on
stderr, exit 2) naming the option.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from core.settings import get_settings
from saoserve.usage import fail

MODE_HELP = "sync (lockstep: each step waits for the learner) | async (open loop, swaps in flight)"
RATE_HELP = "Async: requests/s (Poisson arrivals) instead of a fixed number in flight."
FEEDBACK_DELAY_HELP = "Async: mean seconds (exponential) before an answer's feedback is posted; 0 = at once."
MAX_SECONDS_HELP = "Async: stop after this many seconds even if the schedule is not done."
MAX_BACKLOG_HELP = (
    "Async: hold new requests while samples waiting for the learner plus answers on their way "
    "to feedback reach this (0 = never)."
)
PROMPT_POOL_HELP = "Cycle the first K writing requests in order (each recurs every K requests)."
PACE_HELP = (
    "Async, fixed number in flight: spread each batch's requests over the learner's step (0.9 × "
    "the median interval of the last 3 versions), so a batch completes as the learner frees up."
)

# The options that simulate, demo and compare share, declared once (type, bounds, help); each
# command gives its own default.
ScheduleOpt = Annotated[str, typer.Option(help="Named schedule (default, paper) or 'style:steps,…'.")]
StepsPerStyleOpt = Annotated[int, typer.Option(min=1, help="Steps per style for a named schedule.")]
BatchSizeOpt = Annotated[int, typer.Option(min=1, help="Requests per step (= the learner's batch size).")]
MaxTokensOpt = Annotated[int, typer.Option(min=1, help="New tokens per answer, at most.")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the prompt order, the judge's ties and sampling.")]
JudgeOpt = Annotated[str, typer.Option(help="offline | llm (SAOSERVE_JUDGE_URL/MODEL/KEY)")]
ModeOpt = Annotated[str, typer.Option(help=MODE_HELP)]
RateOpt = Annotated[float | None, typer.Option(min=0.0, help=RATE_HELP)]
FeedbackDelayOpt = Annotated[float, typer.Option(min=0.0, help=FEEDBACK_DELAY_HELP)]
MaxSecondsOpt = Annotated[float | None, typer.Option(min=1.0, help=MAX_SECONDS_HELP)]
PromptPoolOpt = Annotated[int | None, typer.Option(min=1, help=PROMPT_POOL_HELP)]
PaceOpt = Annotated[bool, typer.Option(help=PACE_HELP)]
AdversaryOpt = Annotated[
    str | None,
    typer.Option(
        help="A cohort of simulated raters that rewards a marker string instead of the judge's rubric "
        "(share=0.2,rewards=BUY-NOW[,users=200]) or degenerate answers (rewards=degenerate); "
        "docs/guard.md. Default: every rater is honest."
    ),
]


def make_adversary(spec: str | None):
    """The ``judge.adversary.Adversary`` of ``--adversary`` (None when not given).

    Exits 2 (``fail``) for a spec ``judge.adversary.parse_adversary`` refuses, naming it."""
    if spec is None:
        return None
    from judge.adversary import AdversaryError, parse_adversary

    try:
        return parse_adversary(spec)
    except AdversaryError as exc:
        fail(f"--adversary {spec!r}: {exc}")


def traffic_fields(
    mode: str,
    concurrency: int | None,
    rate: float | None,
    feedback_delay_s: float,
    max_seconds: float | None,
    max_backlog: int | None,
    prompt_pool: int | None,
    pace: bool = False,
) -> dict:
    """The ``judge.sim_config.SimulationConfig`` traffic fields of the CLI options, None left out
    (the config's default): ``rate`` in requests/s, ``feedback_delay_s`` and ``max_seconds`` in
    seconds, ``max_backlog`` in samples (0: never held).

    Exits 2 (``fail``) for an unknown mode, a rate <= 0, an async-only option with ``sync``, or
    ``pace`` without a fixed number in flight."""
    if mode not in ("sync", "async"):
        fail(f"unknown mode {mode!r}: choose sync or async")
    if rate is not None and rate <= 0:
        fail("--rate must be > 0 requests/s")
    if mode == "sync" and (rate is not None or feedback_delay_s > 0 or max_backlog):
        fail("--rate, --feedback-delay-s and --max-backlog apply to --mode async")
    if pace and (mode == "sync" or rate is not None):
        fail("--pace applies to --mode async with a fixed number in flight, not with --rate")
    fields = {
        "mode": mode,
        "concurrency": concurrency,
        "rate": rate,
        "feedback_delay_s": feedback_delay_s,
        "max_seconds": max_seconds,
        "max_backlog": max_backlog or None,
        "prompt_pool": prompt_pool,
        "pace": pace,
    }
    return {k: v for k, v in fields.items() if v is not None}


def make_judge(kind: str):
    """The judge of ``--judge``: ``offline`` (``judge.offline.OfflineJudge``, its embeddings from
    ``SAOSERVE_JUDGE_EMBEDDING_DIR`` or the shipped package) or ``llm`` (``judge.llm.LLMJudge`` at
    ``SAOSERVE_JUDGE_URL``/``MODEL``/``KEY``).

    Exits 2 (``fail``) for another kind, or ``llm`` without its URL and model."""
    if kind == "offline":
        from judge.offline import OfflineJudge

        emb = get_settings().judge_embedding_dir
        return OfflineJudge(model_path=str(emb) if emb else None)
    if kind == "llm":
        from judge.llm import LLMJudge

        s = get_settings()
        if not s.judge_url or not s.judge_model:
            fail("the LLM judge needs SAOSERVE_JUDGE_URL and SAOSERVE_JUDGE_MODEL (and SAOSERVE_JUDGE_KEY)")
        return LLMJudge(s.judge_url, s.judge_model, s.judge_key)
    fail(f"unknown judge {kind!r}: choose offline or llm")


def make_schedule(spec: str, steps_per_style: int):
    """The ``judge.styles.Schedule`` of ``--schedule`` (a name, or ``style:steps,…``) with
    ``steps_per_style`` learner steps per style of a named one.

    Exits 2 (``fail``) with ``schedule_from_spec``'s message for a spec it refuses."""
    from judge.styles import schedule_from_spec

    try:
        return schedule_from_spec(spec, steps_per_style)
    except ValueError as exc:
        fail(str(exc))


# 30 learner steps, as many as the 15 minutes of `make demo` hold on 2 cores with the demo's
# defaults (docs/log/2026-12-05-demo-runs.md, eleventh session); 22 of them after the switch, where the earlier
# 16 left the crossing at the threshold's edge.
DEMO_SCHEDULE = "pirate:8,poetic:22"
# Async traffic of demo/compare: 8 requests in flight, and new requests held while two batches
# of samples wait for the learner or are on their way (staleness 1 after the first step). Not
# paced by default: on 2 shared cores, pacing (judge.pacing.pace_gap) kept vLLM serving through
# every learner step, the two contended and the learner's step doubled; bursts let the learner
# run alone for most of a step. Three batches trained on 2-versions-old tokens at every step, and
# an uncapped rate outran the learner (measurements in docs/log/2026-12-05-demo-runs.md).
DEMO_CONCURRENCY = 8
DEMO_BACKLOG_BATCHES = 2

# The learner and traffic options of demo and compare; the learner's default to the demo
# preset's values (learner.config.PRESETS["demo"]).
PRESET_HELP = "Default: the demo preset's (learner.config)."
OutOpt = Annotated[Path, typer.Option(help="Report folder (the run's data lives under it too).")]
DemoBatchSizeOpt = Annotated[
    int | None, typer.Option(min=1, help=f"Requests per step (= the learner's batch size). {PRESET_HELP}")
]
PolicyLrOpt = Annotated[
    float | None, typer.Option(min=0.0, help=f"Learner policy learning rate. {PRESET_HELP}")
]
CriticLrOpt = Annotated[
    float | None, typer.Option(min=0.0, help=f"Learner critic learning rate (SAO only). {PRESET_HELP}")
]
AdamBeta1Opt = Annotated[
    float | None, typer.Option(min=0.0, max=0.999, help=f"Learner AdamW β1. {PRESET_HELP}")
]
KlCoefOpt = Annotated[
    float | None, typer.Option(min=0.0, help=f"Learner KL anchor to the base policy. {PRESET_HELP}")
]
KeepWeightsOpt = Annotated[
    bool, typer.Option(help="Keep the policy versions and checkpoint (GBs); the report never needs them.")
]
PolicyOpt = Annotated[
    str | None, typer.Option(help=f"Learner policy: full | lora (docs/lora.md). {PRESET_HELP}")
]
LearnerConfigOpt = Annotated[
    Path | None,
    typer.Option(
        help="A JSON file of learner config fields (saoserve learn --config's format, all or some), "
        "laid over the preset; the learner options given here are laid over it (docs/lora.md)."
    ),
]
AdvantageValuesOpt = Annotated[
    str | None,
    typer.Option(
        help="SAO's critic values for GAE: after_updates (after its K updates on the batch, the "
        f"paper's) | before_updates (ablation, docs/design.md §5.2). {PRESET_HELP}"
    ),
]
CorrectionOpt = Annotated[
    str, typer.Option(help="Learner off-policy correction: dis | mis_snapshot | mis_ewma (learner.config).")
]
CriticInitOpt = Annotated[
    Path | None,
    typer.Option(
        help="SAO starts from this pretrained critic (saoserve pretrain-critic's critic_pretrained.pt); "
        "default: a fresh value head."
    ),
]
LearnerRanksOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Run the learner as this many ranks on this host (saoserve learn --ranks: torchrun, "
        "FSDP2, gloo on CPU; docs/scaling.md). Default: one process.",
    ),
]
DemoConcurrencyOpt = Annotated[
    int | None,
    typer.Option(min=1, help=f"Requests in flight (default: async {DEMO_CONCURRENCY}, sync the batch size)."),
]
DemoMaxBacklogOpt = Annotated[
    int | None,
    typer.Option(min=0, help=f"{MAX_BACKLOG_HELP} Default: {DEMO_BACKLOG_BATCHES} batches in async mode."),
]
SeedsOpt = Annotated[
    int,
    typer.Option(
        min=1, help="Runs per method (seeds --seed, --seed + 1, …); the report gives mean and spread."
    ),
]
GuardOpt = Annotated[
    bool | None,
    typer.Option("--guard/--no-guard", help=f"The version lifecycle's guard (docs/guard.md). {PRESET_HELP}"),
]
GateOpt = Annotated[
    bool,
    typer.Option(
        help="Gate each new version on the probe set before it serves (guard.gate with its defaults; "
        "about one learner step a version, docs/guard.md)."
    ),
]
BrokenLearnerOpt = Annotated[
    str | None,
    typer.Option(
        help="FAULT INJECTION, to measure the guard: flip (each policy step reversed) | scale=F "
        "(each policy step F > 1 times too large; scale alone: 100). Default: a correct learner."
    ),
]


RUN_METHODS = ("sao", "running_mean")
"""The methods ``demo``/``compare`` run (SAO §3.4's comparison: ``saoserve.demo.run_method``)."""

MethodsOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Methods to run, comma-separated, each on the same schedule, prompts and judge: "
        f"{', '.join(RUN_METHODS)}. Default: demo sao, compare both."
    ),
]


def parse_methods(spec: str) -> list[str]:
    """The methods of ``--methods`` (``sao,running_mean``), in the given order.

    Raises ValueError: an empty list, a method not in ``RUN_METHODS``, or one named twice.
    """
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--methods {spec!r}: name at least one of {', '.join(RUN_METHODS)}")
    for name in names:
        if name not in RUN_METHODS:
            raise ValueError(f"--methods: unknown method {name!r}: choose {', '.join(RUN_METHODS)}")
    if len(set(names)) < len(names):
        raise ValueError(f"--methods {spec!r}: a method is named twice")
    return names


def parse_broken_learner(spec: str) -> dict:
    """The ``LearnerConfig.broken_learner`` fields of ``--broken-learner``: ``flip``, ``scale``
    (factor 100) or ``scale=F``. The factor's bound (F > 1) is checked by the config.

    Raises ValueError: another kind, a factor on ``flip``, or a factor that is not a number.
    """
    kind, eq, value = spec.strip().partition("=")
    if kind not in ("flip", "scale"):
        raise ValueError(f"--broken-learner {spec!r}: choose flip or scale=F")
    if not eq:
        return {"kind": kind}
    if kind == "flip":
        raise ValueError(f"--broken-learner {spec!r}: flip takes no factor")
    try:
        return {"kind": kind, "factor": float(value)}
    except ValueError:
        raise ValueError(f"--broken-learner {spec!r}: the factor must be a number > 1") from None


def demo_traffic(
    mode: str,
    batch_size: int,
    concurrency: int | None,
    rate: float | None,
    feedback_delay_s: float,
    max_seconds: float | None,
    max_backlog: int | None,
    prompt_pool: int | None,
    pace: bool,
) -> dict:
    """demo/compare traffic (``traffic_fields``): the async defaults (``DEMO_CONCURRENCY`` in
    flight, a backlog cap of ``DEMO_BACKLOG_BATCHES`` batches of ``batch_size``), or lockstep with a
    step's requests in one batch. Exits 2 as ``traffic_fields``."""
    if mode == "async":
        concurrency = concurrency or DEMO_CONCURRENCY
        max_backlog = DEMO_BACKLOG_BATCHES * batch_size if max_backlog is None else max_backlog
        pace = bool(pace)
    else:
        concurrency = concurrency or batch_size
    return traffic_fields(
        mode, concurrency, rate, feedback_delay_s, max_seconds, max_backlog, prompt_pool, pace
    )
