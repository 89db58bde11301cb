"""bench/results.py: one benchmark's table → docs/results/<name>.json → the generated page."""

from __future__ import annotations

import json

import pytest

from bench.results import record, render_page


def test_record_writes_json_and_page(tmp_path):
    out, page = tmp_path / "results", tmp_path / "results.md"
    path = record(
        "serving_vs_vllm",
        "Serving against bare vLLM",
        [{"streams": 1, "ratio": 1.0812}, {"streams": 8, "ratio": 0.95}],
        command="python bench/x.py --rounds 3",
        notes="Target ≥ 1.0.",
        out_dir=out,
        page=page,
    )
    doc = json.loads(path.read_text())
    assert doc["columns"] == ["streams", "ratio"]
    assert doc["rows"][0] == {"streams": 1, "ratio": 1.0812}
    assert doc["machine"]["cores"] >= 1
    text = page.read_text()
    assert "## Serving against bare vLLM (`serving_vs_vllm`)" in text
    # floats print with 4 significant digits: 1.0812 -> 1.081
    assert "| 1 | 1.081 |" in text and "| 8 | 0.95 |" in text
    assert "    python bench/x.py --rounds 3" in text
    assert "Target ≥ 1.0." in text
    assert render_page(out) == text


def test_record_replaces_a_result_of_the_same_name(tmp_path):
    out, page = tmp_path / "r", tmp_path / "p.md"
    record("a", "A", [{"x": 1}], command="c", out_dir=out, page=page)
    record("a", "A", [{"x": 2}], command="c", out_dir=out, page=page)
    assert "| 2 |" in page.read_text() and "| 1 |" not in page.read_text()


@pytest.mark.parametrize(
    ("name", "rows", "message"),
    [
        ("../x", [{"x": 1}], "letters, digits"),
        ("empty", [], "no rows"),
        ("ragged", [{"x": 1}, {"y": 2}], "row 1 has columns"),
    ],
)
def test_record_refuses_bad_tables(tmp_path, name, rows, message):
    with pytest.raises(ValueError, match=message):
        record(name, "t", rows, command="c", out_dir=tmp_path / "r", page=tmp_path / "p.md")
