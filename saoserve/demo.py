"""The main job: server + learner as real processes, the simulation as their client, a report.

``run_method`` starts ``saoserve serve`` and ``saoserve learn`` in a fresh home folder (SQLite
and the SQL-table log unless the environment says otherwise), drives the simulation with a
progress bar and returns its result (records, the learner's step metrics, the async timeline;
also saved as ``records-<name>.jsonl`` and ``details-<name>.json``). Ctrl-C stops the run and
keeps what was measured, so the report is still written (marked partial).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from core.cores import available_cores, split_cores
from core.hardware import bf16_native
from judge.base import Judge
from judge.guardstats import guard_lines
from judge.sim_config import SimulationConfig
from judge.sim_result import SimulationResult, save_records
from judge.simulate import Simulation
from judge.styles import Schedule
from learner.algo.pretrain import PRETRAINED_CRITIC
from learner.config import LearnerConfig, SAOAlgorithm, build_config
from saoserve.ports import free_port

console = Console(stderr=True)


def wait_until_ready(url: str, server: subprocess.Popen, log_file: Path, timeout_s: float) -> None:
    """Wait until the server at ``url`` (the child process ``server``, logging to ``log_file``)
    answers ``/readyz`` with 200, polling each second. Raises RuntimeError if it exits first or
    is not ready within ``timeout_s`` seconds (the commands report a RuntimeError as a CLI error)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited; see {log_file}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server did not start within {timeout_s:.0f}s; see {log_file}")


class Services:
    """``saoserve serve`` and ``saoserve learn`` as child processes of one home folder."""

    def __init__(self, home: Path, learn_args: list[str], log_dir: Path):
        self.home = home
        self.port = free_port()
        self.admin_key = secrets.token_hex(16)
        # The engine and the learner share this machine: each gets its own cores (core.cores).
        # Where bf16 is native, the engine serves in bf16 as the demo preset's learner computes:
        # 1.5-1.8x the tokens/s of float32, and that learner's logprob gap is the same against
        # either engine (docs/precision.md, "Serving in bf16"). The caller's environment wins.
        engine_threads, learner_threads = split_cores(available_cores())
        defaults = {
            "SAOSERVE_ENGINE_THREADS": str(engine_threads),
            "SAOSERVE_LEARNER_THREADS": str(learner_threads),
            "SAOSERVE_DTYPE": "bfloat16" if bf16_native() else "float32",
        }
        self.env = (
            defaults
            | os.environ
            | {
                "SAOSERVE_HOME": str(home),
                "SAOSERVE_FEEDBACK_SECRET": secrets.token_hex(16),
                "SAOSERVE_ADMIN_KEY": self.admin_key,
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
            }
        )
        self.learn_args = learn_args
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{name}.log", "w")
        exe = Path(sys.executable).with_name("saoserve")
        proc = subprocess.Popen(
            [str(exe), *args], env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def start(self, timeout_s: float = 600) -> None:
        """Start the server, wait until it answers (``wait_until_ready``), start the learner.
        Whatever ends the start early (Ctrl-C or SIGTERM while the engine loads, a server that
        failed) stops what was started before it is raised: each child has a session of its own,
        so nothing else would stop it."""
        self.home.mkdir(parents=True, exist_ok=True)
        try:
            server = self._spawn("server", ["serve", "--port", str(self.port)])
            wait_until_ready(self.url, server, self.log_dir / "server.log", timeout_s)
            self._spawn("learner", ["learn", *self.learn_args])
        except BaseException:
            self.stop()
            raise

    def exited(self) -> str | None:
        """A line naming the first child that has failed (and its log), or None while all run.
        The learner exits 0 once it has published its last version (``max_steps``) while the
        simulation still collects that version's answers: that is not a failure."""
        for p in self.procs:
            code = p.poll()
            cmd = p.args[1] if isinstance(p.args, list) and len(p.args) > 1 else "?"
            if code is not None and not (cmd == "learn" and code == 0):
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                return f"saoserve {cmd} exited ({why}); see {self.log_dir}"
        return None

    def stop(self) -> None:
        """Stop the children (each its process group, vLLM's engine process included): SIGTERM,
        which ``serve`` (uvicorn) and ``learn`` take as a clean stop, then SIGKILL after 30 s.
        Not SIGINT: a child started from a shell's background job inherits SIGINT ignored."""
        for p in reversed(self.procs):
            # Even where the child itself has exited: its group may hold the engine it started.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def sigterm_as_ctrl_c():
    """Within it, SIGTERM (``kill``, ``timeout``, a cancelled CI job) stops a run as Ctrl-C
    does: the services are stopped and the report is written from what was measured. Without
    it, SIGTERM ended ``demo``/``compare`` at once and left their server and learner running.
    The previous handler is restored on exit. Off the main thread (where Python allows no
    handler) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def drop_weights(home: Path) -> int:
    """Delete the policy versions and the learner checkpoint under ``home`` (``checkpoint.pt``, or
    a ranked learner's ``checkpoint.dcp`` folder and its pointer); returns bytes freed.

    A finished run keeps its database, records, logs and report (megabytes); the weights (about
    540 MB a version in float32, plus a checkpoint with optimiser states) are only needed to
    serve or resume, so ``demo``/``compare`` drop them unless ``--keep-weights`` is given.
    """
    policies = home / "policies"
    victims = [*policies.glob("v[0-9]*"), *policies.glob("checkpoint.*")]
    freed = 0
    for v in victims:
        files = [v] if v.is_file() else [f for f in v.rglob("*") if f.is_file()]
        freed += sum(f.stat().st_size for f in files)
        if v.is_dir():
            shutil.rmtree(v)
        else:
            v.unlink()
    return freed


async def _watched(sim: Simulation, services: Services, every_s: float = 2.0) -> SimulationResult:
    """``sim.run()``, stopped (as interrupted, with what it measured) if the server or the
    learner exits: a learner killed mid-run (e.g. by the kernel's OOM killer) would otherwise
    leave the simulation waiting for versions that never come."""
    task = asyncio.ensure_future(sim.run())
    while not task.done():
        await asyncio.wait({task}, timeout=every_s)
        why = None if task.done() else services.exited()
        if why:
            console.print(f"[red]{why}: stopping the simulation[/]")
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            sim.result.interrupted = True
            sim.result.stopped_by = why
            return sim.result
    return task.result()


def place_pretrained_critic(home: Path, critic_init: Path) -> Path:
    """Copy a critic state dict (``saoserve pretrain-critic``'s output) into the run's policy
    folder, ``<home>/policies``, where the learner's ``warm_start`` loads it at start (SAO §2.3,
    value pretraining). Returns the copy's path. Raises FileNotFoundError if ``critic_init`` is
    not a file."""
    if not critic_init.is_file():
        raise FileNotFoundError(f"no pretrained critic at {critic_init}")
    target = home / "policies" / PRETRAINED_CRITIC
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(critic_init, target)
    return target


def run_method(
    method: str,
    schedule: Schedule,
    judge: Judge,
    out: Path,
    batch_size: int | None = None,
    max_tokens: int = 64,
    seed: int = 0,
    learner_config: LearnerConfig | None = None,
    keep_weights: bool = False,
    traffic: dict | None = None,
    name: str | None = None,
    critic_init: Path | None = None,
    learner_ranks: int | None = None,
) -> SimulationResult:
    """One full run of ``method`` (``sao`` or ``running_mean``) on ``schedule``.

    ``traffic``: extra ``SimulationConfig`` fields (``mode``, ``concurrency``, ``rate``,
    ``feedback_delay_s``, ``max_seconds``, ``max_backlog``, ``prompt_pool``, ``pace``,
    ``adversary``); by default the lockstep mode with a step's requests in one batch. ``name`` labels the run's folders
    (default: the method). Unless ``keep_weights``, the run's policy versions and checkpoint
    are deleted at the end (``drop_weights``). ``learner_config`` (default: the ``demo`` preset
    with ``method``) is written to ``<home>/learner.json`` with ``batch_size`` (requests and
    samples per step; None: the config's) and the step limit, and the learner started as
    ``saoserve learn --config`` that file. ``critic_init``:
    a pretrained critic the learner starts from (``place_pretrained_critic``), for a method
    with a critic; ignored for one without. ``learner_ranks``: run the learner as that many ranks
    (``saoserve learn --ranks``: torchrun, FSDP2; docs/scaling.md); None: one process.
    """
    name = name or method
    home = out / f"run-{name}"
    # The schedule's last step is served by version total - 1 (in both modes), so the learner
    # stops there instead of training (about 25 s) on a batch no one sees.
    config = learner_config or build_config("demo", algorithm=method)
    batch_size = batch_size or config.batch_size
    limits = {"batch_size": batch_size, "max_steps": max(1, schedule.total_steps - 1)}
    config = LearnerConfig.model_validate(config.model_dump() | limits)
    home.mkdir(parents=True, exist_ok=True)
    (home / "learner.json").write_text(config.to_json(), encoding="utf-8")
    if critic_init is not None and isinstance(config.algorithm, SAOAlgorithm):
        place_pretrained_critic(home, critic_init)
    learn_args = ["--config", str(home / "learner.json")]
    learn_args += ["--ranks", str(learner_ranks)] if learner_ranks is not None else []
    services = Services(home, learn_args, out / "logs" / name)
    fault = config.broken_learner
    if fault is not None:
        what = "reversed" if fault.kind == "flip" else f"{fault.factor:g} times too large"
        console.print(
            f"[bold red]{name}: fault injection: every policy step is {what} "
            f"(--broken-learner {fault.kind}), to measure the guard[/]"
        )
    console.print(f"[bold]{name}[/]: starting server and learner in {home} …")
    try:
        services.start()
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM while the engine loads (start stopped what it started): a run with
        # nothing measured, so a comparison still reports the runs before it.
        return SimulationResult(interrupted=True)
    config = SimulationConfig(
        base_url=services.url,
        schedule=schedule,
        batch_size=batch_size,
        max_tokens=max_tokens,
        seed=seed,
        admin_key=services.admin_key,
        # Lockstep default: the whole step's requests in one vLLM batch.
        **({"concurrency": batch_size} | (traffic or {})),
    )
    result = SimulationResult()
    try:
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
        ) as bar:
            task = bar.add_task(name, total=schedule.total_steps, status="")

            def on_step(step: int, recs: list[dict]) -> None:
                mean = sum(r["reward"] for r in recs) / len(recs) if recs else float("nan")
                bar.update(
                    task,
                    completed=min(step + 1, schedule.total_steps),
                    status=f"target {schedule.target_at(step)}, reward {mean:.2f}",
                )

            sim = Simulation(config, judge, on_step=on_step)
            try:
                result = asyncio.run(_watched(sim, services))
            except KeyboardInterrupt:
                result = sim.result
                result.interrupted = True
    finally:
        services.stop()
        if not keep_weights:
            freed = drop_weights(home)
            console.print(
                f"{name}: deleted {freed / 2**30:.1f} GiB of policy weights and checkpoint "
                "(pass --keep-weights to keep them)"
            )
    save_records(out / f"records-{name}.jsonl", result.records)
    (out / f"details-{name}.json").write_text(json.dumps(result.details(), default=str), encoding="utf-8")
    for line in guard_lines(result.details()):
        console.print(f"{name}: {line}", markup=False)
    return result


def run_methods(
    configs: Mapping[str, LearnerConfig],
    schedule: Schedule,
    judge: Judge,
    out: Path,
    model_dir: Path,
    *,
    batch_size: int,
    max_tokens: int,
    seed: int,
    window: int,
    threshold: float,
    seeds: int = 1,
    keep_weights: bool = False,
    traffic: dict | None = None,
    critic_init: Path | None = None,
    learner_ranks: int | None = None,
) -> dict[str, Any]:
    """Run each method of ``configs`` (name → its learner's config) ``seeds`` times, seeds
    ``seed .. seed + seeds - 1`` with the methods interleaved so that an interrupted comparison
    stays balanced, then write one report to ``out`` (``write_report`` with the share
    ``window`` in steps and the lag ``threshold``) and return its metrics.

    The model is prepared once at ``model_dir`` (``prepare_model``) and linked into each run's
    fresh home ``out/run-<name>``. ``learner_ranks``: each run's learner on that many ranks
    (``run_method``). A run that is interrupted (Ctrl-C or SIGTERM, a service that died) ends
    the loop and the report is written from what completed, marked partial on the console.
    Raises RuntimeError if no run completed a step.
    """
    from judge.report import write_report
    from saoserve.model import prepare_model

    prepare_model(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {m: [] for m in configs}
    interrupted: str | None = None
    with sigterm_as_ctrl_c():
        for s in range(seed, seed + seeds):
            for method, config in configs.items():
                name = method if seeds == 1 else f"{method}-s{s}"
                home = out / f"run-{name}"
                shutil.rmtree(home, ignore_errors=True)
                home.mkdir(parents=True)
                (home / "model").symlink_to(model_dir.resolve(), target_is_directory=True)
                result = run_method(
                    method,
                    schedule,
                    judge,
                    out,
                    batch_size=batch_size,
                    max_tokens=max_tokens,
                    seed=s,
                    learner_config=config,
                    keep_weights=keep_weights,
                    traffic=traffic,
                    name=name,
                    critic_init=critic_init,
                    learner_ranks=learner_ranks,
                )
                if result.records:
                    runs[method].append({"seed": s, "records": result.records, "details": result.details()})
                if result.interrupted:
                    interrupted = result.stopped_by or "interrupted"
                    break
            if interrupted:
                console.print(f"{interrupted}: writing a partial report", style="yellow", markup=False)
                break
    runs = {m: r for m, r in runs.items() if r}
    if not runs:
        raise RuntimeError("no step completed; nothing to report")
    return write_report(
        out,
        schedule,
        {m: r[0]["records"] for m, r in runs.items()},
        window=window,
        threshold=threshold,
        details={m: r[0]["details"] for m, r in runs.items()},
        seeds=runs if seeds > 1 else None,
    )
