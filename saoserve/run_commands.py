"""The commands that run the simulation: ``simulate`` (against a running server), ``demo`` (SAO)
and ``compare`` (SAO against the running-mean baseline), both of which start their own server
and learner (``saoserve.demo.run_methods``) and share one definition (``_run_command``).

Their options are declared in saoserve/run_options.py; saoserve/cli.py registers the commands.
A refused option or a run that cannot start exits 2 with one line on stderr
(``saoserve.usage.fail``).
"""

from __future__ import annotations

from pathlib import Path

import typer

from core.keys import BadTenant, check_tenant
from core.settings import get_settings
from saoserve.run_options import (
    DEMO_SCHEDULE,
    MAX_BACKLOG_HELP,
    AdamBeta1Opt,
    AdvantageValuesOpt,
    AdversaryOpt,
    BatchSizeOpt,
    BrokenLearnerOpt,
    CorrectionOpt,
    CriticInitOpt,
    CriticLrOpt,
    DemoBatchSizeOpt,
    DemoConcurrencyOpt,
    DemoMaxBacklogOpt,
    FeedbackDelayOpt,
    GateOpt,
    GuardOpt,
    JudgeOpt,
    KeepWeightsOpt,
    KlCoefOpt,
    LearnerConfigOpt,
    LearnerRanksOpt,
    MaxSecondsOpt,
    MaxTokensOpt,
    MethodsOpt,
    ModeOpt,
    OutOpt,
    PaceOpt,
    PolicyLrOpt,
    PolicyOpt,
    PromptPoolOpt,
    RateOpt,
    ScheduleOpt,
    SeedOpt,
    SeedsOpt,
    StepsPerStyleOpt,
    demo_traffic,
    make_adversary,
    make_judge,
    make_schedule,
    parse_broken_learner,
    parse_methods,
    traffic_fields,
)
from saoserve.usage import fail, given

# Style shares over a trailing window of 3 steps (48 answers at the demo's batch 16): one step's
# answers are too few to read a share from. The adaptation lag ends when the target's share reaches 0.4.
REPORT_WINDOW = 3
REPORT_THRESHOLD = 0.4


def _fmt_opt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


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
    api_key: str = typer.Option(
        None,
        envvar="SAOSERVE_SIM_API_KEY",
        help="API key the simulated users send with chat and feedback (`saoserve admin keys create`); "
        "default: none (the admin key is sent only to the admin routes).",
    ),
    tenant: str = typer.Option(
        None,
        help="The key's tenant, when it has a policy of its own: the admin reads (evidence, versions, "
        "the guard) ask for that policy (docs/tenants.md).",
    ),
    out: Path = typer.Option(Path("report"), help="Report folder."),
    metrics_port: int = typer.Option(
        None,
        min=1,
        max=65535,
        help="Serve the simulation's own figures (the target style's share and the judged reward "
        "over the last answers) on this port's /metrics for Prometheus (judge/sim_metrics.py).",
    ),
) -> None:
    """Run the style-shift simulation against a running server and write the report."""
    import asyncio
    import json

    from judge.guardstats import guard_lines
    from judge.report import write_report
    from judge.sim_config import SimulationConfig
    from judge.sim_result import save_records
    from judge.simulate import Simulation

    sched = make_schedule(schedule, steps_per_style)
    traffic = traffic_fields(
        mode, concurrency, rate, feedback_delay_s, max_seconds, max_backlog, prompt_pool, pace
    )
    if tenant is not None:
        try:
            check_tenant(tenant)
        except BadTenant as exc:
            fail(f"--tenant: {exc}")
        if api_key is None:
            # Without a key of the tenant the chats are the global policy's, the admin reads T's.
            fail("--tenant needs --api-key: a key of that tenant, with which its policy serves the chats")
    cfg = SimulationConfig(
        adversary=make_adversary(adversary),
        base_url=url,
        schedule=sched,
        steps=steps,
        batch_size=batch_size,
        max_tokens=max_tokens,
        seed=seed,
        uncertainty_sampler=uncertainty_sampler,
        wait_for_version=wait_for_version,
        admin_key=get_settings().admin_key or None,
        api_key=api_key,
        policy=tenant,
        **traffic,
    )
    sim = Simulation(
        cfg,
        make_judge(judge),
        on_step=lambda step, recs: typer.echo(
            f"step {step}: target {sched.target_at(step)}, reward "
            f"{sum(r['reward'] for r in recs) / max(len(recs), 1):.2f}"
        ),
    )
    if metrics_port is not None:
        from judge.sim_metrics import serve_metrics

        try:
            serve_metrics(metrics_port, lambda: sim.result.records)
        except OSError as exc:
            fail(f"--metrics-port {metrics_port}: cannot listen ({exc.strerror})")
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


def _run_command(
    default_methods: list[str], out_default: Path, schedule_default: str, steps_default: int, doc: str
):
    """The ``demo`` or ``compare`` command: the methods (``--methods``, else ``default_methods``)
    run on the same schedule, prompts and judge (``saoserve.demo.run_methods``), with the
    command's own defaults for the report folder, the schedule and the steps per style; every
    other option is the same for both."""

    def command(
        out: OutOpt = out_default,
        methods: MethodsOpt = None,
        schedule: ScheduleOpt = schedule_default,
        steps_per_style: StepsPerStyleOpt = steps_default,
        batch_size: DemoBatchSizeOpt = None,
        max_tokens: MaxTokensOpt = 48,
        seed: SeedOpt = 0,
        seeds: SeedsOpt = 1,
        judge: JudgeOpt = "offline",
        policy_lr: PolicyLrOpt = None,
        critic_lr: CriticLrOpt = None,
        advantage_values: AdvantageValuesOpt = None,
        adam_beta1: AdamBeta1Opt = None,
        kl_coef: KlCoefOpt = None,
        policy: PolicyOpt = None,
        learner_config: LearnerConfigOpt = None,
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
        learner_ranks: LearnerRanksOpt = None,
        guard: GuardOpt = None,
        gate: GateOpt = False,
        adversary: AdversaryOpt = None,
        broken_learner: BrokenLearnerOpt = None,
    ) -> None:
        from learner.config import PRESETS, ConfigError, build_config, overlay, read_config
        from saoserve.demo import run_methods

        sched = make_schedule(schedule, steps_per_style)
        try:
            chosen = default_methods if methods is None else parse_methods(methods)
        except ValueError as exc:
            fail(str(exc))
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
        overrides = given(
            top,
            optimizer={"policy_lr": policy_lr, "adam_beta1": adam_beta1},
            algorithm={"critic_lr": critic_lr, "kl_coef": kl_coef, "advantage_values": advantage_values},
            policy={"kind": policy},
            guard={"enabled": guard, "gate": {} if gate else None},
        )
        try:
            preset = (
                PRESETS["demo"]
                if learner_config is None
                else overlay(PRESETS["demo"], read_config(learner_config))
            )
            base = overlay(preset, overrides)
            # A field a method lacks (the critic's learning rate for running_mean) is left out.
            configs = {m: build_config(algorithm=m, base=base, correction=correction) for m in chosen}
        except ConfigError as exc:
            fail(str(exc))
        size = configs[chosen[0]].batch_size
        if learner_ranks is not None:
            from learner.distributed import check_config

            try:
                for config in configs.values():
                    check_config(config, learner_ranks)
            except ConfigError as exc:
                fail(str(exc))
        traffic = demo_traffic(
            mode, size, concurrency, rate, feedback_delay_s, max_seconds, max_backlog, prompt_pool, pace
        )
        attack = make_adversary(adversary)
        try:
            metrics = run_methods(
                configs,
                sched,
                make_judge(judge),
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
                learner_ranks=learner_ranks,
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


demo = _run_command(
    ["sao"],
    Path("report"),
    DEMO_SCHEDULE,
    10,
    "Start server + learner (SAO) on embedded defaults, run the simulation, write the report.",
)
compare = _run_command(
    ["sao", "running_mean"],
    Path("report-compare"),
    "paper",
    20,
    "SAO vs the running-mean baseline on the same schedule, prompts and judge, side by side.",
)
