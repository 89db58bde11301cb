"""The README's settings table, rendered from the settings' own fields (``core.settings``).

One row per field of :class:`core.settings.Settings`: the environment variable, the default and
the field's description. The README keeps the table between two marker comments; regenerate it
after changing a setting with::

    .venv/bin/python -m core.settings_doc --write README.md

``--check README.md`` exits 1 when the README's table differs from the settings
(``tests/unit/core/test_settings_doc.py`` checks the same); without options the table goes to stdout.

Defaults that depend on another setting are shown the way an operator reads them: a field
with a ``resolved_<name>`` property and an empty default is rendered from that property on
settings whose ``home`` is the placeholder ``<home>`` (``<home>/model``), and a field whose
resolved default is the same as an earlier field's names that field instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo

from core.settings import Settings

BEGIN = "<!-- settings-table:begin (generated: python -m core.settings_doc --write README.md) -->"
END = "<!-- settings-table:end -->"
HOME = "<home>"


class SettingsDocError(ValueError):
    """The README cannot take the generated table (markers missing, repeated or out of order)."""


def env_name(name: str, field: FieldInfo, settings_cls: type[Settings] = Settings) -> str:
    """The environment variable a field reads: its alias, else the prefix plus its name."""
    alias = field.validation_alias or field.alias
    if isinstance(alias, str):
        return alias.upper()
    return f"{settings_cls.model_config.get('env_prefix', '')}{name}".upper()


def _literal(value: Any) -> str:
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value is None:
        return "*unset*"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    text = str(value)
    # Path("") prints as ".", which an operator would read as the current folder.
    if text in ("", "."):
        return "*empty*"
    return f"`{text}`"


def _resolved_defaults(settings_cls: type[Settings]) -> dict[str, str]:
    """``{field: resolved default}`` for the fields with a ``resolved_<field>`` property."""
    home = Path(HOME)
    # model_construct reads no environment and validates nothing: the defaults alone.
    sample = settings_cls.model_construct(home=home)
    absolute = str(home.resolve())
    out = {}
    for name in settings_cls.model_fields:
        prop = getattr(settings_cls, f"resolved_{name}", None)
        if isinstance(prop, property):
            out[name] = str(prop.fget(sample)).replace(absolute, HOME)
    return out


def default_text(name: str, settings_cls: type[Settings] = Settings) -> str:
    """How the README shows a field's default (markdown): a literal in backticks, ``*empty*``,
    ``*unset*``, a resolved path such as ``<home>/model``, or "same as" an earlier setting."""
    fields = settings_cls.model_fields
    field = fields[name]
    literal = _literal(field.get_default(call_default_factory=True))
    resolved = _resolved_defaults(settings_cls)
    if literal != "*empty*" or name not in resolved:
        return literal
    for other in fields:
        if other == name:
            break
        if resolved.get(other) == resolved[name]:
            return f"same as `{env_name(other, fields[other], settings_cls)}`"
    return f"`{resolved[name]}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def settings_table(settings_cls: type[Settings] = Settings) -> str:
    """The markdown table (header and one row per field, in declaration order), ending in a newline.

    Raises:
        SettingsDocError: a field has no description (every setting must say what it does).
    """
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in settings_cls.model_fields.items():
        if not (field.description or "").strip():
            raise SettingsDocError(f"setting {name!r} has no description: add one in core/settings.py")
        lines.append(
            f"| `{env_name(name, field, settings_cls)}` | {_cell(default_text(name, settings_cls))} "
            f"| {_cell(field.description)} |"
        )
    return "\n".join(lines) + "\n"


def _span(text: str) -> tuple[int, int]:
    """Start and end offsets of the text between the markers (exclusive of both)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SettingsDocError(f"the README must hold each marker once: {BEGIN!r} and {END!r}")
    start = text.index(BEGIN) + len(BEGIN)
    end = text.index(END)
    if end < start:
        raise SettingsDocError("the settings-table end marker comes before the begin marker")
    return start, end


def table_in(text: str) -> str:
    """The table currently between the README's markers (without the blank lines around it).

    Raises:
        SettingsDocError: markers missing, repeated or out of order.
    """
    start, end = _span(text)
    return text[start:end].strip("\n") + "\n"


def with_table(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``.

    Raises:
        SettingsDocError: markers missing, repeated or out of order.
    """
    start, end = _span(text)
    return text[:start] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    """``python -m core.settings_doc [--write FILE | --check FILE]``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m core.settings_doc", description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, metavar="FILE", help="replace the table between the markers")
    group.add_argument("--check", type=Path, metavar="FILE", help="exit 1 if FILE's table is out of date")
    args = ap.parse_args(argv)
    table = settings_table()
    path = args.write or args.check
    if path is None:
        sys.stdout.write(table)
        return 0
    try:
        text = path.read_text(encoding="utf-8")
        if args.check:
            if table_in(text) != table:
                print(
                    f"{path}: the settings table is out of date; run python -m core.settings_doc --write {path}"
                )
                return 1
            return 0
        path.write_text(with_table(text, table), encoding="utf-8")
    except (OSError, SettingsDocError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
