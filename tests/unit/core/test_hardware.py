"""core.hardware: bf16 counts as native only with AMX-BF16 or AVX512-BF16, and a process asked for
bf16 elsewhere gets a warning naming the cost (docs/precision.md, "CPUs without bf16 units")."""

import pytest
import torch

from core.hardware import bf16_native, bf16_warning


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "native"),
    [(True, True, True), (True, False, True), (False, True, True), (False, False, False)],
)
def test_bf16_is_native_with_amx_or_avx512_bf16(monkeypatch, amx, avx512_bf16, native):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert bf16_native() is native
    assert (bf16_warning("the learner's models") is None) is native


def test_the_warning_names_what_computes_the_capability_and_the_cost(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    warning = bf16_warning("the learner's models")
    assert warning.startswith("the learner's models compute in bf16 on a CPU without bf16 matrix units")
    assert "torch reports AVX2" in warning
    assert "hundreds of times slower than float32" in warning
