"""The learner's device setting (issue 38): resolved per machine, refused where it cannot be met,
and bf16 chosen where the device has fast bf16. No GPU here: the GPU cases patch what torch
reports (``torch.cuda.is_available``, ``device_count``), which is all ``learner.models.device`` reads."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import core.hardware
from learner.config import Device, build_config
from learner.models.device import DeviceError, resolve
from saoserve.cli import app


@pytest.fixture(autouse=True)
def fresh_settings():
    """The CLI reads its settings once per process (``get_settings`` is cached): each test's
    SAOSERVE_HOME must be read anew."""
    from core.settings import get_settings

    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_auto_and_cpu_take_the_cpu_without_a_gpu(no_gpu):
    assert resolve(Device.AUTO) == torch.device("cpu")
    assert resolve(Device.CPU) == torch.device("cpu")
    assert resolve("auto", local_rank=3) == torch.device("cpu")


def test_cuda_without_a_gpu_is_refused_naming_the_problem(no_gpu):
    with pytest.raises(DeviceError, match="cuda but no CUDA GPU is visible"):
        resolve(Device.CUDA)


def test_each_local_rank_takes_its_own_gpu(two_gpus):
    assert resolve(Device.AUTO) == torch.device("cuda", 0)
    assert resolve(Device.CUDA, local_rank=1) == torch.device("cuda", 1)
    assert resolve(Device.CPU, local_rank=1) == torch.device("cpu")
    # Rank 2 of a host with 2 GPUs: one rank per GPU, so it is refused rather than doubled up.
    with pytest.raises(DeviceError, match="rank 2 of this host needs GPU 2, but 2 are visible"):
        resolve(Device.AUTO, local_rank=2)


def test_an_unknown_device_is_a_config_error():
    from learner.config import ConfigError

    with pytest.raises(ConfigError, match="device"):
        build_config("cpu", overrides={"device": "tpu"})


def test_bf16_where_the_device_has_fast_bf16(monkeypatch):
    # A GPU with bf16 (compute capability >= 8): the presets train in bf16 unless told otherwise.
    monkeypatch.setattr(core.hardware, "cuda_bf16", lambda: True)
    assert build_config("cpu").bf16 is True
    assert build_config("cpu", overrides={"device": "cuda"}).bf16 is True
    assert build_config("cpu", overrides={"bf16": False}).bf16 is False
    assert build_config("cpu", overrides={"autocast_bf16": True}).bf16 is False
    # Pinned to the CPU, the CPU rule stays: the cpu preset is float32.
    assert build_config("cpu", overrides={"device": "cpu"}).bf16 is False
    monkeypatch.setattr(core.hardware, "cuda_bf16", lambda: False)
    assert build_config("cpu").bf16 is False


def test_a_learner_on_cuda_without_a_gpu_is_refused(no_gpu):
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.algo.spo import SPOLearner
    from learner.config import LearnerConfig

    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=32, **shape))
    config = LearnerConfig(algorithm={"name": "spo"}, device="cuda")
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        SPOLearner(config, policy)


def test_learn_refuses_cuda_without_a_gpu(no_gpu, monkeypatch, tmp_path):
    import learner.process

    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    started = []
    monkeypatch.setattr(learner.process, "run_learner", lambda *a, **k: started.append(a))
    result = CliRunner().invoke(app, ["learn", "--device", "cuda"])
    assert result.exit_code == 2 and started == []
    assert "the learner's device is cuda but no CUDA GPU is visible" in result.output


def test_learn_refuses_what_ranks_cannot_do(no_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["learn", "--ranks", "4", "--batch-size", "2"])
    assert result.exit_code == 2
    assert "batch_size (2) must be at least the number of ranks (4)" in result.output
    config = tmp_path / "gate.json"
    config.write_text(build_config("cpu", overrides={"guard": {"gate": {}}}).to_json())
    result = CliRunner().invoke(app, ["learn", "--ranks", "2", "--config", str(config)])
    assert result.exit_code == 2 and "the guard's gate" in result.output


def test_demo_runs_its_learner_on_ranks_by_one_option(monkeypatch, tmp_path):
    """run_method passes --learner-ranks on to `saoserve learn --ranks`; demo refuses what ranks
    cannot do before starting anything."""
    import saoserve.demo
    from judge.styles import schedule_from_spec

    started = []

    class FakeServices:
        def __init__(self, home, learn_args, log_dir):
            started.append(learn_args)

        def start(self):
            raise RuntimeError("no server in this test")

    monkeypatch.setattr(saoserve.demo, "Services", FakeServices)
    with pytest.raises(RuntimeError, match="no server"):
        saoserve.demo.run_method(
            "sao", schedule_from_spec("cute:4", 1), None, tmp_path, batch_size=4, learner_ranks=2
        )
    path = tmp_path / "run-sao" / "learner.json"
    assert started == [["--config", str(path), "--ranks", "2"]]
    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["demo", "--learner-ranks", "2", "--gate", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "the guard's gate" in result.output


def test_drop_weights_takes_a_ranked_checkpoint_too(tmp_path):
    from saoserve.demo import drop_weights

    pol = tmp_path / "policies"
    (pol / "checkpoint.dcp" / "v000002").mkdir(parents=True)
    (pol / "checkpoint.dcp" / "v000002" / "__0_0.distcp").write_bytes(b"abc")
    (pol / "checkpoint.dcp.json").write_bytes(b"{}")
    # 3 bytes of shards + 2 of the pointer.
    assert drop_weights(tmp_path) == 3 + 2
    assert list(pol.iterdir()) == []


def test_learn_ranks_execs_torchrun_with_the_built_config(no_gpu, monkeypatch, tmp_path):
    """--ranks N replaces the process by torchrun on this host, every rank running `learn` with
    the config the options built (written to <home>/learner-ranks.json)."""
    import os

    from learner.config import load_config

    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    seen = []

    def execv(path, argv):
        seen.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    result = CliRunner().invoke(app, ["learn", "--ranks", "2", "--batch-size", "4", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    (argv,) = seen
    config = tmp_path / "learner-ranks.json"
    assert argv[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "saoserve.cli",
        "learn",
        "--config",
        str(config),
    ]
    assert load_config(config) == build_config("cpu", overrides={"batch_size": 4, "device": "cpu"})
