"""The grouped LoRA op on the real engine (issue 39; ``server.grouped_lora``): a batch mixing the
base weights and two adapters is served with the same tokens and logprobs by the grouped op and by
vLLM's stock op, switched on one engine (``PolicyEngine.use_lora_op``). Once every one of vLLM's
``max_loras`` active slots holds an adapter (vLLM activates an adapter when it is added), the base
requests keep the base model's logprobs under the grouped op, where the stock op gives them the
last slot's adapter.

One LoRA engine for the module: 3 active slots (``max_loras``), 4 loaded, rank ≤ 16, adapters of
rank 8 on all seven projections. Run under the engine lock:

    flock /tmp/saoserve-engine.lock .venv/bin/pytest -q -p no:cacheprovider tests/integration/test_grouped_lora_engine.py
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from core.records import SamplingRecord
from core.settings import AdapterServing
from core.weights import weights_sha256
from server.grouped_lora import LoraOp

PROMPT = [{"role": "user", "content": "Write two sentences about the sea."}]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The project's bound for served logprobs against another computation of them (float32).
LOGPROB_NATS = 1e-4


def write_adapters(model_dir: Path, folders: list[Path], seed: int) -> None:
    """PEFT adapters of rank 8 on the real model, A and B random (B ≠ 0: they change the logprobs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=MODULES))
    gen = torch.Generator().manual_seed(seed)
    for folder in folders:
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        peft.save_pretrained(folder)


@pytest.fixture(scope="module")
async def engine(model_dir, tmp_path_factory):
    """The LoRA engine serving adapters a and b as versions 1 (pinned) and 2 (current): two of the
    three active slots, the last one empty; version 0 is the base weights. Yields the engine and
    adapter c's folder."""
    from core.settings import Settings
    from server.engine import PolicyEngine

    root = tmp_path_factory.mktemp("grouped-adapters")
    folders = [root / n for n in "abc"]
    write_adapters(model_dir, folders, seed=3)
    settings = Settings(
        home=tmp_path_factory.mktemp("grouped-engine"),
        model_dir=model_dir,
        kv_cache_gib=1.0,
        adapter_serving=AdapterServing.ADAPTER,
        max_loras=3,
        max_lora_rank=16,
        max_cpu_loras=4,
    )
    eng = await PolicyEngine.start(settings, model_dir)
    try:
        for version, folder in enumerate(folders[:2], start=1):
            await eng.swap(version, folder, weights_sha256(folder))
            eng.pin(version)
        yield eng, folders[2]
    finally:
        eng.shutdown()


async def batch(eng, versions: list[int]) -> list[tuple[list[int], list[float]]]:
    """One request a version, all in flight at once (one vLLM batch: prefill, then decode),
    sampled at temperature 1 with seed 100 + i: ``(token ids, logprobs)`` of each."""
    prompt = eng.render(PROMPT)
    started = [asyncio.Event() for _ in versions]

    async def one(i: int, version: int):
        ids, lps = [], []
        sampling = SamplingRecord(temperature=1.0, max_tokens=16, seed=100 + i)
        async for d in eng.generate(prompt, sampling, version=version, ignore_eos=True):
            started[i].set()
            ids += d.token_ids
            lps += d.logprobs
        return ids, lps

    runs = [asyncio.create_task(one(i, v)) for i, v in enumerate(versions)]
    await asyncio.gather(*(e.wait() for e in started))
    assert not any(r.done() for r in runs)  # all in flight together: batched
    return await asyncio.gather(*runs)


def gap(x: list[float], y: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(x, y, strict=True))


@pytest.mark.engine
async def test_the_grouped_op_serves_what_the_stock_op_serves(engine, record_property):
    engine, _ = engine
    assert engine.lora_op is LoraOp.GROUPED  # installed at start
    # Base, a, b twice each: two adapters and the base in one batch, the third slot empty.
    versions = [0, 1, 2, 0, 1, 2]
    grouped = await batch(engine, versions)
    assert await engine.use_lora_op(LoraOp.STOCK) is LoraOp.STOCK
    try:
        stock = await batch(engine, versions)
    finally:
        assert await engine.use_lora_op(LoraOp.GROUPED) is LoraOp.GROUPED
    worst = 0.0
    for (ids_g, lps_g), (ids_s, lps_s) in zip(grouped, stock, strict=True):
        assert ids_g == ids_s and len(ids_g) == 16
        worst = max(worst, gap(lps_g, lps_s))
    record_property("grouped_vs_stock_nats", worst)
    assert worst < LOGPROB_NATS
    # The adapters are in effect: the same seed gives another answer under a than on the base.
    assert grouped[1][0] != grouped[0][0] or gap(grouped[1][1], grouped[0][1]) > 1e-2


def base_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> list[float]:
    """Teacher-forced log softmax of each response token under transformers, base model, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


@pytest.mark.engine
async def test_base_requests_beside_a_full_table_of_adapters_keep_the_base_logprobs(engine, model_dir):
    engine, c = engine
    await engine.swap(3, c, weights_sha256(c))  # a, b, c: every active slot taken
    prompt = engine.render(PROMPT)
    grouped = await batch(engine, [1, 0, 2, 3])
    ids, lps = grouped[1]
    assert gap(lps, base_logprobs(model_dir, prompt, ids)) < LOGPROB_NATS
    await engine.use_lora_op(LoraOp.STOCK)
    try:
        stock = await batch(engine, [1, 0, 2, 3])
    finally:
        await engine.use_lora_op(LoraOp.GROUPED)
    # The stock op reads the base request's slot -1 as the last slot, adapter c's or b's.
    ids, lps = stock[1]
    assert gap(lps, base_logprobs(model_dir, prompt, ids)) > 1e-2
