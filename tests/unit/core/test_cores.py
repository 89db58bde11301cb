"""core.cores: the engine's and the learner's threads on one machine; server.cpu_worker's
environment, set only while an engine starts."""

from __future__ import annotations

import os

import pytest

from core.cores import available_cores, split_cores
from server.cpu_worker import IN_PROCESS_WORKER, THREADS, in_process_worker, worker_environment


@pytest.mark.parametrize(
    ("cores", "split"),
    [
        (1, (1, 1)),  # one core: shared, at least a thread each
        (2, (1, 1)),  # 2 // 2 = 1 for the engine, 2 - 1 = 1 for the learner
        (3, (1, 2)),  # 3 // 2 = 1, 3 - 1 = 2
        (16, (8, 8)),
    ],
)
def test_split_cores(cores, split):
    assert split_cores(cores) == split


def test_split_cores_refuses_no_cores():
    with pytest.raises(ValueError, match="at least one core, not 0"):
        split_cores(0)


def test_available_cores_is_this_process_affinity():
    assert available_cores() == len(os.sched_getaffinity(0)) >= 1


def test_worker_environment():
    assert worker_environment(3) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "3"}
    with pytest.raises(ValueError, match="at least one compute thread, not 0"):
        worker_environment(0)


def test_the_environment_is_set_inside_and_restored_after(monkeypatch):
    monkeypatch.delenv(IN_PROCESS_WORKER, raising=False)
    monkeypatch.setenv(THREADS, "7")
    with in_process_worker(2):
        assert os.environ[IN_PROCESS_WORKER] == "0" and os.environ[THREADS] == "2"
    assert IN_PROCESS_WORKER not in os.environ and os.environ[THREADS] == "7"


def test_the_environment_is_restored_when_the_start_fails(monkeypatch):
    monkeypatch.setenv(IN_PROCESS_WORKER, "1")
    monkeypatch.delenv(THREADS, raising=False)
    with pytest.raises(RuntimeError), in_process_worker(1):
        raise RuntimeError("the engine did not start")
    assert os.environ[IN_PROCESS_WORKER] == "1" and THREADS not in os.environ


def test_none_keeps_vllms_own_layout(monkeypatch):
    monkeypatch.delenv(IN_PROCESS_WORKER, raising=False)
    monkeypatch.delenv(THREADS, raising=False)
    with in_process_worker(None):
        assert IN_PROCESS_WORKER not in os.environ and THREADS not in os.environ


def test_the_demo_gives_the_engine_and_the_learner_their_own_cores(monkeypatch, tmp_path):
    import saoserve.demo
    from saoserve.demo import Services

    monkeypatch.delenv("SAOSERVE_ENGINE_THREADS", raising=False)
    monkeypatch.delenv("SAOSERVE_LEARNER_THREADS", raising=False)
    monkeypatch.setattr(saoserve.demo, "available_cores", lambda: 3)
    env = Services(tmp_path, [], tmp_path / "logs").env
    assert (env["SAOSERVE_ENGINE_THREADS"], env["SAOSERVE_LEARNER_THREADS"]) == ("1", "2")
    # The caller's own choice wins.
    monkeypatch.setenv("SAOSERVE_LEARNER_THREADS", "1")
    env = Services(tmp_path, [], tmp_path / "logs").env
    assert (env["SAOSERVE_ENGINE_THREADS"], env["SAOSERVE_LEARNER_THREADS"]) == ("1", "1")


@pytest.mark.parametrize(("native", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_the_demo_serves_in_bf16_where_the_cpu_has_bf16_units(monkeypatch, tmp_path, native, dtype):
    import saoserve.demo
    from saoserve.demo import Services

    monkeypatch.delenv("SAOSERVE_DTYPE", raising=False)
    monkeypatch.setattr(saoserve.demo, "bf16_native", lambda: native)
    assert Services(tmp_path, [], tmp_path / "logs").env["SAOSERVE_DTYPE"] == dtype
    monkeypatch.setenv("SAOSERVE_DTYPE", "float32")
    assert Services(tmp_path, [], tmp_path / "logs").env["SAOSERVE_DTYPE"] == "float32"


def test_the_learner_takes_its_thread_count_before_it_builds_anything(monkeypatch, tmp_path):
    import torch

    import learner.process
    from core.settings import Settings
    from learner.config import build_config

    class Built(Exception):
        pass

    def migrate(url):
        raise Built(torch.get_num_threads())

    threads = torch.get_num_threads()
    monkeypatch.setattr(learner.process, "migrate", migrate)
    try:
        with pytest.raises(Built) as built:
            learner.process.run_learner(Settings(home=tmp_path, learner_threads=1), build_config("cpu"))
        assert built.value.args == (1,)
    finally:
        torch.set_num_threads(threads)
