"""The README and the reader's docs quote measured figures from docs/results.md, never copies.

A quoted figure names its result: ``1.17 (results: `vs_vllm`)``, the number as written (its unit,
if any, between the number and the marker: ``×``, ``%``, ``s``, ``ms``, ``MiB``, ``GiB``,
``tok/s``). The figure must equal one of the numbers of ``docs/results/<name>.json`` at the
precision it is written with (``1.17`` matches 1.1722, ``1.18`` does not;
any cell of the table may be the one). A figure in a unit that only measurements use (tokens/s, GFLOP/s, TFLOP,
requests/s, a ratio written ``0.982×``) must be such a quote, and a measurement stamped with a date
belongs in docs/results.md or a dated log (docs/log/), not in these pages (issue 41).
"""

from __future__ import annotations

import json
import math
import re
from functools import cache

import pytest

from testing import ROOT

RESULTS = ROOT / "docs" / "results"
PAGES = [
    "README.md",
    "docs/README.md",
    "docs/concepts.md",
    "docs/operating.md",
    "docs/api.md",
    "docs/configuration.md",
    "docs/demo.md",
    "docs/guard.md",
    "docs/design.md",
    "docs/precision.md",
    "docs/scaling.md",
    "docs/lora.md",
    "docs/offpolicy.md",
    "docs/serving_adapters.md",
    "docs/tenants.md",
    "docs/reliability.md",
    "docs/privacy.md",
    "docs/judge.md",
    "docs/deploy.md",
    "docs/papers.md",
]
UNIT = r"(?:×|%|s|ms|MiB|GiB|tok/s|appends/s)"
QUOTE = re.compile(r"(?P<num>-?\d+(?:\.\d+)?)\s?(?P<unit>" + UNIT + r")?\s\(results: `(?P<name>[\w-]+)`\)")
# Units no setting or limit is written in: only a measurement gives them.
MEASURED = re.compile(
    r"\d[\d.,]*\s?(?:tok/s|tokens/s|GFLOP/s|TFLOP|req/s|requests/s|appends/s)\b|\d+\.\d{2,}×"
)
DATED = re.compile(r"\b(?:measured|Measured|took)\b[^\n]{0,80}?\b20\d\d-\d\d-\d\d\b")


@cache
def numbers_of(name: str) -> list[float]:
    """Every number in the rows of result ``name`` (booleans excluded)."""
    doc = json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))
    return [
        float(v)
        for row in doc["rows"]
        for v in row.values()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]


def matches(written: str, values: list[float]) -> bool:
    """Whether a number as written equals one of ``values`` rounded to its decimals."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    half = 0.5 * 10.0**-decimals
    x = float(written)
    return any(abs(v - x) <= half + 1e-12 for v in values)


def text_of(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_the_pages_and_the_results_exist():
    assert all((ROOT / p).is_file() for p in PAGES)
    assert len(list(RESULTS.glob("*.json"))) >= 10


@pytest.mark.parametrize("page", PAGES)
def test_every_quoted_figure_equals_its_result(page):
    text = text_of(page)
    bad = []
    for m in QUOTE.finditer(text):
        name = m.group("name")
        where = f"{page}:{line_of(text, m.start())}"
        if not (RESULTS / f"{name}.json").is_file():
            bad.append(f"{where}: no result {name!r} in docs/results/")
        elif not matches(m.group("num"), numbers_of(name)):
            bad.append(f"{where}: {m.group(0)!r} is not a figure of docs/results/{name}.json")
    assert not bad, "quote docs/results.md as it is (re-run the benchmark to change it):\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES)
def test_no_unquoted_measurement_is_left(page):
    text = text_of(page)
    quoted = {m.start("num") for m in QUOTE.finditer(text)}
    bad = [
        f"{page}:{line_of(text, m.start())}: {m.group(0)!r}"
        for m in MEASURED.finditer(text)
        if m.start() not in quoted
    ]
    bad += [
        f"{page}:{line_of(text, m.start())}: {m.group(0)!r}"
        for m in DATED.finditer(text)
        if "docs/log/" not in text[m.start() : m.end() + 200]
    ]
    assert not bad, (
        "a measured figure here must quote docs/results.md as `N (results: `name`)`, or move to a "
        "dated log in docs/log/:\n" + "\n".join(bad)
    )


def test_the_rules_catch_a_pasted_figure_and_a_wrong_quote():
    assert matches("1.17", [1.1721754]) and matches("0.98", [0.9795675]) and matches("156", [156])
    assert not matches("1.18", [1.1721754]) and not matches("0.97", [0.9795675])
    assert MEASURED.search("the SQL log gives 1.015 of the tokens/s") is None
    assert MEASURED.search("Kafka (tansu) 0.982× the tokens/s") is not None
    assert MEASURED.search("25 tokens/s; peak RSS 6.5 GiB") is not None
    assert DATED.search("A fresh clone took 28 min 11 s (AMD EPYC, 2026-12-04).") is not None
    m = QUOTE.search("at 8 streams 1.17× (results: `vs_vllm`)")
    assert m is not None and (m.group("num"), m.group("unit"), m.group("name")) == ("1.17", "×", "vs_vllm")
