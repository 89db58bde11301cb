"""The generated parts of the reader's docs: configuration, HTTP routes and alert rules.

Each part is rendered from what the code declares, never copied by hand (issue 41: docs a user
reads):

- ``settings`` and ``learner``: docs/configuration.md, from :class:`core.settings.Settings` (the
  README's table, ``core.settings_doc``) and :class:`learner.config.LearnerConfig` with every model
  it nests (each field's type, default and docstring);
- ``routes``: docs/api.md, from the server's OpenAPI document (method, path, summary);
- ``alerts``: docs/operating.md, from ``deploy/prometheus/alerts.yml`` (name, ``for``, severity,
  summary).

A page keeps each part between ``<!-- generated:NAME:begin ... -->`` and
``<!-- generated:NAME:end -->``. Regenerate after changing a setting, a route or a rule::

    .venv/bin/python -m saoserve.docs_pages --write

``--check`` exits 1 when a page differs (``tests/unit/docs/test_generated_pages.py`` checks the same).
"""

from __future__ import annotations

import argparse
import enum
import sys
import tempfile
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from core.settings_doc import SettingsDocError, settings_table

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HTTP_METHODS = ("get", "post", "put", "patch", "delete")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _span(text: str, first: str, last: str) -> tuple[int, int]:
    """Start and end offsets of the text between two markers (exclusive of both).

    Raises:
        SettingsDocError: a marker missing or repeated, or the end before the begin.
    """
    if text.count(first) != 1 or text.count(last) != 1:
        raise SettingsDocError(f"the page must hold each marker once: {first!r} and {last!r}")
    start, stop = text.index(first) + len(first), text.index(last)
    if stop < start:
        raise SettingsDocError(f"{last!r} comes before {first!r}")
    return start, stop


def begin(name: str) -> str:
    return f"<!-- generated:{name}:begin (python -m saoserve.docs_pages --write) -->"


def end(name: str) -> str:
    return f"<!-- generated:{name}:end -->"


def _type_text(annotation: Any) -> str:
    """A field's type as a reader writes it: ``float``, ``int | None``, ``'token' | 'trajectory'``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_text(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_text(a) for a in typing.get_args(annotation))
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_text(args[0])}, ...]"
        return "tuple[" + ", ".join(_type_text(a) for a in args) + "]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(repr(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds (a model, an optional one, a union of them)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "*required*"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return f"`{type(value).__name__}()`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`" if value is not None else "`None`"


def model_tables(root: type[BaseModel], path: str = "") -> str:
    """One table per model reachable from ``root`` (fields, types, defaults, meaning), ``root``
    first, each nested model under the field path that reaches it (``algorithm`` → ``SAOAlgorithm``)."""
    out: list[str] = []
    seen: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel], where: str) -> None:
        if model in seen:
            return
        seen.add(model)
        doc = (model.__doc__ or "").strip().split("\n\n")[0]
        out.extend([f"### `{model.__name__}`" + (f" (`{where}`)" if where else ""), "", _cell(doc), ""])
        out.extend(["| field | type | default | meaning |", "| --- | --- | --- | --- |"])
        nested: list[tuple[type[BaseModel], str]] = []
        for name, field in model.model_fields.items():
            out.append(
                f"| `{name}` | {_type_text(field.annotation)} | {_cell(_default_text(field))} "
                f"| {_cell(field.description or '')} |"
            )
            nested += [(m, f"{where}.{name}" if where else name) for m in _models_in(field.annotation)]
        out.append("")
        for sub, sub_where in nested:
            walk(sub, sub_where)

    walk(root, path)
    return "\n".join(out).rstrip("\n") + "\n"


def learner_tables() -> str:
    from learner.config import LearnerConfig

    return model_tables(LearnerConfig)


def route_table(spec: dict[str, Any] | None = None) -> str:
    """Every route of the server's OpenAPI document: method, path, the first sentence of its
    description; sorted by path."""
    if spec is None:
        spec = server_spec()
    lines = ["| method | path | what it does |", "| --- | --- | --- |"]
    for path in sorted(spec["paths"]):
        for method in HTTP_METHODS:
            op = spec["paths"][path].get(method)
            if op is not None:
                lines.append(f"| `{method.upper()}` | `{path}` | {_cell(_first_sentence(op))} |")
    return "\n".join(lines) + "\n"


def _first_sentence(op: dict[str, Any]) -> str:
    """A route's description up to its first full stop (its docstring), else FastAPI's summary."""
    text = " ".join((op.get("description") or "").split())
    if not text:
        return op.get("summary", "")
    cut = text.find(". ")
    return text if cut < 0 else text[: cut + 1]


def server_spec() -> dict[str, Any]:
    """The OpenAPI document of a server built on default settings, without an engine."""
    from core.settings import Settings
    from server.app import create_app

    with tempfile.TemporaryDirectory() as home:
        settings = Settings(home=Path(home), feedback_secret="x" * 32, admin_key="y" * 32)
        return create_app(settings, engine=types.SimpleNamespace(), watch_policy=False).openapi()


def alert_table(path: Path = ROOT / "deploy" / "prometheus" / "alerts.yml") -> str:
    """Every alert rule of ``path``: name, how long it must hold, severity, summary."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    lines = ["| alert | for | severity | summary |", "| --- | --- | --- | --- |"]
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                lines.append(
                    f"| `{rule['alert']}` | {rule.get('for', '—')} | {rule.get('labels', {}).get('severity', '')} "
                    f"| {_cell(rule.get('annotations', {}).get('summary', ''))} |"
                )
    return "\n".join(lines) + "\n"


# page → [(part name, renderer)]
PARTS: dict[str, list[tuple[str, Callable[[], str]]]] = {
    "configuration.md": [("settings", settings_table), ("learner", learner_tables)],
    "api.md": [("routes", route_table)],
    "operating.md": [("alerts", alert_table)],
}


def part_in(text: str, name: str) -> str:
    """The text between a part's markers (without the blank lines around it).

    Raises:
        SettingsDocError: markers missing, repeated or out of order.
    """
    start, stop = _span(text, begin(name), end(name))
    return text[start:stop].strip("\n") + "\n"


def with_part(text: str, name: str, body: str) -> str:
    start, stop = _span(text, begin(name), end(name))
    return text[:start] + "\n" + body + text[stop:]


def main(argv: list[str] | None = None) -> int:
    """``python -m saoserve.docs_pages [--write | --check]``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m saoserve.docs_pages", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated part is out of date")
    ap.add_argument("--write", action="store_true", help="rewrite the generated parts")
    args = ap.parse_args(argv)
    stale = []
    for page, parts in PARTS.items():
        path = DOCS / page
        text = path.read_text(encoding="utf-8")
        new = text
        for name, render in parts:
            new = with_part(new, name, render())
        if new != text:
            stale.append(page)
            if args.write:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python -m saoserve.docs_pages --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
