"""Where a learner's models live and how a step's rows are split: one device, or N ranks (FSDP2).

Issue 38, docs/scaling.md ("The learner on GPUs and across processes"). A ``Placement`` is what the
learners (``learner.algo.sao``, ``learner.algo.spo``) consult for every model they hold and every forward
pass they run, so that the algorithm code is the same for one process and for N ranks:

- ``place(model)`` moves a model to the device and, with N ranks, shards it with FSDP2
  (``torch.distributed.fsdp.fully_shard``): each decoder layer is a unit, the root (embeddings,
  final norm, LM head; the critic's head) another; with ``bf16`` the units gather their
  parameters in bf16 and reduce gradients in float32 (``MixedPrecisionPolicy``), so the sharded
  float32 parameters are the masters the optimiser updates (the role ``learner.models.precision``'s
  ``MixedPrecisionAdamW`` has in one process).
- ``logprobs`` and ``values`` evaluate a model on the step's batch. With N ranks every rank
  holds the whole batch (rank 0 broadcasts it, ``learner.distributed``), evaluates its
  contiguous share of the rows and all-gathers the [B, T] result (``_GatherRows``): the rows of
  other ranks are constants, its own carry the graph. Every loss, normalisation and statistic
  after that (the DIS and KL token means, SPO++'s action-token measure, the critic's MSE and
  EV, GAE) is then computed on the same full tensors on every rank, exactly as in one process;
  each rank's backward gives the gradient of its rows' part, and FSDP's reduce-scatter sums
  them (divide factor 1), which is the single-process gradient up to float summation order.
- The shared-prefix forward (``learner.algo.prefix``) takes the prefix length of the whole batch on
  every rank, so each rank runs each layer the same number of times (FSDP's collectives must
  match) and the arithmetic is the single process's.

Pure torch (no I/O); the process group is created by ``learner.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from learner.algo.prefix import shared_prefix_length
from learner.data.batch import policy_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.algo.critic import ValueModel
    from learner.data.batch import Batch

ROOT_ATTRIBUTE = "_fsdp_root"
"""Where ``Placement.place`` leaves a sharded causal LM's ``_LogprobModule`` root on the model."""


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the whole tensor of a sharded one (a DTensor: an all-gather, so every
    rank must call it, in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def load_full(module: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True):
    """``module.load_state_dict(state, strict)`` where ``state`` holds whole tensors and the module
    may be sharded: each rank keeps its shard of each tensor (DTensor's implicit replication,
    no communication). Returns what ``load_state_dict`` returns; raises what it raises."""
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        return module.load_state_dict(state, strict=strict)


class _LogprobModule(torch.nn.Module):
    """An FSDP root around a causal LM whose forward is ``learner.data.batch.policy_logprobs``: the
    chunked LM head reads ``lm_head.weight`` outside the body's forward, so the root unit that
    owns it (with the tied embeddings) must be a module whose forward runs the whole pass."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, temperatures, positions, chunk_tokens, shared):
        return policy_logprobs(
            self.model,
            input_ids,
            attention_mask,
            temperatures,
            positions=positions,
            chunk_tokens=chunk_tokens,
            shared_prefix=shared,
        )


def _reshard_after_evaluation(root: torch.nn.Module) -> None:
    """Free the gathered parameters of an FSDP root after a pass without gradient.

    FSDP2 keeps the root unit's parameters whole after its forward, expecting the backward that
    follows at once; an evaluation (the KL reference, the critic's values
    before GAE) has none, and the whole embeddings and head would then stay on every rank until
    the next backward."""
    if not torch.is_grad_enabled():
        root.reshard()


class _GatherRows(torch.autograd.Function):
    """All-gather [b_r, T] row shards into [B, T]; the backward hands each rank the gradient
    of its own rows (the others are constants on this rank). ``counts``: rows per rank; a rank
    with none evaluated a stand-in row (so its collectives match) and gets a zero gradient."""

    @staticmethod
    def forward(ctx, local, rank, counts):
        import torch.distributed as dist

        width = max(counts)
        padded = local.new_zeros((width, *local.shape[1:]))
        own = counts[rank]
        padded[:own] = local[:own]
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous())
        ctx.rank, ctx.counts, ctx.shape = rank, counts, local.shape
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.counts[: ctx.rank])
        own = ctx.counts[ctx.rank]
        out = grad.new_zeros(ctx.shape)
        out[:own] = grad[start : start + own]
        return out, None, None


@dataclass
class Placement:
    """A learner's device and, with ``world > 1``, its rank in the FSDP2 group (module docstring).

    Fields: ``device`` (``learner.models.device.resolve``), ``rank`` and ``world`` (0 and 1 for one
    process), ``bf16`` (with N ranks: FSDP mixed precision, bf16 compute and float32 masters).
    """

    device: torch.device
    rank: int = 0
    world: int = 1
    bf16: bool = False

    @property
    def sharded(self) -> bool:
        """Whether models are sharded over more than one rank."""
        return self.world > 1

    def place(self, model: torch.nn.Module, keep_float32: tuple[str, ...] = (), frozen: bool = False) -> None:
        """Move ``model`` to the device; with N ranks shard it (FSDP2, module docstring).

        ``keep_float32``: submodules that compute in float32 under bf16 (the critic's value
        head, ``learner.algo.critic``). ``frozen``: a model never trained (the KL reference), taken
        in the dtype it has. A causal LM (anything with ``get_output_embeddings``) gets an
        ``_LogprobModule`` root, through which ``logprobs`` then evaluates it.
        """
        model.to(self.device)
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from transformers.modeling_layers import GradientCheckpointingLayer

        mixed = self.bf16 and not frozen
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else MixedPrecisionPolicy()
        for layer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
            fully_shard(layer, mp_policy=policy)
        for name in keep_float32:
            fully_shard(model.get_submodule(name), mp_policy=MixedPrecisionPolicy(cast_forward_inputs=False))
        root = _LogprobModule(model) if hasattr(model, "get_output_embeddings") else model
        # Temperatures and values are float inputs that must not be cast to bf16 on the way in.
        root_policy = MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, cast_forward_inputs=False)
        fully_shard(root, mp_policy=root_policy)
        for unit in root.modules():
            if isinstance(unit, FSDPModule):
                # Sum the ranks' gradients (each rank's loss already is its rows' share of the
                # batch's), with plain SUM collectives (gloo has no pre-multiplied sum).
                unit.set_gradient_divide_factor(1.0)
                if hasattr(unit, "set_force_sum_reduction_for_comms"):  # torch < 2.8: NCCL only
                    unit.set_force_sum_reduction_for_comms(True)
        # Kept on the model (not in this placement, which outlives the models a rebuild drops):
        # past nn.Module's __setattr__, which would make the root a submodule of what it wraps.
        object.__setattr__(model, ROOT_ATTRIBUTE, root)

    def root(self, model: torch.nn.Module) -> torch.nn.Module:
        """The FSDP root ``place`` made for ``model`` (the module whose state dict and optimiser
        a sharded checkpoint holds, ``learner.distributed``), or ``model`` itself."""
        return model.__dict__.get(ROOT_ATTRIBUTE, model)

    def _counts(self, rows: int) -> list[int]:
        base, extra = divmod(rows, self.world)
        return [base + (r < extra) for r in range(self.world)]

    def local_rows(self, rows: int) -> torch.Tensor:
        """The indices (1-D long) of this rank's contiguous share of ``rows`` rows (all of them
        in one process); empty where there are fewer rows than ranks."""
        counts = self._counts(rows)
        start = sum(counts[: self.rank])
        return torch.arange(start, start + counts[self.rank], device=self.device)

    def _shard_rows(self, batch: Batch, positions: torch.Tensor | None):
        rows = self.local_rows(batch.input_ids.shape[0])
        # A rank without rows evaluates row 0 as a stand-in: FSDP's collectives need every rank
        # in every forward and backward; _GatherRows drops its output and gradient.
        pick = rows if rows.numel() else torch.zeros(1, dtype=torch.long, device=self.device)
        local = batch.select(pick)
        return local, (positions[pick] if positions is not None else None)

    def _shared(self, batch: Batch) -> int:
        ids = batch.input_ids
        return shared_prefix_length(ids, batch.attention_mask) if ids.shape[0] > 1 else 0

    def logprobs(
        self, model: PreTrainedModel, batch: Batch, positions: torch.Tensor | None, chunk_tokens: int
    ) -> torch.Tensor:
        """[B, T] float32 log-probabilities of ``batch``'s tokens at ``positions`` under ``model``
        (``learner.data.batch.policy_logprobs``), the rows split over the ranks and gathered."""
        if not self.sharded:
            return policy_logprobs(
                model,
                batch.input_ids,
                batch.attention_mask,
                batch.temperatures,
                positions=positions,
                chunk_tokens=chunk_tokens,
            )
        local, pos = self._shard_rows(batch, positions)
        root = self.root(model)
        out = root(
            local.input_ids, local.attention_mask, local.temperatures, pos, chunk_tokens, self._shared(batch)
        )
        _reshard_after_evaluation(root)
        return _GatherRows.apply(out, self.rank, self._counts(batch.input_ids.shape[0]))

    def values(self, critic: ValueModel, batch: Batch) -> torch.Tensor:
        """[B, T] float32 critic values of ``batch`` (``learner.algo.critic.ValueModel``), the rows
        split over the ranks and gathered."""
        if not self.sharded:
            return critic(batch.input_ids, batch.attention_mask)
        local, _ = self._shard_rows(batch, None)
        out = critic(local.input_ids, local.attention_mask, shared_prefix=self._shared(batch))
        _reshard_after_evaluation(critic)
        return _GatherRows.apply(out, self.rank, self._counts(batch.input_ids.shape[0]))
