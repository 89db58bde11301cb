"""The production code's floors (docs/design.md §3; issue 41): ``core`` at the bottom;
``server``, ``learner`` and ``judge`` above it, none importing another; the CLI (``saoserve``) on
top. And one door to the lifecycle: only ``core/lifecycle_store.py`` moves a recorded version's
stage (``transition``, a compare-and-set), as ``server/fate.py`` alone settles a trajectory."""

from __future__ import annotations

import ast

from testing import ROOT

FLOORS = {"core": 0, "server": 1, "learner": 1, "judge": 1, "saoserve": 2}


def modules(package: str) -> list:
    return sorted((ROOT / package).rglob("*.py"))


def imports_of(path) -> set[str]:
    """The top-level packages ``path`` imports (``from core.db import x`` gives ``core``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_no_import_runs_up_or_across_a_floor():
    bad = [
        f"{path.relative_to(ROOT)} imports {other}"
        for package, floor in FLOORS.items()
        for path in modules(package)
        for other in sorted(imports_of(path) & set(FLOORS) - {package})
        if FLOORS[other] >= floor
    ]
    assert bad == []


def stage_writes(path) -> list[int]:
    """Lines of ``path`` that write ``PolicyVersion.lifecycle`` in an UPDATE: a ``.values(...)``
    with a ``lifecycle`` keyword on a statement built from ``update(PolicyVersion)``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "values"
            and any(k.arg == "lifecycle" for k in node.keywords)
        ):
            continue
        chain = ast.dump(node.func.value)
        if "Name(id='update'" in chain and "Name(id='PolicyVersion'" in chain:
            lines.append(node.lineno)
    return lines


def test_only_the_lifecycle_store_moves_a_versions_stage():
    writers = {
        str(path.relative_to(ROOT)) for package in FLOORS for path in modules(package) if stage_writes(path)
    }
    assert writers == {"core/lifecycle_store.py"}


def test_stage_writes_finds_an_update_of_the_stage(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "conn.execute(update(PolicyVersion).where(PolicyVersion.version == 3).values(lifecycle='promoted'))\n"
        "conn.execute(update(PolicyVersion).values(status='published'))\n"
        "conn.execute(insert(PolicyVersion).values(lifecycle='canary'))\n"
    )
    assert stage_writes(path) == [1]
