"""A multi-process deployment on one machine: ``saoserve serve`` replicas and ``saoserve learn``
started as a user starts them (the CLI, environment settings), sharing one PostgreSQL database,
one Kafka log (a tansu broker) and one policy folder (docs/design.md §3). Used by tests/system/test_replicas.py
and bench/bench_replica_swap.py.

A replica's ``/metrics`` says which version it serves (``saoserve_policy_version``) and since
when (``saoserve_policy_swapped_at_seconds``, Unix time); :func:`swap_delays` turns those and
the policy events' ``created_at`` into event→serving delays.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from core.logbus import open_log
from core.records import TOPIC_POLICY, PolicyEvent
from saoserve.ports import free_port
from testing.logs import read_topic

FEEDBACK_SECRET = "replicas-feedback-secret"
ADMIN_KEY = "replicas-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` with ``labels`` in a Prometheus text page (None if absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


@dataclass
class Process:
    """One child process (its own session, so its whole group can be signalled) and its log."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    started_at: float

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(errors="replace").splitlines()
            return "\n".join(lines[-n:])
        return ""

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the group, SIGKILL to it after ``grace_s`` (vLLM's engine core is a child)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@dataclass
class Replica(Process):
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serving(self, client: httpx.Client | None = None) -> tuple[int, float, float]:
        """(version served, Unix time it started serving, successful swaps) from ``/metrics``."""
        get = client.get if client is not None else httpx.get
        text = get(f"{self.url}/metrics", timeout=10).text
        return (
            int(metric(text, "saoserve_policy_version")),
            metric(text, "saoserve_policy_swapped_at_seconds"),
            metric(text, "saoserve_policy_swaps_total", result="ok") or 0.0,
        )


@dataclass
class Deployment:
    """Replicas and a learner over one database, one Kafka log and one policy folder.

    ``kv_cache_gib`` and ``max_model_len`` are small so several CPU engines fit beside a learner.
    """

    home: Path
    database_url: str
    log_url: str
    model_dir: Path
    kv_cache_gib: float = 0.25
    max_model_len: int = 512
    procs: list[Process] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return os.environ | {
            "SAOSERVE_HOME": str(self.home),
            "SAOSERVE_DATABASE_URL": self.database_url,
            "SAOSERVE_LOG_URL": self.log_url,
            "SAOSERVE_MODEL_DIR": str(self.model_dir),
            "SAOSERVE_FEEDBACK_SECRET": FEEDBACK_SECRET,
            "SAOSERVE_ADMIN_KEY": ADMIN_KEY,
            "SAOSERVE_KV_CACHE_GIB": str(self.kv_cache_gib),
            "SAOSERVE_MAX_MODEL_LEN": str(self.max_model_len),
            "SAOSERVE_MAX_TOKENS_LIMIT": "64",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen, Path, float]:
        self.home.mkdir(parents=True, exist_ok=True)
        log_path = self.home / f"{name}.log"
        exe = Path(sys.executable).with_name("saoserve")
        started = time.time()
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                [str(exe), *args],
                env=self.env | (env or {}),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc, log_path, started

    def serve(self, name: str, env: dict[str, str] | None = None) -> Replica:
        """Start ``saoserve serve`` on a free loopback port (not waiting for it); ``env`` adds
        variables for this replica only (e.g. ``VLLM_CPU_OMP_THREADS_BIND``)."""
        port = free_port()
        proc, log_path, started = self._spawn(name, ["serve", "--port", str(port)], env)
        replica = Replica(name, proc, log_path, started, port)
        self.procs.append(replica)
        return replica

    def learn(self, *args: str, env: dict[str, str] | None = None, name: str = "learner") -> Process:
        """Start ``saoserve learn ARGS``; ``env`` adds variables for this life only (e.g.
        ``SAOSERVE_FAULT_POINT``), ``name`` names its log (one per life of a restarted learner)."""
        proc, log_path, started = self._spawn(name, ["learn", *args], env)
        learner = Process(name, proc, log_path, started)
        self.procs.append(learner)
        return learner

    def wait_ready(self, replicas: list[Replica], timeout_s: float = 300) -> dict[str, float]:
        """Wait until every replica's ``/readyz`` is 200; returns each one's start-up seconds.

        Raises RuntimeError (with its log's tail) when a replica exits, TimeoutError at the deadline.
        """
        deadline = time.monotonic() + timeout_s
        ready: dict[str, float] = {}
        while len(ready) < len(replicas):
            for r in replicas:
                if r.name in ready:
                    continue
                if not r.alive():
                    raise RuntimeError(f"{r.name} exited with {r.proc.returncode}:\n{r.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{r.url}/readyz", timeout=2).status_code == 200:
                        ready[r.name] = time.time() - r.started_at
            if time.monotonic() > deadline:
                missing = [r.name for r in replicas if r.name not in ready]
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {missing}")
            time.sleep(0.5)
        return ready

    def tails(self) -> str:
        return "\n".join(f"----- {p.name} ({p.log_path})\n{p.tail()}" for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


def policy_events(log_url: str) -> list[PolicyEvent]:
    """Every publish event of the ``policy`` topic (stage notices left out), in the order
    servers apply them."""
    log = open_log(log_url)
    try:
        events = [PolicyEvent.model_validate_json(e.value) for e in read_topic(log, TOPIC_POLICY)]
    finally:
        log.close()
    return sorted((e for e in events if e.kind == "publish"), key=lambda e: e.created_at)


def wait_serving(
    replicas: list[Replica], version: int, timeout_s: float, poll_s: float = 0.2
) -> dict[str, float]:
    """Wait until every replica serves ``version``; returns each one's swapped-at time (Unix s).

    Raises TimeoutError naming what each replica serves at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    seen: dict[str, float] = {}
    with httpx.Client() as client:
        while True:
            now: dict[str, int] = {}
            for r in replicas:
                if r.name in seen:
                    continue
                v, at, _ = r.serving(client)
                now[r.name] = v
                if v == version:
                    seen[r.name] = at
            if len(seen) == len(replicas):
                return seen
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version} not served by all after {timeout_s:.0f}s: {now}")
            time.sleep(poll_s)


def swap_delays(created_at: float, swapped_at: dict[str, float]) -> dict[str, float]:
    """Event→serving seconds per replica, the last replica's (``last``) and the spread between
    the first and the last replica (``spread``), for one version published at ``created_at``."""
    delays = {name: at - created_at for name, at in swapped_at.items()}
    return delays | {"last": max(delays.values()), "spread": max(delays.values()) - min(delays.values())}
