"""The grouped LoRA op of the CPU engine: tokens grouped by adapter, two dense matmuls per adapter.

vLLM's CPU LoRA op (``vllm/lora/ops/torch_ops/lora_ops.py`` in the pinned 0.32.0) serves a batch
of T tokens by gathering, for every token, a copy of its adapter's matrices
(``lora_b_weights[lora_indices]``: T × out × rank) and running one batched einsum; the gather is
what makes a rank-8 adapter cost 2-3× a projection instead of a few per cent (issue 39;
docs/serving_adapters.md). Here the tokens of a batch are grouped by their adapter slot once per
batch layout (``lora_groups``), and each adapter present runs two dense matmuls on its own rows,
``(x_g · Aᵀ) · scale`` then ``· Bᵀ``, added into its rows of the output slices. No adapter
weights are copied; a batch whose tokens have no adapter does no LoRA work at all.

Semantics are the stock op's, with one difference: a token whose slot is -1 (no adapter) gets
no LoRA delta. The stock op indexes its weights with that -1, which is the last slot
(``max_loras - 1``): its delta is zero while that slot is empty, and that slot's adapter once it
is filled, so once every active slot holds an adapter a base request is served with the last
one's delta (shown on the engine: docs/serving_adapters.md, "The grouped LoRA op").

Shapes (every function): T tokens, ``in`` input features, R the slot rank (``max_lora_rank``),
S adapter slots. Stacked weights are vLLM's: A ``(S, 1, R, in)`` or ``(S, R, in)``, B
``(S, 1, out, R)`` or ``(S, out, R)``, in the LoRA dtype. The shrink runs in the dtype of its
output buffer (float32 in vLLM's layers), the expand in the dtype of the output, as the stock
op's casts do. Pure: tensors in, tensors changed in place, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

PINNED_VLLM = "0.32.0"
"""The vLLM version whose CPU LoRA op this replaces (``pyproject.toml``'s pin); the worker
extension refuses to install the grouped op on any other (``server.worker_ext``)."""


class LoraOp(enum.StrEnum):
    """Which op serves LoRA on a CPU engine: ``GROUPED`` (this module) or ``STOCK`` (vLLM's own)."""

    GROUPED = "grouped"
    STOCK = "stock"


def refusal(vllm_version: str, cpu: bool) -> str | None:
    """Why the grouped op must not replace vLLM's own, or None when it may.

    ``vllm_version``: ``vllm.__version__`` in the worker; ``cpu``: the worker runs vLLM's CPU
    platform. The op mirrors the stock op of ``PINNED_VLLM`` only (its wrapper's methods and the
    layout of its stacked weights), and GPU builds keep vLLM's Punica kernels.
    """
    if not cpu:
        return "not a CPU engine: vLLM's Punica kernels serve LoRA"
    if vllm_version != PINNED_VLLM:
        return (
            f"vLLM {vllm_version} is not {PINNED_VLLM}, the version the grouped LoRA op was checked "
            "against: vLLM's own op serves LoRA (slower)"
        )
    return None


@dataclass(frozen=True)
class LoraGroup:
    """The ``size`` tokens of one adapter slot in a batch: ``rows`` is a ``slice`` when they are
    contiguous (a view, no copy), else a long tensor of their row indices."""

    slot: int
    rows: slice | torch.Tensor
    size: int


def lora_groups(indices: torch.Tensor) -> tuple[LoraGroup, ...]:
    """Group the tokens of a batch by adapter slot.

    ``indices``: long tensor ``(T,)``, the slot of each token (vLLM's ``token_lora_indices`` or
    ``sampler_indices``), -1 for a token with no adapter. Returns one group per slot present, in
    slot order; tokens of slot -1 are in none (empty tuple: no adapter in the batch).
    """
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(indices.tolist()):
        if slot >= 0:
            rows_of.setdefault(slot, []).append(row)
    groups = []
    for slot in sorted(rows_of):
        rows = rows_of[slot]
        if rows[-1] - rows[0] + 1 == len(rows):
            groups.append(LoraGroup(slot, slice(rows[0], rows[-1] + 1), len(rows)))
        else:
            groups.append(LoraGroup(slot, torch.tensor(rows, dtype=torch.long), len(rows)))
    return tuple(groups)


def _covers(groups: tuple[LoraGroup, ...], tokens: int) -> bool:
    return sum(g.size for g in groups) == tokens


def _slot(stacked: torch.Tensor, slot: int) -> torch.Tensor:
    """One slot's matrix of vLLM's stacked weights: ``(R, in)`` of A or ``(out, R)`` of B."""
    w = stacked[slot]
    return w[0] if w.dim() == 3 else w


def _rows(t: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """``t``'s rows: ``t`` itself when they are all of them, a view for a slice, else a copy."""
    if isinstance(rows, slice):
        return t if rows.start == 0 and rows.stop == t.shape[0] else t[rows]
    return t.index_select(0, rows)


def _add_rows(y: torch.Tensor, rows: slice | torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``y[rows] += left @ right`` in place (``y`` may be a column slice of the output)."""
    if isinstance(rows, slice):
        _rows(y, rows).addmm_(left, right)
    else:
        y.index_add_(0, rows, left @ right)


class SlotWeights:
    """Each slot's LoRA matrices as the op multiplies them, prepared from vLLM's stacked weights
    once and reused until those change.

    An entry is keyed by the stacked tensors (held, so their ids stay theirs), the slot, the
    output widths and the dtype, and is rebuilt when any of the tensors' version counters moved
    (vLLM's ``set_lora`` / ``reset_lora`` write them in place, which bumps the counters). A slot
    whose matrices are all zero (an adapter that does not target this module, or the embedding
    and logits layers, which the served adapters never target) is None: no work. Rows of A (and
    the matching columns of B) that are zero, such as the padding of a rank-8 adapter in a
    ``max_lora_rank`` 16 slot, are dropped: they add exact zeros.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}

    def _get(self, key: tuple, sources: tuple[torch.Tensor, ...], build):
        versions = tuple(t._version for t in sources)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is sources[0] and entry[1] == versions:
            return entry[2]
        value = build()
        self._entries[key] = (sources[0], versions, value)
        return value

    def shrink(self, a_stacked: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``A[slot]ᵀ`` ``(in, R)`` in ``dtype``, or None when it is zero."""

        def build():
            a = _slot(a_stacked, slot).to(dtype)
            return a.t() if bool(a.any()) else None

        return self._get(("shrink", id(a_stacked), slot, dtype), (a_stacked,), build)

    def expand(
        self, b_stacked: torch.Tensor, slot: int, width: int, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """``B[slot][:width]ᵀ`` ``(R, width)`` in ``dtype``, or None when it is zero."""

        def build():
            b = _slot(b_stacked, slot)[:width].to(dtype)
            return b.t() if bool(b.any()) else None

        return self._get(("expand", id(b_stacked), slot, width, dtype), (b_stacked,), build)

    def linear(
        self,
        a_stacked: tuple[torch.Tensor, ...],
        b_stacked: tuple[torch.Tensor, ...],
        slot: int,
        widths: tuple[int, ...],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The slices of a projection fused: ``(Aᵀ, Bᵀ)`` with ``A`` the slices' A stacked
        ``(r, in)`` in float32 and ``B`` block-diagonal ``(Σ widths, r)`` in ``dtype`` (r: the
        non-zero ranks of all slices), so one matmul shrinks every slice and one expands them
        into the whole output row; None when every slice is zero."""

        def build():
            a_parts, b_parts = [], []
            for a_s, b_s, width in zip(a_stacked, b_stacked, widths, strict=True):
                a = _slot(a_s, slot).to(torch.float32)
                b = _slot(b_s, slot)[:width].to(dtype)
                keep = (a.any(dim=1) & b.any(dim=0)).nonzero().squeeze(1)
                a_parts.append(a.index_select(0, keep))
                b_parts.append(b.index_select(1, keep))
            if sum(p.shape[0] for p in a_parts) == 0:
                return None
            return torch.cat(a_parts).t(), torch.block_diag(*b_parts).t()

        key = ("linear", id(a_stacked[0]), slot, widths, dtype)
        return self._get(key, (*a_stacked, *b_stacked), build)


def shrink(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    groups: tuple[LoraGroup, ...],
    scale: float,
    weights: SlotWeights | None = None,
) -> None:
    """``y[t, :R] = scale · x[t] · A[slot(t)]ᵀ`` for the tokens of ``groups``, 0 for the others.

    ``y``: ``(T, ≥R)`` buffer (its dtype is the compute dtype); ``x``: ``(T, in)``;
    ``a_stacked``: A of every slot; ``weights``: prepared matrices to reuse (None: prepared for
    this call). The stock op's ``sgmv_shrink`` / ``bgmv_shrink``.
    """
    weights = weights or SlotWeights()
    rank = _slot(a_stacked, 0).shape[0]
    out = y[:, :rank] if y.shape[1] != rank else y
    parts = [(g, weights.shrink(a_stacked, g.slot, y.dtype)) for g in groups]
    if not _covers(groups, y.shape[0]) or any(a is None for _, a in parts):
        out.zero_()
    for g, a in parts:
        if a is None:
            continue
        xg = _rows(x, g.rows).to(y.dtype)
        target = _rows(out, g.rows) if isinstance(g.rows, slice) else None
        if scale == 1.0 and target is not None and target.is_contiguous():
            torch.mm(xg, a, out=target)
            continue
        part = xg @ a
        if scale != 1.0:
            part.mul_(scale)
        if target is not None:
            target.copy_(part)
        else:
            out.index_copy_(0, g.rows, part)


def expand(
    y: torch.Tensor,
    x: torch.Tensor,
    b_stacked: torch.Tensor,
    groups: tuple[LoraGroup, ...],
    offset: int = 0,
    size: int | None = None,
    add_inputs: bool = True,
    weights: SlotWeights | None = None,
) -> None:
    """``y[t, offset:offset+n] (+)= x[t] · B[slot(t)]ᵀ`` for the tokens of ``groups``.

    ``x``: ``(T, R)`` (the shrink's buffer); ``y``: ``(T, ≥offset+n)``; ``n`` is ``size``, or
    (None) B's output width cut to ``y``'s, as the stock ``bgmv_expand`` does where the model
    and the adapter pad differently. ``add_inputs`` False assigns, and the other tokens' columns
    are set to 0. ``weights`` as ``shrink``. The stock op's ``sgmv_expand[_slice]`` /
    ``bgmv_expand[_slice]``.
    """
    weights = weights or SlotWeights()
    out_b = _slot(b_stacked, 0).shape[0]
    n = min(out_b, y.shape[1] - offset) if size is None else size
    out = y if offset == 0 and n == y.shape[1] else y[:, offset : offset + n]
    if not add_inputs:
        out.zero_()
    for g in groups:
        b = weights.expand(b_stacked, g.slot, n, y.dtype)
        if b is not None:
            _add_rows(out, g.rows, _rows(x, g.rows).to(y.dtype), b)


def linear(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: tuple[torch.Tensor, ...],
    b_stacked: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    groups: tuple[LoraGroup, ...],
    weights: SlotWeights | None = None,
) -> None:
    """``y[t, slice i] += (scale · x[t] · A_i[slot(t)]ᵀ) · B_i[slot(t)]ᵀ`` for every output slice
    ``i`` (one for a plain projection, three for a fused qkv, two for gate_up), the tokens of
    ``groups`` only: per adapter one matmul for all slices' shrinks and one for their expands
    (``SlotWeights.linear``).

    ``y``: ``(T, ≥ Σ output_slices)``; ``x``: ``(T, in)``; ``a_stacked[i]`` / ``b_stacked[i]``:
    the stacked A / B of slice ``i`` (B's first ``output_slices[i]`` outputs are used: the
    logits' B may be padded wider than the vocabulary served). The shrink runs in float32 (the
    stock op's buffer), the expand in ``y``'s dtype. ``weights`` as ``shrink``. The stock
    ``PunicaWrapperCPU.add_lora_linear``, without its per-token copies.
    """
    weights = weights or SlotWeights()
    widths = tuple(output_slices)
    width = sum(widths)
    out = y if width == y.shape[1] else y[:, :width]
    for g in groups:
        fused = weights.linear(a_stacked, b_stacked, g.slot, widths, y.dtype)
        if fused is None:
            continue
        a, b = fused
        part = _rows(x, g.rows).to(torch.float32) @ a
        if scale != 1.0:
            part.mul_(scale)
        _add_rows(out, g.rows, part.to(y.dtype), b)
