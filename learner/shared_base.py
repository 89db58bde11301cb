"""One frozen base model under many LoRA learners: views that share its tensors, and a critic
that lives on them.

Source: Hu et al., "LoRA" (2021): an adapter never changes the base weights ``W``, so N adapters
can share one ``W``; the multi-tenant learners of SkyRL's Tinker API, prime-rl's multi-run manager
and tinker-cloud's pool (issue 39) train many adapters on one base the same way. docs/tenants.md
("Many tenants in one learner"), docs/design.md §5.2 and §7.8.

``SharedBase`` loads the base causal LM once and hands out *views*: structural copies of it (their
own module objects, into which PEFT injects one learner's LoRA layers) whose parameters and
buffers are the base's own ``Parameter`` objects (``copy.deepcopy`` with them in its memo). So N
learners hold one set of base tensors (``data_ptr`` equal across views) and each its own adapter,
critic adapter, value head and optimizer states.

**The critic deviates from the paper here.** SAO's critic trains its body's MLP projections
(``learner.algo.critic``, ``trainable="mlp"``): a body that trains cannot be shared, so the paper's
critic per tenant is a base copy per tenant. ``adapter_critic`` instead builds a critic on a view
of the base's body, frozen whole (``ValueModel(trainable="head")``), with a LoRA adapter on its
MLP projections (gate, up, down; the policy's rank and α, A from ``learner.models.lora.INIT_SEED``, B = 0)
and the float32 value head trained at the config's critic rate. At B = 0 it computes what the
paper's critic does before its first update; what it can fit is bounded by the adapter's rank.

dtype: views share ``Parameter`` objects, so casting one view casts them all. Every learner is
built with the base in float32 (``build`` upcasts it first: bf16 values are exact in float32) and
its constructor casts as a lone learner's does; with ``bf16`` that is float32 → bf16 of the same
values each time, so all views compute on one bf16 base and each adapter starts exactly as a lone
learner's (A drawn in float32).
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers import PreTrainedModel

from learner.algo.algorithm import Algorithm
from learner.algo.critic import ValueModel
from learner.algo.sao import SAOLearner
from learner.algo.spo import SPOLearner
from learner.config import LearnerConfig, LoraPolicy, RunningMeanAlgorithm, SAOAlgorithm, SPOAlgorithm
from learner.models.lora import ADAPTER_NAME, INIT_SEED

CRITIC_TARGETS = ("gate_proj", "up_proj", "down_proj")
"""The projections the critic's adapter adapts: the MLP projections SAO's critic trains."""


class AdapterCritic(ValueModel):
    """The SAO critic on a shared frozen body: a LoRA adapter on ``CRITIC_TARGETS`` plus the value
    head (module docstring; ``learner.algo.critic.ValueModel`` for the values' alignment).

    Args (constructor):
        body: a causal LM's body (``model.base_model``), frozen by the caller or here; the adapter
            is injected into it in place (PEFT's ``inject_adapter_in_model``).
        hidden_size: the body's hidden size (the head's input).
        lora: the policy's ``LoraPolicy``: its rank, α and scaling rule (``rslora``) are the critic
            adapter's.
        head_bias, head_std: as ``ValueModel``.

    ``state_dict`` and ``load_state_dict`` cover the critic's own tensors only (every A and B and
    the head): the body is the base's, never checkpointed per learner.

    Raises (constructor): ValueError from PEFT when the body has no ``CRITIC_TARGETS``.
    """

    def __init__(
        self,
        body: torch.nn.Module,
        hidden_size: int,
        lora: LoraPolicy,
        head_bias: float = 0.5,
        head_std: float = 0.0,
    ) -> None:
        super().__init__(body, hidden_size, "head", head_bias, head_std)
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            target_modules=list(CRITIC_TARGETS),
            lora_dropout=0.0,
            use_rslora=lora.rslora,
            bias="none",
        )
        devices = [self.head.weight.device] if self.head.weight.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(INIT_SEED)
            inject_adapter_in_model(config, body, adapter_name=ADAPTER_NAME)
        self.eval()

    def own_names(self) -> set[str]:
        """The names of the critic's trained tensors (``lora_A``/``lora_B`` and ``head.*``)."""
        return {n for n, p in self.named_parameters() if p.requires_grad}

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The critic's own tensors (``own_names``) under ``prefix``; the shared body left out."""
        own = self.own_names()
        full = super().state_dict(prefix=prefix, keep_vars=keep_vars)
        out = {k: v for k, v in full.items() if k.removeprefix(prefix) in own}
        if destination is None:
            return out
        destination.update(out)
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a ``state_dict()`` of an adapter critic of the same shape.

        Raises:
            ValueError: its keys are not exactly ``own_names()`` (a critic of the paper's form,
                such as ``saoserve pretrain-critic`` writes, holds the body and loads into a
                ``ValueModel`` only).
            RuntimeError: from torch, a tensor of another shape.
        """
        own = self.own_names()
        unknown, missing = sorted(state_dict.keys() - own), sorted(own - state_dict.keys())
        if unknown or missing:
            raise ValueError(
                f"an adapter critic holds its adapter and value head only: {len(unknown)} unexpected "
                f"and {len(missing)} missing tensors ({(unknown + missing)[:4]})"
            )
        return super().load_state_dict(state_dict, strict=False, assign=assign)


class SharedBase:
    """One frozen base causal LM and the learners built on views of it (module docstring).

    Args (constructor):
        model: the base (a transformers causal LM); cast to float32, eval mode, every parameter
            frozen (``requires_grad`` False), in place.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.float().eval().requires_grad_(False)

    @classmethod
    def load(cls, base_dir: str | Path) -> SharedBase:
        """The base model of the folder ``base_dir`` (float32). Raises OSError from transformers
        when it is not a model folder."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))

    def view(self) -> PreTrainedModel:
        """A structural copy of the base whose parameters and buffers are the base's objects."""
        memo = {id(t): t for t in itertools.chain(self.model.parameters(), self.model.buffers())}
        return copy.deepcopy(self.model, memo)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The base's parameters by name (what every view shares)."""
        return dict(self.model.named_parameters())

    def adapter_critic(self, lora: LoraPolicy) -> AdapterCritic:
        """A fresh ``AdapterCritic`` on a view of the base's body."""
        return AdapterCritic(self.view().base_model, self.model.config.hidden_size, lora)

    def build(self, config: LearnerConfig) -> Algorithm:
        """A learner for ``config`` on views of the base, in this process on ``config.device``:
        SAO with an ``AdapterCritic``, the running-mean baseline, or SPO++; a LoRA policy only.
        The base is put back to float32 first (module docstring, dtype).

        Raises:
            ValueError: a full-weights policy (it would train the shared base), or an SAO critic
                that trains its body in full (``critic_trainable`` ``all``).
            learner.models.device.DeviceError: ``config.device`` is not here.
        """
        if not isinstance(config.policy, LoraPolicy):
            raise ValueError("learners on a shared base train LoRA adapters: the config's policy is 'full'")
        algo = config.algorithm
        if isinstance(algo, SAOAlgorithm) and algo.critic_trainable != "mlp":
            raise ValueError(
                f"learners on a shared base give the critic an adapter on its MLP projections; "
                f"critic_trainable {algo.critic_trainable!r} would train the shared body"
            )
        self.model.float()
        if isinstance(algo, SPOAlgorithm):
            return SPOLearner(config, self.view())
        critic = self.adapter_critic(config.policy) if not isinstance(algo, RunningMeanAlgorithm) else None
        return SAOLearner(config, self.view(), critic)
