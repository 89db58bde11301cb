"""Policy versions as LoRA adapters, without an engine (issue 20, server side;
docs/serving_adapters.md): the adapter table's rules (``server.adapters``) and the adapter folder's
check, copy and merge (``server.adapter_files``). The engine serving them:
tests/integration/test_engine_adapters.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from core.policy_store import ADAPTER_CONFIG, ADAPTER_FILE
from core.weights import weights_sha256
from server.adapter_files import AdapterMismatch, check_adapter, merge, stage
from server.adapters import AdapterTable, TableFull
from testing.adapters import toy_layout, write_toy_adapter


def test_a_failed_load_never_takes_a_slot_and_a_full_table_refuses():
    table = AdapterTable(capacity=2)
    a = table.reserve()
    table.cancel(a)
    assert table.occupied() == 0
    ids = [table.reserve(), table.reserve()]
    assert ids == [2, 3]  # ids are never reused, even the cancelled 1
    with pytest.raises(TableFull, match="all 2 adapter slots"):
        table.reserve()


def test_an_adapter_is_removed_only_unused_not_current_not_pinned():
    table = AdapterTable(capacity=3)
    v1, gone = table.loaded(table.reserve(), 1, Path("/a1"), "s1")
    assert table.current is v1 and gone == []
    held = table.acquire()  # a request starts on version 1
    assert held is v1 and v1.users == 1
    v2, gone = table.loaded(table.reserve(), 2, Path("/a2"), "s2")
    assert table.current is v2 and gone == []  # version 1 still serves that request
    assert table.release(held) == [v1]  # its last request ended: removable, slot still taken
    assert table.occupied() == 2 and table.removing == {v1.lora_id}
    table.removed(v1.lora_id)
    assert table.occupied() == 1
    table.pin(2)
    v3, gone = table.loaded(table.reserve(), 3, Path("/a3"), "s3")
    assert gone == [] and table.current is v3  # version 2 is pinned
    assert table.pin(2, pinned=False) == [v2]
    assert table.clear_current() == [v3]  # full weights serve now
    assert table.acquire() is None  # requests get the base
    with pytest.raises(ValueError, match="released more often"):
        table.release(v3)


def test_a_load_that_lost_its_race_is_removable_at_once_and_acquire_falls_back():
    table = AdapterTable(capacity=3)
    first, second = table.reserve(), table.reserve()
    v5, _ = table.loaded(second, 5, Path("/a5"), "s5")
    v4, gone = table.loaded(first, 4, Path("/a4"), "s4")
    assert table.current is v5 and gone == [v4]
    # Dispatched on version 4 (now gone): served by the current one; on 5: by 5.
    assert table.acquire(4) is v5 and table.acquire(5) is v5 and v5.users == 2
    assert v4.name == "policy-v4-1" and v5.name == "policy-v5-2"


def test_check_adapter_accepts_plain_lora_and_names_what_is_wrong(tmp_path):
    spec = check_adapter(write_toy_adapter(tmp_path / "ok"), toy_layout(), max_rank=16)
    # alpha / r = 4 / 2; rsLoRA: alpha / sqrt(r) = 4 / 1.414... = 2.828...
    assert spec.rank == 2 and spec.scale == 2.0
    assert spec.weights == {"model.layers.0.self_attn.q_proj.weight"}
    rs = check_adapter(write_toy_adapter(tmp_path / "rs", use_rslora=True), toy_layout(), 16)
    assert abs(rs.scale - 2.8284271247) < 1e-9
    cases = {
        "rank": (write_toy_adapter(tmp_path / "r32", rank=32), "rank 32 is above max_lora_rank 16"),
        "dora": (
            write_toy_adapter(tmp_path / "dora", use_dora=True),
            "unsupported adapter options set: use_dora",
        ),
        "target": (
            write_toy_adapter(tmp_path / "emb", target_modules=["q_proj", "embed_tokens"]),
            "target modules ['embed_tokens'] are not served",
        ),
        "module": (
            write_toy_adapter(tmp_path / "mod", target_modules=["k_proj"]),
            "is not on a target module",
        ),
    }
    for folder, message in cases.values():
        with pytest.raises(AdapterMismatch, match=re.escape(message)):
            check_adapter(folder, toy_layout(), max_rank=16)
    wrong = write_toy_adapter(tmp_path / "shape")
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{pre}.lora_A.weight": torch.ones(2, 7), f"{pre}.lora_B.weight": torch.ones(4, 2)},
        wrong / ADAPTER_FILE,
    )
    with pytest.raises(AdapterMismatch, match="has LoRA shapes"):
        check_adapter(wrong, toy_layout(), 16)
    cut = write_toy_adapter(tmp_path / "cut")
    data = (cut / ADAPTER_FILE).read_bytes()
    (cut / ADAPTER_FILE).write_bytes(data[:-8])
    with pytest.raises(AdapterMismatch, match="tensors cover"):
        check_adapter(cut, toy_layout(), 16)


def test_stage_copies_and_refuses_another_checksum(tmp_path):
    src = write_toy_adapter(tmp_path / "src")
    sha = weights_sha256(src)
    stage(src, tmp_path / "copy", sha)
    assert weights_sha256(tmp_path / "copy") == sha and (tmp_path / "copy" / ADAPTER_CONFIG).is_file()
    with pytest.raises(AdapterMismatch, match="checksum mismatch"):
        stage(src, tmp_path / "bad", "0" * 64)
    assert not (tmp_path / "bad").exists()


def test_merge_is_w_plus_scale_b_a(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    q = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    save_file(
        {
            "model.layers.0.self_attn.q_proj.weight": q.to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(5, 3, dtype=torch.bfloat16),
            "model.norm.weight": torch.ones(3, dtype=torch.bfloat16),
        },
        base / "model.safetensors",
    )
    adapter = write_toy_adapter(tmp_path / "ad")
    spec = check_adapter(adapter, toy_layout(), 16)
    out = merge(base, adapter, spec, tmp_path / "merged", "float32")
    from safetensors.torch import load_file

    merged = load_file(out / "model.safetensors")
    # B·A with all-ones B [4,2] and A [2,3] is 2 everywhere; scale 4/2 = 2: W + 4.
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], q + 4.0)
    assert merged["model.norm.weight"].dtype == torch.float32
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], torch.zeros(5, 3))
