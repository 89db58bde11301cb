"""A LoRA adapter on the policy: wrapping, its trainable parameters, its state and files, merging.

Source: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021): each targeted
projection ``W`` ([out, in]) computes ``W x + (α/r)·B A x`` with ``A`` [r, in] and ``B`` [out, r]
trained and ``W`` frozen; ``B`` starts at 0, so the adapted policy starts equal to the base.
"LoRA Without Regret" (Schulman et al., 2025) for the settings (all projections, α = 32, ~10x the
full fine-tuning learning rate; ``learner.config.LoraPolicy``). The PEFT library (pinned in
pyproject.toml) injects the layers; docs/lora.md, docs/design.md §7.8.

``Adapter(policy, config)`` injects the LoRA layers into ``policy`` in place: the learners keep
training and evaluating ``policy`` itself (a transformers model, as with full fine-tuning, so
``learner.data.batch.policy_logprobs`` and the gate take it unchanged) while ``Adapter`` holds PEFT's
wrapper for what only it can do: run the base model with the adapter switched off (the KL
anchor's reference, ``disabled``), and the adapter's state and files in PEFT's layout (the
tensors ``get_peft_model_state_dict`` names, ``adapter_model.safetensors`` and
``adapter_config.json`` as ``PeftModel.save_pretrained`` writes them, which vLLM's
``LoRARequest`` loads: ``core.policy_store``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from torch.distributed.tensor.experimental import implicit_replication
from transformers import PreTrainedModel

from core.policy_store import ADAPTER_FILE
from learner.config import LoraPolicy
from learner.models.placement import full_tensor

ADAPTER_NAME = "default"
"""PEFT's name for a model's one adapter (its files then sit at the folder's top level)."""
INIT_SEED = 0
"""Seed of A's initialisation: every learner built from the same config starts from the same
adapter, so the base version (B = 0) is one state whatever process rebuilds it."""


class Adapter:
    """The LoRA adapter of one policy (module docstring).

    Args (constructor):
        policy: a transformers causal LM (Llama family: ``config.target_modules`` must name its
            projections); the LoRA layers are injected into it in place, its base weights frozen
            (``requires_grad`` False). A (Kaiming-uniform, as PEFT) and B (zeros) are float32 in
            the policy's device, drawn from ``INIT_SEED`` without touching the global RNG.
        config: the validated ``LoraPolicy``.

    Raises (constructor): ValueError from PEFT when a target module is not in the model.
    """

    def __init__(self, policy: PreTrainedModel, config: LoraPolicy) -> None:
        peft_config = LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            target_modules=list(config.target_modules),
            lora_dropout=config.dropout,
            use_rslora=config.rslora,
            bias="none",
            task_type="CAUSAL_LM",
        )
        devices = [policy.device] if policy.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(INIT_SEED)
            self.peft: PeftModel = get_peft_model(policy, peft_config, adapter_name=ADAPTER_NAME)
        self.model = policy
        self.config = config
        self.initial = {k: v.clone() for k, v in self.state().items()}

    def parameters(self) -> list[torch.nn.Parameter]:
        """The adapter's trainable tensors (every A and B), in the model's parameter order."""
        return [p for n, p in self.model.named_parameters() if p.requires_grad and "lora_" in n]

    def lr_scales(self) -> list[float]:
        """Each of ``parameters()``' learning rate over the adapter's ``lr``, in that order:
        ``config.b_lr_ratio`` for a B, 1 for an A (LoRA+, ``LoraPolicy.b_lr_ratio``)."""
        ratio = self.config.b_lr_ratio
        return [
            ratio if ".lora_B." in n else 1.0
            for n, p in self.model.named_parameters()
            if p.requires_grad and "lora_" in n
        ]

    def numel(self) -> int:
        """Trainable parameters: r·(in + out) per targeted projection."""
        return sum(p.numel() for p in self.parameters())

    def state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by PEFT's names (``base_model.model.<module>.lora_A.weight``, no
        adapter name: the keys of ``adapter_model.safetensors``), detached, not copied."""
        return {
            k: v.detach() for k, v in get_peft_model_state_dict(self.peft, adapter_name=ADAPTER_NAME).items()
        }

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the adapter to ``state`` (keys and shapes as ``state()``; cast to each tensor's dtype).

        Raises:
            ValueError: a key of ``state`` is not one of this adapter's, or one of its tensors is
                missing (another rank or target set gives another shape: RuntimeError from torch).
        """
        want = self.state()
        unknown, missing = sorted(state.keys() - want.keys()), sorted(want.keys() - state.keys())
        if unknown or missing:
            shown = (unknown + missing)[:4]
            raise ValueError(
                f"adapter state mismatch: {len(unknown)} unexpected, {len(missing)} missing tensors ({shown})"
            )
        for k, v in state.items():
            if v.shape != want[k].shape:
                raise ValueError(
                    f"adapter tensor {k} has shape {list(v.shape)}, this adapter {list(want[k].shape)}"
                )
        # Whole tensors into a sharded policy keep each rank's shard (learner.models.placement.load_full).
        with implicit_replication():
            set_peft_model_state_dict(
                self.peft, {k: v.to(want[k].dtype) for k, v in state.items()}, ADAPTER_NAME
            )

    def reset(self) -> None:
        """Back to the initial adapter (B = 0: the policy equals the base model, version 0)."""
        self.load_state(self.initial)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """A context in which the policy computes as the base model (PEFT's ``disable_adapter``):
        the KL anchor's reference, with no second copy of the weights."""
        with self.peft.disable_adapter():
            yield

    def tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The adapter's tensors under the wrapper's own names (with the adapter name, which
        ``save_pretrained`` filters and renames as it does its own state dict), whole
        (``learner.models.placement.full_tensor``: with N ranks every rank calls this in step), as CPU
        copies in ``dtype``, for writing."""
        return {
            k: full_tensor(v.detach()).to(device="cpu", dtype=dtype, copy=True)
            for k, v in self.peft.state_dict().items()
            if "lora_" in k
        }

    def save(self, folder: Path, dtype: torch.dtype) -> Path:
        """Write the adapter into ``folder`` (created if needed) with its tensors cast to ``dtype``,
        by ``PeftModel.save_pretrained``: ``adapter_model.safetensors``, ``adapter_config.json``
        (``base_model_name_or_path``: the base model's directory) and PEFT's ``README.md``.
        Returns the safetensors file's path. Raises OSError when the folder cannot be written."""
        folder = Path(folder)
        self.peft.save_pretrained(str(folder), state_dict=self.tensors(dtype))
        return folder / ADAPTER_FILE

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The base model's state dict with every adapted weight replaced by ``W + (α/r)·B·A``
        (float32 copies; names as the plain model's, e.g. ``model.layers.0.self_attn.q_proj.weight``),
        the model left unchanged: the full weights that compute what the adapter model does."""
        out: dict[str, torch.Tensor] = {}
        prefix = "base_model.model."
        for name, module in self.peft.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                a = module.lora_A[ADAPTER_NAME].weight.float()
                b = module.lora_B[ADAPTER_NAME].weight.float()
                w = module.get_base_layer().weight.float()
                out[name.removeprefix(prefix) + ".weight"] = w + module.scaling[ADAPTER_NAME] * (b @ a)
        for name, value in self.peft.get_base_model().state_dict().items():
            if "lora_" in name:
                continue
            plain = name.replace(".base_layer.", ".")
            out.setdefault(plain, value.detach().float().clone())
        return out
