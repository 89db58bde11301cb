"""How ``saoserve admin`` prints what the server answered: every string through ``shown`` (or
``visible``), so text from a client (a chat's ``prompt_id``) can neither drive the terminal
(escape sequences, bell, newlines, bidi overrides) nor be read as rich markup; numbers and
database times in one format; ``--json`` output as indented JSON.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import typer
from rich.text import Text

# Format characters that reorder or hide what follows (bidi embeddings, overrides, isolates,
# marks): shown as escapes like the control characters.
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def visible(value: object) -> str:
    """``value`` as text with every control character (C0, DEL, C1: ESC, BEL, CR, newline, tab),
    line or paragraph separator and bidi control written as its escape (``\\x1b``, ``\\u202e``),
    so text from a client cannot drive the terminal it is printed on."""
    out = []
    for ch in str(value):
        cp = ord(ch)
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in BIDI_CONTROLS:
            out.append(f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}")
        else:
            out.append(ch)
    return "".join(out)


def shown(value: object) -> Text:
    """``visible(value)`` as a rich ``Text``: printed as it is, never parsed as markup (a
    ``[bold]`` or ``[/]`` in a prompt id is text, not a style or a syntax error)."""
    return Text(visible(value))


def emit_json(obj: Any) -> None:
    """Print ``obj`` (a server's JSON answer, or a report made of them) as JSON indented by 2."""
    typer.echo(json.dumps(obj, indent=2))


def num(x: Any, digits: int = 3) -> str:
    """A float with ``digits`` decimals, ``-`` for None, anything else (int, bool, str) as given."""
    if isinstance(x, bool) or x is None:
        return "-" if x is None else str(x)
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def when(iso: str | None) -> str:
    """``2025-06-01T12:00:03.123+00:00`` → ``2025-06-01 12:00:03`` (the database's UTC time)."""
    return "-" if not iso else iso[:19].replace("T", " ")
