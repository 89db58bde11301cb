"""deploy/'s compose files read as Compose reads them: YAML (``load``), the ``.env`` file
(``read_env_file``), interpolation (``interpolate``, ``referenced``), a service's environment
(``environment``) and a Dockerfile's (``dockerfile_env``)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import yaml

from testing import ROOT

DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
ENV_EXAMPLE = DEPLOY / ".env.example"
DOCKERFILES = (ROOT / "Dockerfile", DEPLOY / "Dockerfile.gpu")
BIN = Path(sys.executable).parent  # the virtualenv's commands


class InterpolationError(ValueError):
    """A ``${VAR:?message}`` whose variable is unset or empty (compose refuses to start)."""


_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value, env: dict[str, str]):
    """Compose's interpolation of ``value`` (dicts and lists walked): ``$$`` → ``$``,
    ``${VAR}``/``$VAR``, ``${VAR:-default}`` (unset or empty), ``${VAR-default}`` (unset),
    ``${VAR:?message}``/``${VAR?message}`` (InterpolationError)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        name, op, arg = m["name"] or m["bare"], m["op"], m["arg"] or ""
        val = env.get(name)
        missing = val is None or (val == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else val
        if op in (":?", "?"):
            if missing:
                raise InterpolationError(f"{name}: {arg}")
            return val
        return val or ""

    return _VAR.sub(one, value)


def referenced(value) -> set[str]:
    """The variables a compose value interpolates."""
    if isinstance(value, dict):
        return set().union(*(referenced(v) for v in value.values()), set())
    if isinstance(value, list):
        return set().union(*(referenced(v) for v in value), set())
    if not isinstance(value, str):
        return set()
    return {m["name"] or m["bare"] for m in _VAR.finditer(value) if not m["escaped"]}


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments skipped."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip()
    return env


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def dockerfile_env(path: Path) -> dict[str, str]:
    """The ENV assignments of a Dockerfile (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                key, _, value = word.partition("=")
                env[key] = value
    return env
