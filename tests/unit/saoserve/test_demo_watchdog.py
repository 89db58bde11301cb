"""The main job stops, keeping what it measured, when the server or the learner exits, and
stops its children when it is stopped itself (Ctrl-C, SIGTERM)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from judge.sim_result import SimulationResult
from saoserve.demo import Services, _watched
from testing import ROOT


class WaitingSimulation:
    """Like ``judge.simulate.Simulation.run``: waits for versions until cancelled, then returns
    what it measured, marked interrupted."""

    def __init__(self) -> None:
        self.result = SimulationResult(records=[{"step": 0, "reward": 1.0}])

    async def run(self) -> SimulationResult:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.result.interrupted = True
        return self.result


def services_with(tmp_path: Path, code: int) -> Services:
    services = Services(tmp_path / "home", [], tmp_path / "logs")
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])
    proc.args = ["saoserve", "learn"]
    proc.wait()
    services.procs.append(proc)
    return services


def test_a_learner_that_exits_stops_the_simulation_with_its_records(tmp_path):
    services = services_with(tmp_path, 137)
    result = asyncio.run(asyncio.wait_for(_watched(WaitingSimulation(), services, every_s=0.05), 10))
    assert result.interrupted
    assert result.records == [{"step": 0, "reward": 1.0}]
    assert result.stopped_by == f"saoserve learn exited (exit code 137); see {tmp_path / 'logs'}"
    assert result.details()["stopped_by"] == result.stopped_by


def test_a_finished_simulation_is_returned_as_is(tmp_path):
    class Done(WaitingSimulation):
        async def run(self) -> SimulationResult:
            return self.result

    services = Services(tmp_path / "home", [], tmp_path / "logs")
    result = asyncio.run(_watched(Done(), services, every_s=0.05))
    assert not result.interrupted and result.stopped_by is None


def test_a_learner_done_with_its_steps_does_not_stop_the_simulation(tmp_path):
    """``max_steps`` reached: the learner exits 0 and the last version's answers still count."""
    services = services_with(tmp_path, 0)
    assert services.exited() is None
    server = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(0)"])
    server.args = ["saoserve", "serve"]
    server.wait()
    services.procs.append(server)
    assert services.exited() == f"saoserve serve exited (exit code 0); see {tmp_path / 'logs'}"


def test_stop_ends_children_that_ignore_sigint(tmp_path):
    """A demo started from a shell's background job passes SIGINT ignored to its children;
    ``stop`` sends SIGTERM, so they end at once rather than by SIGKILL after 30 s."""
    services = Services(tmp_path / "home", [], tmp_path / "logs")
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    services.procs.append(proc)
    services.stop()
    assert proc.returncode == -signal.SIGTERM and services.procs == []


def test_sigterm_stops_a_run_as_ctrl_c_does():
    """``kill`` of ``saoserve demo`` ended it at once and left its server and learner running;
    within ``sigterm_as_ctrl_c`` SIGTERM is a KeyboardInterrupt, which ``run_method`` turns into
    a stopped run and a report, and the previous handler is back afterwards."""
    code = (
        "import signal, time\n"
        "from saoserve.demo import sigterm_as_ctrl_c\n"
        "try:\n"
        "    with sigterm_as_ctrl_c():\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (0, "interrupted\nTrue\n")


def test_an_interrupt_while_the_server_starts_stops_it(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) during the engine's start-up left the server running in its own
    session: ``start`` now stops what it started before the interrupt goes on."""
    import saoserve.demo

    spawned: list[subprocess.Popen] = []

    class Sleeping(Services):
        def _spawn(self, name, args):
            proc = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
            )
            self.procs.append(proc)
            spawned.append(proc)
            return proc

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(saoserve.demo, "wait_until_ready", interrupted)
    services = Sleeping(tmp_path / "home", [], tmp_path / "logs")
    with pytest.raises(KeyboardInterrupt):
        services.start()
    assert len(spawned) == 1 and spawned[0].returncode == -signal.SIGTERM
    assert services.procs == []


def test_a_run_interrupted_while_its_engine_starts_is_a_run_with_nothing_measured(tmp_path, monkeypatch):
    """``run_method`` returns an interrupted, empty result (``run_methods`` then reports the runs
    before it, as for an interrupt during the simulation) instead of raising out of a comparison."""
    import saoserve.demo
    from judge.offline import OfflineJudge
    from saoserve.run_options import make_schedule

    def interrupted(self, timeout_s: float = 600) -> None:
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(saoserve.demo.Services, "start", interrupted)
    result = saoserve.demo.run_method("sao", make_schedule("cute:1", 1), OfflineJudge(), tmp_path)
    assert result.interrupted and result.records == []


def test_a_server_not_ready_in_time_is_a_runtime_error_naming_its_log(tmp_path):
    """The commands report a RuntimeError as a CLI error (a TimeoutError escaped as a traceback)."""
    from saoserve.demo import wait_until_ready

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RuntimeError, match=r"did not start within 0s; see .*server\.log"):
            wait_until_ready("http://127.0.0.1:9", server, tmp_path / "server.log", 0)
    finally:
        server.kill()
        server.wait()
