"""Design references resolve in a fresh clone.

The code cites the design as ``docs/design.md §N``. This test scans the repository's text files
(everything but virtual environments, git data, caches and run output) and checks that:

- no citation of the old, out-of-repository design document is left (the word DESIGN, in
  capitals, followed by a section sign or ``.md``);
- every ``docs/design.md §X`` (lists ``§3, §8`` and ranges ``§5.1-5.3`` included) names a
  numbered heading of docs/design.md;
- no file points into the shared folder outside the repository, and every write-up cited as
  ``papers/NNN`` is one that docs/papers.md lists;
- every module, function, file and test that docs/design.md and docs/papers.md name exists.
"""

from __future__ import annotations

import ast
import os
import re
from functools import cache
from pathlib import Path

from testing import ROOT

DESIGN = ROOT / "docs" / "design.md"
PAPERS = ROOT / "docs" / "papers.md"

# Directories that are not the project's text: environments, git data, caches, run output.
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build"}
SKIP_TOP = {"var", "shared"}  # run output, and a copy of the shared folder on a device machine
TEXT_SUFFIXES = {
    ".py",
    ".md",
    ".sh",
    ".html",
    ".toml",
    ".yaml",
    ".yml",
    ".cfg",
    ".ini",
    ".mako",
    ".js",
    ".css",
}
TEXT_NAMES = {"Dockerfile", "Makefile", "run"}

# Built from parts so that this file does not match its own patterns.
OLD_DESIGN = re.compile(r"\b" + "DESIGN" + r"(?:\.md\b|\s*§)")
SHARED_PATH = re.compile(r"(?:\.\./|/work/)" + "shared/")
SECTION = r"\d+(?:\.\d+)*"
CITATION = re.compile(
    r"docs/design\.md`?\s*((?:§\s*" + SECTION + r"(?:\s*[-–]\s*" + SECTION + r")?(?:\s*(?:,|and|&|/)\s*)?)+)"
)
ONE_SECTION = re.compile(r"§\s*(" + SECTION + r")(?:\s*[-–]\s*(" + SECTION + r"))?")
HEADING = re.compile(r"^#{1,6}\s+(" + SECTION + r")\.?\s", re.MULTILINE)
PAPER_ID = re.compile(r"papers/(\d{3})")
CODE_NAME = re.compile(r"`((?:core|server|learner|judge|saoserve)(?:\.\w+)+)`")
REPO_PATH = re.compile(
    r"`((?:tests|testing|bench|docs|core|server|learner|judge|saoserve|scripts|deploy|migrations)/[\w./-]+?)"
    r"(?:::(\w+))?`"
)
TEST_LIST = re.compile(r"`(tests/[\w/]+\.py)` \(((?:`\w+`(?:, )?)+)\)")


def repo_files() -> list[Path]:
    """The repository's text files, relative paths sorted."""
    found = []
    for top, dirs, files in os.walk(ROOT):
        here = Path(top)
        dirs[:] = [
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.endswith(".egg-info")
            and not (d.startswith(".") and d not in (".ci", ".github"))
            and not (here == ROOT and (d in SKIP_TOP or d.startswith("report")))
            and not (here / d / "pyvenv.cfg").exists()
        ]
        for name in files:
            path = here / name
            if path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                found.append(path.relative_to(ROOT))
    return sorted(found)


@cache
def text_of(rel: Path) -> str:
    return (ROOT / rel).read_text(encoding="utf-8", errors="replace")


def hits(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    """``(file:line, match)`` for every match of ``pattern`` in the repository's text files."""
    out = []
    for rel in repo_files():
        text = text_of(rel)
        for m in pattern.finditer(text):
            out.append((f"{rel}:{text.count(chr(10), 0, m.start()) + 1}", m))
    return out


def design_sections() -> set[str]:
    return set(HEADING.findall(DESIGN.read_text(encoding="utf-8")))


def test_the_scan_sees_the_code_and_the_docs():
    files = {str(p) for p in repo_files()}
    assert {"learner/algo/dis.py", "docs/design.md", "README.md", "pyproject.toml"} <= files
    assert not any(f.startswith((".venv/", ".git/")) for f in files)


def test_the_design_has_the_numbered_sections_the_code_cites():
    sections = design_sections()
    assert {str(n) for n in range(1, 10)} <= sections
    assert {f"5.{n}" for n in range(1, 7)} <= sections


def test_no_citation_of_the_old_design_document_is_left():
    left = [where for where, _ in hits(OLD_DESIGN)]
    assert not left, "cite the design as docs/design.md §N instead:\n" + "\n".join(left)


def test_every_design_citation_names_an_existing_section():
    sections = design_sections()
    bad = []
    for where, m in hits(CITATION):
        for first, last in ONE_SECTION.findall(m.group(1)):
            for sec in (first, last):
                if sec and sec not in sections:
                    bad.append(f"{where}: docs/design.md §{sec}")
    assert not bad, "no such heading in docs/design.md:\n" + "\n".join(bad)


def test_citations_parse_lists_and_ranges():
    m = CITATION.search("(docs/design.md §3, §8; and §5.1-5.3 elsewhere)")
    assert ONE_SECTION.findall(m.group(1)) == [("3", ""), ("8", "")]
    m = CITATION.search("learner (docs/design.md §5.1–5.3).")
    assert ONE_SECTION.findall(m.group(1)) == [("5.1", "5.3")]
    m = CITATION.search("`docs/design.md` §5 and §6")
    assert ONE_SECTION.findall(m.group(1)) == [("5", ""), ("6", "")]


def test_no_path_into_the_shared_folder():
    left = [where for where, _ in hits(SHARED_PATH)]
    assert not left, "cite the papers by their docs/papers.md short name instead:\n" + "\n".join(left)


def test_every_cited_write_up_is_listed_in_papers_md():
    listed = set(re.findall(r"^\| `papers/(\d{3})` \|", PAPERS.read_text(encoding="utf-8"), re.MULTILINE))
    assert listed == {"000", "001", "002", "003", "004"}
    bad = [f"{where}: papers/{m.group(1)}" for where, m in hits(PAPER_ID) if m.group(1) not in listed]
    assert not bad, "not a write-up docs/papers.md lists:\n" + "\n".join(bad)


@cache
def top_level_names(module_file: Path) -> dict[str, set[str]]:
    """``{name: attributes}`` of a module: its functions, classes (with their members) and
    assigned names."""
    tree = ast.parse(module_file.read_text(encoding="utf-8"))
    names: dict[str, set[str]] = {}

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Assign):
            return [t.id for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members = set()
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    members.add(sub.name)
                members.update(targets(sub))
            names[node.name] = members
        else:
            for name in targets(node):
                names[name] = set()
    return names


def resolves(dotted: str) -> bool:
    """Whether ``pkg.module[.name[.member]]`` names a module file and, inside it, a top-level
    name (and a member of that class)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not module.is_file():
            continue
        rest = parts[cut:]
        if not rest:
            return True
        names = top_level_names(module)
        if rest[0] not in names:
            return False
        return len(rest) == 1 or (len(rest) == 2 and rest[1] in names[rest[0]])
    return False


def test_resolves_names_modules_and_members():
    assert resolves("learner.algo.dis.dis_loss")
    assert resolves("learner.algo.sao.SAOLearner._critic_phase")
    assert resolves("server.admin.api_router")
    assert resolves("learner.algo.offpolicy.RESET_TAU")
    assert not resolves("learner.algo.dis.no_such_function")
    assert not resolves("learner.no_such_module")
    assert not resolves("learner.algo.sao.SAOLearner.no_such_method")


def test_every_name_the_design_docs_give_exists():
    bad = []
    for doc in (DESIGN, PAPERS):
        text = doc.read_text(encoding="utf-8")
        rel = doc.relative_to(ROOT)
        for m in CODE_NAME.finditer(text):
            if not resolves(m.group(1)):
                bad.append(f"{rel}: {m.group(1)}")
        for m in REPO_PATH.finditer(text):
            path, test = ROOT / m.group(1), m.group(2)
            if not path.exists():
                bad.append(f"{rel}: {m.group(1)}")
            elif test and not re.search(rf"^(?:async )?def {test}\(", path.read_text(encoding="utf-8"), re.M):
                bad.append(f"{rel}: {m.group(1)}::{test}")
        for m in TEST_LIST.finditer(text):
            source = (ROOT / m.group(1)).read_text(encoding="utf-8")
            for test in re.findall(r"`(\w+)`", m.group(2)):
                if not re.search(rf"^(?:async )?def {test}\(", source, re.M):
                    bad.append(f"{rel}: {m.group(1)}::{test}")
    assert not bad, "named in the design docs but not in the code:\n" + "\n".join(bad)
