"""vLLM's CPU Punica wrapper with the grouped LoRA op (``server.grouped_lora``) in place of the stock one.

Imports vLLM 0.32.0's ``PunicaWrapperCPU``, so it is imported only after the version guard
(``server.worker_ext``). Every LoRA layer of a vLLM model calls one shared wrapper object; the
worker extension turns that object into this class (a ``__class__`` swap: no state is copied and
the metadata vLLM keeps on it stays valid) and back. vLLM updates the metadata (which slot each
token uses) only when the batch's layout changes; the groups are computed from it once, lazily,
and reused by every layer and step until the next update.

Methods keep ``PunicaWrapperCPU``'s signatures and semantics (docstrings there), less the per-token
copies of adapter weights and the delta that the stock op gives tokens with no adapter
(``server.grouped_lora``). A batch with no adapter returns at once from every method: vLLM's
layers hand the shrink zero-filled buffers, so skipping it leaves them as the stock op would.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from server.grouped_lora import LoraGroup, SlotWeights, expand, linear, lora_groups, shrink


class GroupedPunicaWrapperCPU(PunicaWrapperCPU):
    """``PunicaWrapperCPU`` running ``server.grouped_lora``'s op (issue 39)."""

    # Class attributes, so that an instance of the stock class swapped to this one has them.
    _token_groups: tuple[LoraGroup, ...] | None = None
    _sampler_groups: tuple[LoraGroup, ...] | None = None
    _slot_weights: SlotWeights | None = None

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs) -> None:
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self.forget_groups()

    def forget_groups(self) -> None:
        """Group the tokens again at the next call (the metadata changed)."""
        self._token_groups = None
        self._sampler_groups = None

    @property
    def token_groups(self) -> tuple[LoraGroup, ...]:
        """The batch's tokens grouped by adapter slot (``token_lora_indices``)."""
        if self._token_groups is None:
            self._token_groups = lora_groups(self.token_lora_indices)
        return self._token_groups

    @property
    def sampler_groups(self) -> tuple[LoraGroup, ...]:
        """The sampled rows grouped by adapter slot (``sampler_indices``: the logits' rows)."""
        if self._sampler_groups is None:
            self._sampler_groups = lora_groups(self.sampler_indices)
        return self._sampler_groups

    @property
    def slot_weights(self) -> SlotWeights:
        """The slots' prepared matrices, kept across steps (``SlotWeights``)."""
        if self._slot_weights is None:
            self._slot_weights = SlotWeights()
        return self._slot_weights

    def add_shrink(self, y, x: torch.Tensor, lora_a_stacked, scale: float, **kwargs: Any) -> None:
        groups = self.token_groups
        if not groups:
            return
        x = x.view(-1, x.shape[-1])
        for i, a in enumerate(lora_a_stacked):
            shrink(y[i].view(-1, y[i].shape[-1]), x, a, groups, scale, self.slot_weights)

    def add_expand(
        self,
        y: torch.Tensor,
        x,
        lora_b_stacked,
        output_slices,
        offset_start: int = 0,
        add_inputs=True,
        **kwargs: Any,
    ) -> None:
        groups = self.token_groups
        if not groups and add_inputs:
            return
        y = y.view(-1, y.shape[-1])
        offset = offset_start
        for i, (b, n) in enumerate(zip(lora_b_stacked, output_slices, strict=True)):
            expand(y, x[i], b, groups, offset, n, add_inputs, self.slot_weights)
            offset += n

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        groups = self.token_groups
        if not groups and add_inputs:
            return
        expand(y, x, lora_b_stacked, groups, add_inputs=add_inputs, weights=self.slot_weights)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked,
        lora_b_stacked,
        scale: float,
        output_slices,
        *,
        buffer=None,
        **kwargs: Any,
    ) -> None:
        groups = self.token_groups
        if not groups:
            return
        y, x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, groups, self.slot_weights)

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale,
        *,
        buffer=None,
        **kwargs: Any,
    ) -> None:
        groups = self.sampler_groups
        if not groups:
            return
        y, x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        width = min(lora_b_stacked.shape[-2], y.shape[1])  # the stock op's common_len (vocab padding)
        linear(y, x, (lora_a_stacked,), (lora_b_stacked,), scale, (width,), groups, self.slot_weights)
