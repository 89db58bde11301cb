"""The test tree's rules (issue 41): no module of tests/, testing/ or bench/ imports a test
module (shared helpers live in the ``testing`` package), and every folder of tests/ is a package
(an ``__init__.py``), so that test modules of one name in two folders never collide."""

from __future__ import annotations

import ast

from testing import ROOT


def imported_modules(path) -> set[str]:
    """The modules ``path`` imports, as written (``from x import y`` gives ``x`` and ``x.y``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_module_imports_a_test_module():
    bad = [
        f"{path.relative_to(ROOT)}: {name}"
        for folder in ("tests", "testing", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(imported_modules(path))
        if name == "tests" or name.startswith("tests.")
    ]
    assert bad == [], "import helpers from testing instead:\n" + "\n".join(bad)


def test_imported_modules_reads_both_forms(tmp_path):
    path = tmp_path / "m.py"
    pkg = "tests"  # spelt apart, so that a grep for test-module imports does not find this line
    path.write_text(f"import {pkg}.conftest\nfrom {pkg} import test_x\nfrom testing.servers import ADMIN\n")
    assert imported_modules(path) == {
        "tests.conftest",
        "tests",
        "tests.test_x",
        "testing.servers",
        "testing.servers.ADMIN",
    }


def test_every_test_folder_is_a_package():
    folders = {p.parent for p in (ROOT / "tests").rglob("test_*.py")} | {ROOT / "tests"}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert missing == []
