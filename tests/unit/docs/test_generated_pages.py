"""The generated parts of docs/configuration.md, docs/api.md and docs/operating.md are the ones
``saoserve.docs_pages`` renders from the code (settings, learner config, routes, alert rules)."""

from __future__ import annotations

import pytest

from core.settings_doc import SettingsDocError
from saoserve.docs_pages import PARTS, begin, end, part_in, route_table, with_part
from testing import ROOT


@pytest.mark.parametrize(
    ("page", "name", "render"), [(p, n, r) for p, parts in PARTS.items() for n, r in parts]
)
def test_each_generated_part_is_up_to_date(page, name, render):
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert part_in(text, name) == render(), (
        f"docs/{page}'s {name!r} part is out of date: run .venv/bin/python -m saoserve.docs_pages --write"
    )


def test_the_route_table_lists_every_route_and_method():
    spec = {
        "paths": {
            "/b": {"post": {"summary": "B", "description": "Does b. More."}},
            "/a": {"get": {"summary": "A"}, "delete": {"summary": "Gone", "description": "x | y"}},
        }
    }
    assert route_table(spec).splitlines()[2:] == [
        "| `GET` | `/a` | A |",
        "| `DELETE` | `/a` | x \\| y |",
        "| `POST` | `/b` | Does b. |",
    ]


def test_parts_replace_only_their_span_and_refuse_bad_markers():
    text = f"intro\n{begin('x')}\nold\n{end('x')}\nrest\n"
    new = with_part(text, "x", "| new |\n")
    assert new == f"intro\n{begin('x')}\n| new |\n{end('x')}\nrest\n"
    assert part_in(new, "x") == "| new |\n"
    with pytest.raises(SettingsDocError, match="each marker once"):
        part_in("no markers\n", "x")
    with pytest.raises(SettingsDocError, match="comes before"):
        part_in(f"{end('x')}\n{begin('x')}\n", "x")
