"""LoRA adapters written for a test or a benchmark: a toy adapter over a toy weights layout
(``toy_layout``, ``write_toy_adapter``) and random PEFT adapters on the real model
(``write_adapters``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.policy_store import ADAPTER_CONFIG, ADAPTER_FILE
from core.weights import TensorSpec, WeightsLayout

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


PROMPT = [{"role": "user", "content": "Write two sentences about the sea."}]


def toy_layout() -> WeightsLayout:
    return WeightsLayout(
        tensors={
            "model.layers.0.self_attn.q_proj.weight": TensorSpec("F32", (4, 3)),
            "model.layers.0.mlp.up_proj.weight": TensorSpec("F32", (5, 3)),
            "model.norm.weight": TensorSpec("F32", (3,)),
        },
        optional={},
        dtypes=frozenset({"F32"}),
    )


def write_toy_adapter(folder: Path, rank: int = 2, alpha: int = 4, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{pre}.lora_A.weight": torch.ones(rank, 3), f"{pre}.lora_B.weight": torch.ones(4, rank)}
    save_file(tensors, folder / ADAPTER_FILE)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj"], "bias": "none"}
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**cfg, **config}))
    return folder


def write_adapters(
    model_dir: Path, folders: list[Path], rank: int = 8, modules=ALL_MODULES, seed: int = 0
) -> None:
    """PEFT adapters on the real model: A and B drawn at random (B ≠ 0, so the logprobs change),
    one per folder, saved with ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(modules)))
    gen = torch.Generator().manual_seed(seed)
    for folder in folders:
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        peft.save_pretrained(folder)
