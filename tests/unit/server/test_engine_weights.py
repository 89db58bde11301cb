"""Weights checks before a hot-swap (core/weights.py) and the swap's failure paths
(server/engine/) on a small fake engine; the real engine's swaps are in
tests/integration/test_engine_hotswap.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from core.weights import WeightsLayout, WeightsMismatch, read_header, weights_sha256
from server.engine import PolicyEngine, SwapRefused
from testing.servers import make_settings

# A tied two-layer toy: the LM head is the embedding and absent from the file, as in SmolLM2.
BASE = {
    "model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
    "model.layers.0.mlp.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
    "model.norm.weight": torch.zeros(4, dtype=torch.bfloat16),
}


def write_version(path: Path, tensors: dict[str, torch.Tensor], tied: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return path


@pytest.fixture
def layout(tmp_path) -> WeightsLayout:
    return WeightsLayout.of_model(write_version(tmp_path / "v0", BASE), "float32")


def as_f32(tensors):
    return {k: v.float() for k, v in tensors.items()}


def test_layout_of_the_base_model(layout):
    assert set(layout.tensors) == set(BASE)
    assert layout.tensors["model.layers.0.mlp.weight"].shape == (4, 4)
    assert layout.tensors["model.norm.weight"].dtype == "BF16"
    assert set(layout.optional) == {"lm_head.weight"}  # tied: the head may be written or omitted
    assert layout.dtypes == {"F32"}  # the serving dtype, besides each tensor's own (BF16)


def test_versions_the_learner_writes_pass(layout, tmp_path):
    layout.check(write_version(tmp_path / "bf16", BASE))
    layout.check(write_version(tmp_path / "f32", as_f32(BASE)))  # the learner publishes float32
    with_head = {**BASE, "lm_head.weight": torch.zeros(8, 4, dtype=torch.bfloat16)}
    layout.check(write_version(tmp_path / "head", with_head))


BAD_VERSIONS = {
    "missing tensor": (
        {k: v for k, v in BASE.items() if k != "model.norm.weight"},
        "missing tensor 'model.norm.weight'",
    ),
    "extra tensor": (
        {**BASE, "model.layers.1.mlp.weight": torch.zeros(4, 4, dtype=torch.bfloat16)},
        "unexpected tensor 'model.layers.1.mlp.weight'",
    ),
    "wrong shape": (
        {**BASE, "model.layers.0.mlp.weight": torch.zeros(4, 5, dtype=torch.bfloat16)},
        "tensor 'model.layers.0.mlp.weight' has shape [4, 5], the model [4, 4]",
    ),
    "wrong dtype": (
        {**BASE, "model.norm.weight": torch.zeros(4, dtype=torch.float16)},
        "tensor 'model.norm.weight' has dtype F16, expected one of ['BF16', 'F32']",
    ),
    "wrong head shape": (
        {**BASE, "lm_head.weight": torch.zeros(9, 4, dtype=torch.bfloat16)},
        "tensor 'lm_head.weight' has shape [9, 4], the model [8, 4]",
    ),
}


@pytest.mark.parametrize("case", BAD_VERSIONS)
def test_bad_versions_are_named(layout, tmp_path, case):
    tensors, message = BAD_VERSIONS[case]
    with pytest.raises(WeightsMismatch) as err:
        layout.check(write_version(tmp_path / "bad", tensors))
    assert message in str(err.value)


def test_untied_model_requires_its_head(tmp_path):
    untied = {**BASE, "lm_head.weight": torch.zeros(8, 4, dtype=torch.bfloat16)}
    layout = WeightsLayout.of_model(write_version(tmp_path / "v0", untied, tied=False), "float32")
    assert layout.optional == {}
    with pytest.raises(WeightsMismatch, match="missing tensor 'lm_head.weight'"):
        layout.check(write_version(tmp_path / "v1", BASE, tied=False))


def test_header_is_read_without_the_data_and_checked_against_the_file_size(tmp_path):
    path = write_version(tmp_path / "v", BASE) / "model.safetensors"
    specs = read_header(path)
    assert {k: (s.dtype, s.shape) for k, s in specs.items()} == {
        "model.embed_tokens.weight": ("BF16", (8, 4)),
        "model.layers.0.mlp.weight": ("BF16", (4, 4)),
        "model.norm.weight": ("BF16", (4,)),
    }
    raw = path.read_bytes()
    # Data section: 8·4 + 4·4 + 4 = 52 bf16 values = 104 bytes after the header.
    (n,) = struct.unpack("<Q", raw[:8])
    assert len(raw) - 8 - n == 104
    path.write_bytes(raw[:-2])  # truncated: the last tensor's data is cut
    with pytest.raises(WeightsMismatch, match="tensors cover 104 data bytes, the file has 102"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    with pytest.raises(WeightsMismatch, match="does not fit the file"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(WeightsMismatch, match="not JSON"):
        read_header(path)
    path.write_bytes(b"\x01")
    with pytest.raises(WeightsMismatch, match="shorter than a safetensors header"):
        read_header(path)


def test_checksum_of_one_file_and_of_several(tmp_path):
    d = write_version(tmp_path / "v", BASE)
    one = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    assert weights_sha256(d) == one
    save_file({"x": torch.zeros(1)}, d / "extra.safetensors")
    two = hashlib.sha256((d / "extra.safetensors").read_bytes()).hexdigest()
    # Several files: sha256 of "<sha>  <name>\n" lines sorted by name.
    manifest = f"{two}  extra.safetensors\n{one}  model.safetensors\n"
    assert weights_sha256(d) == hashlib.sha256(manifest.encode()).hexdigest()
    with pytest.raises(FileNotFoundError):
        weights_sha256(tmp_path / "empty")


# ----------------------------------------------------------------- the swap's failure paths


class FakeLLM:
    """Records the engine calls a swap makes; ``fail`` names the call (and path) that raises."""

    def __init__(self, fail: set[str] | None = None, gate: asyncio.Event | None = None):
        self.calls: list[tuple] = []
        self.fail = fail or set()
        self.gate = gate

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))

    async def collective_rpc(self, method: str, kwargs: dict) -> None:
        name = Path(kwargs["weights_path"]).name
        self.calls.append((method, name))
        if self.gate is not None:
            await self.gate.wait()
        if f"{method}:{name}" in self.fail:
            raise RuntimeError(f"{method} of {name} failed")

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("stamp", version))
        if f"stamp:{version}" in self.fail:
            raise RuntimeError(f"stamp {version} failed")


def fake_engine(tmp_path, llm: FakeLLM) -> tuple[PolicyEngine, Path, str]:
    v0 = write_version(tmp_path / "v0", BASE)
    v1 = write_version(tmp_path / "v1", as_f32(BASE))
    eng = PolicyEngine(
        settings=make_settings(tmp_path),
        model_dir=v0,
        engine=llm,
        path=v0,
        layout=WeightsLayout.of_model(v0, "float32"),
    )
    return eng, v1, weights_sha256(v1)


PAUSE = ("pause", "keep", True)


async def test_swap_reloads_stamps_and_resumes(tmp_path):
    llm = FakeLLM()
    eng, v1, sha = fake_engine(tmp_path, llm)
    res = await eng.swap(1, v1, sha)
    assert res.version == 1 and (eng.version, eng.path) == (1, v1)
    assert llm.calls == [PAUSE, ("reload_policy", "v1"), ("stamp", "1"), ("resume",)]


async def test_mismatched_weights_are_refused_before_pausing(tmp_path):
    llm = FakeLLM()
    eng, _, _ = fake_engine(tmp_path, llm)
    bad = write_version(tmp_path / "v2", {k: v for k, v in BASE.items() if k != "model.norm.weight"})
    with pytest.raises(SwapRefused, match="missing tensor 'model.norm.weight'"):
        await eng.swap(2, bad, weights_sha256(bad))
    assert llm.calls == [] and eng.version == 0


@pytest.mark.parametrize("fault", ["reload_policy:v1", "stamp:1"])
async def test_a_fault_after_pausing_restores_the_old_version_and_resumes(tmp_path, fault):
    llm = FakeLLM(fail={fault})
    eng, v1, sha = fake_engine(tmp_path, llm)
    with pytest.raises(SwapRefused, match="version 0 serves on"):
        await eng.swap(1, v1, sha)
    assert (eng.version, eng.path) == (0, tmp_path / "v0")
    loaded_new = [PAUSE, ("reload_policy", "v1")] + ([("stamp", "1")] if fault == "stamp:1" else [])
    assert llm.calls == [*loaded_new, ("reload_policy", "v0"), ("stamp", "0"), ("resume",)]


async def test_a_failed_restore_still_resumes_the_engine(tmp_path):
    llm = FakeLLM(fail={"reload_policy:v1", "reload_policy:v0"})
    eng, v1, sha = fake_engine(tmp_path, llm)
    with pytest.raises(RuntimeError, match="reload_policy of v0 failed"):
        await eng.swap(1, v1, sha)
    assert llm.calls[-1] == ("resume",) and eng.version == 0


async def test_a_cancelled_caller_does_not_leave_the_engine_paused(tmp_path):
    gate = asyncio.Event()
    llm = FakeLLM(gate=gate)
    eng, v1, sha = fake_engine(tmp_path, llm)
    caller = asyncio.create_task(eng.swap(1, v1, sha))
    while ("reload_policy", "v1") not in llm.calls:
        await asyncio.sleep(0.01)
    caller.cancel()  # e.g. the admin client hung up mid-swap
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()
    async with eng._swap_lock:  # the shielded swap runs to its end and releases the lock
        pass
    assert llm.calls == [PAUSE, ("reload_policy", "v1"), ("stamp", "1"), ("resume",)]
    assert eng.version == 1
