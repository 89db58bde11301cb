"""The grouped LoRA op (``server.grouped_lora``, ``server.grouped_punica``; issue 39) against vLLM's
stock CPU op, on random tensors: both ops are called on the same inputs and must give the same
outputs (float32: within ``assert_close``'s float32 tolerances, summation order differs).

vLLM's stacked weights are ``(max_loras, 1, R, in)`` / ``(max_loras, 1, out, R)``, zero in an empty
slot and beyond an adapter's rank. The mixes leave the last slot empty, as vLLM's is while fewer
than ``max_loras`` adapters are active: the stock op gives a token with no adapter (slot -1)
the last slot's delta, zero then (``test_a_token_with_no_adapter_gets_no_delta_even_beside_a_full_table``
shows the difference once it is filled).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.ops.torch_ops import (
    bgmv_expand,
    bgmv_expand_slice,
    bgmv_shrink,
    sgmv_expand_slice,
    sgmv_shrink,
)
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from server.grouped_lora import (
    PINNED_VLLM,
    LoraOp,
    SlotWeights,
    expand,
    linear,
    lora_groups,
    refusal,
    shrink,
)
from server.grouped_punica import GroupedPunicaWrapperCPU
from server.worker_ext import PolicyReloadExtension

MAX_LORAS = 4  # slots 0..3; the mixes use 0..2
RANK = 16  # max_lora_rank
HIDDEN = 24
QKV = (24, 8, 8)  # q, k, v output widths (a fused qkv projection)
GATE_UP = (40, 40)
VOCAB = 50
LORA_IDS = [11, 12, 13, None]  # vLLM's lora_index_to_id: slot i holds adapter id LORA_IDS[i]


def stacked(out: int, inp: int, ranks: dict[int, int], gen: torch.Generator, dtype=torch.float32):
    """A stacked weight ``(MAX_LORAS, 1, out, inp)`` as vLLM holds it: slot s random in its first
    ``ranks[s]`` rows (A, out = R) or columns (B, inp = R), zero elsewhere and in other slots."""
    w = torch.zeros(MAX_LORAS, 1, out, inp, dtype=dtype)
    for slot, r in ranks.items():
        if out == RANK:
            w[slot, 0, :r] = torch.randn(r, inp, generator=gen).to(dtype)
        else:
            w[slot, 0, :, :r] = torch.randn(out, r, generator=gen).to(dtype) * 0.5
    return w


# Adapter ranks per slot: rank 8 and rank 16 adapters side by side, slot 3 empty.
RANKS = {0: 8, 1: 16, 2: 8}


def a_weights(inp: int, n: int, gen, ranks=RANKS, dtype=torch.float32):
    return tuple(stacked(RANK, inp, ranks, gen, dtype) for _ in range(n))


def b_weights(outs: tuple[int, ...], gen, ranks=RANKS, dtype=torch.float32):
    return tuple(stacked(o, RANK, ranks, gen, dtype) for o in outs)


# Requests as (adapter id or 0 for none, prompt tokens). Prefill: every token of each request;
# decode: one token a request. Several adapters, base requests among them, an adapter whose
# requests are not next to each other (rows gathered by index) and one that is (a slice).
MIXES = {
    "three adapters and the base": [(11, 3), (0, 2), (12, 4), (11, 1), (13, 2), (0, 1)],
    "one adapter": [(12, 3), (12, 2)],
    "one adapter and the base": [(0, 2), (13, 3), (0, 1)],
}


def mapping(mix, prefill: bool) -> LoRAMapping:
    tokens = [lid for lid, n in mix for _ in range(n if prefill else 1)]
    return LoRAMapping(tuple(tokens), tuple(lid for lid, _ in mix), is_prefill=prefill)


def wrappers(m: LoRAMapping) -> tuple[PunicaWrapperCPU, GroupedPunicaWrapperCPU]:
    """The stock wrapper and the grouped one, given the same batch metadata (vLLM passes
    ``max_loras + 1`` and the vocabulary size)."""
    pair = (PunicaWrapperCPU(256, 16, "cpu"), GroupedPunicaWrapperCPU(256, 16, "cpu"))
    for w in pair:
        w.update_metadata(m, LORA_IDS, MAX_LORAS + 1, VOCAB)
    return pair


CASES = [(mix, prefill) for mix in MIXES for prefill in (True, False)]
IDS = [f"{mix}-{'prefill' if p else 'decode'}" for mix, p in CASES]


# ---------------------------------------------------------------------------- grouping by hand


def test_tokens_are_grouped_by_slot_as_slices_when_contiguous():
    # slot 1 at rows 0, 1, 4 and slot 0 at 3, 5, 6: index tensors; row 2 has no adapter.
    groups = lora_groups(torch.tensor([1, 1, -1, 0, 1, 0, 0]))
    assert [(g.slot, g.size) for g in groups] == [(0, 3), (1, 3)]
    assert groups[0].rows.tolist() == [3, 5, 6] and groups[1].rows.tolist() == [0, 1, 4]
    (g,) = lora_groups(torch.tensor([2, 2, 2, -1]))
    assert (g.slot, g.rows, g.size) == (2, slice(0, 3), 3)
    assert lora_groups(torch.tensor([-1, -1])) == () and lora_groups(torch.tensor([], dtype=torch.long)) == ()


def test_linear_by_hand():
    # One token x = [1, 2], slot 1 of two, rank 1, two output slices of widths 1 and 2, scale 2:
    #   slice 0: A = [3, 1] → x·Aᵀ = 1·3 + 2·1 = 5, ·2 = 10; B = [[0.5]] → 10·0.5 = 5
    #   slice 1: A = [0, 1] → 2, ·2 = 4;                      B = [[1], [-1]] → [4, -4]
    # added to y = [1, 1, 1] → [6, 5, -3]. Token 1 has no adapter (slot -1): y stays [1, 1, 1].
    a0 = torch.zeros(2, 1, 1, 2)
    a0[1, 0] = torch.tensor([3.0, 1.0])
    a1 = torch.zeros(2, 1, 1, 2)
    a1[1, 0] = torch.tensor([0.0, 1.0])
    b0 = torch.zeros(2, 1, 1, 1)
    b0[1, 0] = torch.tensor([[0.5]])
    b1 = torch.zeros(2, 1, 2, 1)
    b1[1, 0] = torch.tensor([[1.0], [-1.0]])
    y = torch.ones(2, 3)
    x = torch.tensor([[1.0, 2.0], [7.0, 7.0]])
    linear(y, x, (a0, a1), (b0, b1), 2.0, (1, 2), lora_groups(torch.tensor([1, -1])))
    assert y.tolist() == [[6.0, 5.0, -3.0], [1.0, 1.0, 1.0]]


# ------------------------------------------------------- the wrapper against vLLM's stock wrapper


@pytest.mark.parametrize(("mix", "prefill"), CASES, ids=IDS)
@pytest.mark.parametrize("outs", [QKV, GATE_UP, (HIDDEN,)], ids=["qkv", "gate_up", "single"])
def test_add_lora_linear_equals_the_stock_op(mix, prefill, outs):
    gen = torch.Generator().manual_seed(1)
    stock, grouped = wrappers(mapping(MIXES[mix], prefill))
    tokens = stock.token_lora_indices.shape[0]
    x = torch.randn(tokens, HIDDEN, generator=gen)
    y0 = torch.randn(tokens, sum(outs), generator=gen)
    a, b = a_weights(HIDDEN, len(outs), gen), b_weights(outs, gen)
    ys, yg = y0.clone(), y0.clone()
    stock.add_lora_linear(ys, x, a, b, 1.0, outs)
    grouped.add_lora_linear(yg, x, a, b, 1.0, outs)
    assert_close(yg, ys)
    assert not torch.equal(yg, y0)  # the adapters changed the output


@pytest.mark.parametrize(("mix", "prefill"), CASES, ids=IDS)
def test_shrink_then_expand_equals_the_stock_op(mix, prefill):
    # vLLM's row-parallel layers (o_proj, down_proj): add_shrink into a zeroed float32 buffer,
    # then add_expand from it into the output at offset 0.
    gen = torch.Generator().manual_seed(2)
    stock, grouped = wrappers(mapping(MIXES[mix], prefill))
    tokens = stock.token_lora_indices.shape[0]
    x = torch.randn(tokens, 40, generator=gen)
    y0 = torch.randn(tokens, HIDDEN, generator=gen)
    a, b = a_weights(40, 1, gen), b_weights((HIDDEN,), gen)
    out = {}
    for name, w in (("stock", stock), ("grouped", grouped)):
        buf = torch.zeros(1, tokens, RANK)
        w.add_shrink(buf, x, a, 1.0)
        y = y0.clone()
        w.add_expand(y, buf, b, (HIDDEN,), offset_start=0)
        out[name] = (buf, y)
    assert_close(out["grouped"][0], out["stock"][0])
    assert_close(out["grouped"][1], out["stock"][1])


@pytest.mark.parametrize(("mix", "prefill"), CASES, ids=IDS)
def test_embedding_and_logits_equal_the_stock_op(mix, prefill):
    gen = torch.Generator().manual_seed(3)
    stock, grouped = wrappers(mapping(MIXES[mix], prefill))
    tokens = stock.token_lora_indices.shape[0]
    # The embedding's expand: y (tokens, hidden) += lora_a rows (tokens, R) · Bᵀ.
    emb_x = torch.randn(tokens, RANK, generator=gen)
    emb_b = stacked(HIDDEN, RANK, RANKS, gen)
    y0 = torch.randn(tokens, HIDDEN, generator=gen)
    ys, yg = y0.clone(), y0.clone()
    stock.add_lora_embedding(ys, emb_x, emb_b)
    grouped.add_lora_embedding(yg, emb_x, emb_b)
    assert_close(yg, ys)
    # The logits: one row a request (the sampled position), B padded 4 wider than the logits.
    rows = stock.sampler_indices.shape[0]
    h = torch.randn(rows, HIDDEN, generator=gen)
    la, lb = stacked(RANK, HIDDEN, RANKS, gen), stacked(VOCAB + 4, RANK, RANKS, gen)
    l0 = torch.randn(rows, VOCAB, generator=gen)
    ls, lg = l0.clone(), l0.clone()
    stock.add_lora_logits(ls, h, la, lb, 1.0)
    grouped.add_lora_logits(lg, h, la, lb, 1.0)
    assert_close(lg, ls)


def test_a_token_with_no_adapter_gets_no_delta_even_beside_a_full_table():
    # Every slot filled (4 adapters active, max_loras 4) and a base token among them: the stock
    # op indexes its weights with the base token's slot -1, the last slot, and adds adapter 14's
    # delta to it; the grouped op leaves its output as the base layer computed it.
    gen = torch.Generator().manual_seed(4)
    full = {0: 8, 1: 8, 2: 8, 3: 8}
    m = LoRAMapping((11, 0, 14), (11, 0, 14), is_prefill=False)
    stock, grouped = (cls(256, 16, "cpu") for cls in (PunicaWrapperCPU, GroupedPunicaWrapperCPU))
    for w in (stock, grouped):
        w.update_metadata(m, [11, 12, 13, 14], MAX_LORAS + 1, VOCAB)
    x = torch.randn(3, HIDDEN, generator=gen)
    a, b = a_weights(HIDDEN, 1, gen, full), b_weights((HIDDEN,), gen, full)
    y0 = torch.randn(3, HIDDEN, generator=gen)
    ys, yg = y0.clone(), y0.clone()
    stock.add_lora_linear(ys, x, a, b, 1.0, (HIDDEN,))
    grouped.add_lora_linear(yg, x, a, b, 1.0, (HIDDEN,))
    assert torch.equal(yg[1], y0[1])  # base token: untouched
    last = x[1] @ a[0][3, 0].t() @ b[0][3, 0].t()
    assert_close(ys[1], y0[1] + last)  # the stock op: the last slot's delta
    assert_close(yg[[0, 2]], ys[[0, 2]])  # the adapters' tokens agree


def test_a_batch_without_adapters_does_no_lora_work():
    m = LoRAMapping((0, 0, 0), (0,), is_prefill=True)
    grouped = GroupedPunicaWrapperCPU(256, 16, "cpu")
    grouped.update_metadata(m, LORA_IDS, MAX_LORAS + 1, VOCAB)
    gen = torch.Generator().manual_seed(5)
    x, y0 = torch.randn(3, HIDDEN, generator=gen), torch.randn(3, sum(QKV), generator=gen)
    y, buf, logits = y0.clone(), torch.zeros(1, 3, RANK), torch.zeros(1, VOCAB)
    a, b, lb = a_weights(HIDDEN, 3, gen), b_weights(QKV, gen), stacked(VOCAB, RANK, RANKS, gen)
    emb, row = buf[0], x[:1]
    # Grouping reads the metadata once per batch layout; every layer's call after it is free.
    assert grouped.token_groups == () and grouped.sampler_groups == ()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grouped.add_lora_linear(y, x, a, b, 1.0, QKV)
        grouped.add_shrink(buf, x, a[:1], 1.0)
        grouped.add_expand(y, buf, b[:1], (QKV[0],))
        grouped.add_lora_embedding(y, emb, b[0])
        grouped.add_lora_logits(logits, row, a[0], lb, 1.0)
    assert [e.name for e in prof.events() if e.name.startswith("aten::")] == []  # no operator ran
    assert torch.equal(y, y0) and not buf.any() and not logits.any()


def test_bf16_outputs_equal_the_stock_op():
    # bf16 serving: both ops shrink in float32 and expand in bf16 (the stock op's casts).
    gen = torch.Generator().manual_seed(6)
    stock, grouped = wrappers(mapping(MIXES["three adapters and the base"], False))
    tokens = stock.token_lora_indices.shape[0]
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
    y0 = torch.randn(tokens, sum(QKV), generator=gen).bfloat16()
    a = a_weights(HIDDEN, 3, gen, dtype=torch.bfloat16)
    b = b_weights(QKV, gen, dtype=torch.bfloat16)
    ys, yg = y0.clone(), y0.clone()
    stock.add_lora_linear(ys, x, a, b, 1.0, QKV)
    grouped.add_lora_linear(yg, x, a, b, 1.0, QKV)
    assert_close(yg, ys, rtol=1.6e-2, atol=1e-2)


def test_new_weights_in_a_slot_are_used_at_the_next_call():
    # vLLM's set_lora writes a slot in place; the grouped op's prepared matrices follow.
    gen = torch.Generator().manual_seed(7)
    stock, grouped = wrappers(mapping(MIXES["one adapter"], False))
    x = torch.randn(2, HIDDEN, generator=gen)
    a, b = a_weights(HIDDEN, 1, gen), b_weights((HIDDEN,), gen)
    for _ in range(2):
        ys, yg = torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN)
        stock.add_lora_linear(ys, x, a, b, 1.0, (HIDDEN,))
        grouped.add_lora_linear(yg, x, a, b, 1.0, (HIDDEN,))
        assert_close(yg, ys)
        a[0][1, 0, :4].copy_(torch.randn(4, HIDDEN, generator=gen))  # slot 1: another adapter
        b[0][1].zero_()
        b[0][1, 0, :, :4] = torch.randn(HIDDEN, 4, generator=gen)
    # A slot whose B is zero (an adapter that does not target this module) costs nothing.
    b[0][1].zero_()
    assert SlotWeights().linear(a, b, 1, (HIDDEN,), torch.float32) is None


# ------------------------------------------------------ the functions against vLLM's stock ops


@pytest.mark.parametrize("prefill", [True, False], ids=["sgmv", "bgmv"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_shrink_equals_the_stock_shrink(prefill, scale):
    gen = torch.Generator().manual_seed(8)
    stock, _ = wrappers(mapping(MIXES["three adapters and the base"], prefill))
    indices = stock.token_lora_indices
    x = torch.randn(indices.shape[0], HIDDEN, generator=gen)
    (a,) = a_weights(HIDDEN, 1, gen)
    ys = torch.randn(indices.shape[0], RANK, generator=gen)
    yg = torch.randn(indices.shape[0], RANK, generator=gen)  # the shrink assigns every row
    if prefill:
        sgmv_shrink(x, a, ys, *stock.prefill_metadata, scale)
    else:
        bgmv_shrink(x, a, ys, indices, scale)
    shrink(yg, x, a, lora_groups(indices), scale)
    assert_close(yg, ys)


@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("prefill", [True, False], ids=["sgmv", "bgmv"])
def test_expand_slice_equals_the_stock_expand(prefill, add_inputs):
    # The k slice of a fused qkv output: columns 24..31 of 40.
    gen = torch.Generator().manual_seed(9)
    stock, _ = wrappers(mapping(MIXES["three adapters and the base"], prefill))
    indices = stock.token_lora_indices
    x = torch.randn(indices.shape[0], RANK, generator=gen)
    (b,) = b_weights((QKV[1],), gen)
    y0 = torch.randn(indices.shape[0], sum(QKV), generator=gen)
    ys, yg = y0.clone(), y0.clone()
    if prefill:
        sgmv_expand_slice(x, b, ys, *stock.prefill_metadata, QKV[0], QKV[1], add_inputs)
    else:
        bgmv_expand_slice(x, b, ys, indices, QKV[0], QKV[1], add_inputs)
    expand(yg, x, b, lora_groups(indices), QKV[0], QKV[1], add_inputs)
    assert_close(yg, ys)
    # The whole-width expand cuts B to the output's width, as bgmv_expand's common_len does.
    (wide,) = b_weights((sum(QKV) + 3,), gen)
    ys, yg = y0.clone(), y0.clone()
    bgmv_expand(x, wide, ys, indices, add_inputs)
    expand(yg, x, wide, lora_groups(indices), add_inputs=add_inputs)
    assert_close(yg, ys)


# ----------------------------------------------------------------------- the version guard


def test_the_guard_refuses_another_vllm_and_gpu_builds():
    assert refusal(PINNED_VLLM, cpu=True) is None
    assert refusal("0.33.0", cpu=True) == (
        "vLLM 0.33.0 is not 0.32.0, the version the grouped LoRA op was checked against: "
        "vLLM's own op serves LoRA (slower)"
    )
    assert refusal(PINNED_VLLM, cpu=False) == "not a CPU engine: vLLM's Punica kernels serve LoRA"


class FakeWorker(PolicyReloadExtension):
    """A worker as the extension sees one: a model runner whose model's LoRA layers share one
    Punica wrapper (a unit test's small fake; the engine test uses vLLM's worker)."""

    def __init__(self, wrapper) -> None:
        layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        for layer in layers:
            layer.punica_wrapper = wrapper
        self.model_runner = type("Runner", (), {"get_model": lambda _self: layers})()


def test_the_extension_installs_and_removes_the_grouped_op_in_place(monkeypatch):
    import vllm

    wrapper = PunicaWrapperCPU(256, 16, "cpu")
    worker = FakeWorker(wrapper)
    assert worker.use_lora_op(LoraOp.GROUPED) == ("grouped", "")
    assert type(wrapper) is GroupedPunicaWrapperCPU
    assert worker.use_lora_op(LoraOp.STOCK) == ("stock", "")
    assert type(wrapper) is PunicaWrapperCPU
    with pytest.raises(ValueError, match="'fast' is not a valid LoraOp"):
        worker.use_lora_op("fast")
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    op, why = worker.use_lora_op(LoraOp.GROUPED)
    assert op == "stock" and why.startswith("vLLM 0.33.0 is not 0.32.0")
    assert type(wrapper) is PunicaWrapperCPU  # refused: vLLM's own op serves on
    assert FakeWorker(None).use_lora_op(LoraOp.GROUPED) == ("stock", "the engine has no LoRA layers")
