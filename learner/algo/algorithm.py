"""The contract every learner algorithm implements.

``learner.process`` drives any algorithm through ``Algorithm`` only: it builds one from the
run's validated ``LearnerConfig`` (``learner.algo.registry.build_algorithm``: the config's algorithm
model names the class), calls ``step(batch)`` for the metrics of one update, publishes
``policy_weights``, checkpoints ``state_dict`` and restores ``load_state_dict``. With a LoRA
policy (``LearnerConfig.policy``, ``learner.models.lora``) the policy's published and checkpointed
state is its adapter's, and only the adapter is trained (``attach_policy``). Adding an
algorithm is a config model in ``learner.config``, a module with its ``Algorithm`` subclass, and
one entry in ``learner.algo.registry.ALGORITHMS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from learner.config import LoraPolicy
from learner.models.placement import full_tensor, load_full
from learner.models.precision import MixedPrecisionAdamW, make_optimizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.config import LearnerConfig
    from learner.data.batch import Batch
    from learner.models.lora import Adapter
    from learner.models.placement import Placement


class Algorithm(ABC):
    """One policy-update algorithm on in-memory models.

    Attributes every implementation sets: ``config`` (the ``LearnerConfig`` it was built from),
    ``policy`` (the float32 policy it trains), ``adapter`` (its ``learner.models.lora.Adapter`` with a
    LoRA policy, else None) and ``policy_params`` (the tensors trained: all of the policy's, or
    the adapter's), all three by ``attach_policy``; ``policy_opt`` (its optimizer) and ``steps``
    (updates done).
    """

    config: LearnerConfig
    policy: PreTrainedModel
    adapter: Adapter | None
    policy_params: list[torch.nn.Parameter]
    policy_opt: torch.optim.Optimizer
    steps: int

    def attach_policy(self, policy: PreTrainedModel) -> None:
        """Take ``policy`` (cast to float32 in place, eval mode) as the one to train: with a LoRA
        ``config.policy`` its adapter is injected (``learner.models.lora.Adapter``: base weights frozen)
        and ``policy_params`` are the adapter's, else every parameter that requires a gradient.
        Raises ValueError from PEFT when a LoRA target module is not in the model."""
        self.policy = policy.float().eval()
        self.adapter = None
        if isinstance(self.config.policy, LoraPolicy):
            from learner.models.lora import Adapter

            self.adapter = Adapter(self.policy, self.config.policy)
            self.policy.eval()  # the injected layers are built in train mode
        self.find_policy_params()

    def find_policy_params(self) -> None:
        """Set ``policy_params`` from the policy as it now is: the adapter's tensors, or every
        parameter that requires a gradient. Called again once the policy is placed: sharding it
        (``learner.models.placement``) replaces its parameters."""
        if self.adapter is not None:
            self.policy_params = self.adapter.parameters()
        else:
            self.policy_params = [p for p in self.policy.parameters() if p.requires_grad]

    def make_policy_optimizer(self, masters: bool) -> torch.optim.Optimizer | MixedPrecisionAdamW:
        """The policy's optimizer at ``config.policy_lr`` (``learner.models.precision.make_optimizer``;
        ``masters``: float32 masters of a bf16 policy), a LoRA adapter's B at its own rate
        (``Adapter.lr_scales``: LoRA+'s ``b_lr_ratio``)."""
        opt = self.config.optimizer
        return make_optimizer(
            self.policy,
            self.policy_params,
            self.config.policy_lr,
            opt.weight_decay,
            opt.adam_beta1,
            masters,
            lr_scales=self.adapter.lr_scales() if self.adapter is not None else None,
        )

    @classmethod
    @abstractmethod
    def build(
        cls,
        config: LearnerConfig,
        load_policy: Callable[[], PreTrainedModel],
        placement: Placement | None = None,
    ) -> Algorithm:
        """A fresh learner for ``config``; ``load_policy()`` returns a new float32 copy of the
        base policy each call (the policy, and e.g. the KL reference or the critic's body).
        ``placement``: its device and rank (``learner.models.placement.Placement``); None: one process
        on ``config.device``."""

    @abstractmethod
    def step(self, batch: Batch) -> dict:
        """One update on ``batch``; returns metrics (JSON-able numbers, dicts of numbers).
        Raises ValueError on an invalid batch."""

    @abstractmethod
    def state_dict(self) -> dict:
        """Everything a restart needs to continue (models, optimizers, counters)."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()`` of a learner built from the same config."""

    def warm_start(self, policy_dir: Path) -> Path | None:
        """Initialise from files in ``policy_dir`` when there is no checkpoint; the file loaded,
        or None (default: none)."""
        return None

    def on_version(self, version: int) -> None:
        """The policy now is ``version`` (loaded at start, after a step, or a rollback's);
        default: nothing to do."""
        return

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Load published weights into the policy and, when the optimizer keeps float32 masters
        (``learner.models.precision``), into the masters too; returns the missing and the unexpected keys.

        Full fine-tuning: the model's state dict (``strict=False``: a tied tensor is stored once).
        LoRA: the adapter's tensors (``Adapter.load_state``, which raises ValueError on any
        other key set or shape), so both lists are empty."""
        if self.adapter is not None:
            self.adapter.load_state(weights)
            missing, unexpected = [], []
        else:
            missing, unexpected = load_full(self.policy, weights, strict=False)
        self._sync_masters()
        return missing, unexpected

    def reset_policy_to_base(self) -> None:
        """Put a LoRA policy back to the base model (version 0: the initial adapter, B = 0).

        Raises:
            ValueError: the policy is trained in full (its base weights are a folder to load).
        """
        if self.adapter is None:
            raise ValueError("a fully fine-tuned policy goes back to the base by loading its weights")
        self.adapter.reset()
        self._sync_masters()

    def _sync_masters(self) -> None:
        if isinstance(self.policy_opt, MixedPrecisionAdamW):
            self.policy_opt.sync_from_model()

    def policy_rates(self) -> list[float]:
        """The policy optimizer's learning rate per parameter group (one, or a LoRA+ adapter's
        A and B: ``Adapter.lr_scales``)."""
        return [g["lr"] for g in self.policy_opt.param_groups]

    def set_policy_rates(self, rates: list[float]) -> None:
        """Set the policy optimizer's rates (``policy_rates``' order), after a load: a state
        dict carries the rates it was saved with, and the learner trains at its config's."""
        for group, lr in zip(self.policy_opt.param_groups, rates, strict=True):
            group["lr"] = lr

    def load_policy_optimizer(self, state: dict) -> None:
        """Load the policy optimizer's ``state_dict`` at this config's rates (``set_policy_rates``).

        Raises:
            ValueError: ``state`` has other parameter groups (a LoRA policy's ``b_lr_ratio`` 1
                or not: ``LoraPolicy.changes_from``), named.
        """
        rates = self.policy_rates()
        try:
            self.policy_opt.load_state_dict(state)
        except ValueError as exc:
            raise ValueError(f"the saved policy optimizer does not fit this learner's ({exc})") from exc
        self.set_policy_rates(rates)

    def reset_policy_optimizer(self) -> None:
        """Forget the policy optimizer's moments (a rollback abandons their updates)."""
        self.policy_opt.state.clear()

    def reference_kl(self, batch: Batch) -> float:
        """The policy's KL to the base on ``batch`` as the KL anchor measures it in a step
        (``kl_ref``), without an update (``learner.algo.sao.SAOLearner.reference_kl``): the
        guard's drift veto measures a lineage's newest version with it before promoting it
        (``learner.process.Learner.measure_drift``). Here: raises ValueError, as every algorithm
        without the anchor does (SPO++ has none)."""
        raise ValueError(f"the {self.config.algorithm.name} algorithm has no KL anchor to measure with")

    def policy_weights(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The policy's state dict in ``dtype``, detached (for publishing), on the learner's
        device; with LoRA the adapter's tensors (``Adapter.state`` names). A tensor already in
        ``dtype`` shares the policy's storage (publishing a bf16 policy copies nothing), so read
        the result before the next update. With N ranks each tensor is gathered whole
        (``learner.models.placement.full_tensor``): every rank must call this, in step."""
        state = self.adapter.state() if self.adapter is not None else self.policy.state_dict()
        return {k: full_tensor(v.detach()).to(dtype=dtype) for k, v in state.items()}

    def save_adapter(self, folder: Path, dtype: torch.dtype) -> Path:
        """Write the LoRA adapter into ``folder`` in ``dtype`` (``learner.models.lora.Adapter.save``);
        returns the safetensors file. Raises ValueError for a fully fine-tuned policy, OSError
        when the folder cannot be written. With N ranks every rank must call
        ``adapter.tensors`` in step with the one that writes."""
        if self.adapter is None:
            raise ValueError("a fully fine-tuned policy has no adapter to save")
        return self.adapter.save(folder, dtype)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's part of a checkpoint: its state dict, or with LoRA only the adapter's
        tensors (the base weights are version 0's, loaded again at start)."""
        return self.adapter.state() if self.adapter is not None else self.policy.state_dict()

    def load_policy_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a ``policy_state()`` (the optimizer's masters are its own to restore).

        Raises:
            ValueError: an adapter state into a learner with another adapter, or with none.
            RuntimeError: from torch, a full state that does not fit the policy.
        """
        if self.adapter is not None:
            self.adapter.load_state(state)
        else:
            load_full(self.policy, state)
