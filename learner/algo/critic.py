"""The SAO value model: the policy's transformer with a scalar head, attention frozen.

Source: SAO (arXiv 2607.07508) §2.3 "让 value model 支撑单 rollout 的低方差优势估计" (papers/001;
papers/003 §二(二)1-2), docs/design.md §5.2. The paper freezes the value model's attention during RL and
trains the MoE projections; on a dense model the counterpart is the MLP projections
(gate/up/down). ``trainable="all"`` is the paper's full-parameter ablation; ``trainable="head"``
freezes the whole body, the form ``learner.shared_base`` adds a LoRA adapter to (a project
deviation, docs/design.md §5.2).

Alignment: ``values[:, t] = V(s_t)``, the value of the state before token t, read from the hidden
state at position ``t - 1`` (docs/design.md §5.2 "the position just before token t"). Position 0 has no
preceding state; its value is defined as 0. Position 0 is always a prompt token, so it is never an
action and never enters GAE or the value loss.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from learner.algo.prefix import body_hidden

Trainable = Literal["mlp", "all", "head"]


class ValueModel(torch.nn.Module):
    """Critic ``V(s_t)``: a causal-LM body (``model.model``) plus ``Linear(hidden, 1)``.

    The head's weight is initialised to ``head_std``-scaled normal noise (default 0, i.e. zeros) and
    its bias to ``head_bias`` (default 0.5), so every initial value is 0.5: the middle of the
    reward range [0, 1] used here (binary or score feedback), which keeps the first advantages in
    [-0.5, 0.5] instead of [0, 1]. With a zero weight the body receives no gradient on the first
    update (only the head moves); it does from the second update on.

    The head runs in float32 outside autocast so small value differences survive bf16 autocast.

    Trainable parameters (``trainable``):
        - ``"mlp"`` (SAO default): the MLP projections (every parameter whose name contains
          ``.mlp.``) and the head. Embeddings, attention (q/k/v/o) and all RMSNorm weights are
          frozen. Norms are frozen by our choice: the paper names only attention as frozen and MoE
          projections as trained; keeping the norms fixed trains exactly "the MLP projections and
          the head" and leaves the attention inputs untouched.
        - ``"all"``: every parameter (ablation).
        - ``"head"``: the head only, the body frozen: a body shared with other models, which
          ``learner.shared_base.adapter_critic`` then gives a trainable LoRA adapter.

    Frozen parameters have ``requires_grad=False`` so an optimizer over ``trainable_parameters()``
    never touches them (no weight decay either).

    Raises (constructor): ValueError for an unknown ``trainable`` or a body without ``.mlp.``
    parameters in ``"mlp"`` mode.
    """

    def __init__(
        self,
        backbone: torch.nn.Module,
        hidden_size: int,
        trainable: Trainable = "mlp",
        head_bias: float = 0.5,
        head_std: float = 0.0,
    ) -> None:
        super().__init__()
        if trainable not in ("mlp", "all", "head"):
            raise ValueError(f"trainable must be 'mlp', 'all' or 'head', got {trainable!r}")
        self.backbone = backbone
        self.trainable = trainable
        self.head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        with torch.no_grad():
            if head_std > 0:
                self.head.weight.normal_(0.0, head_std)
            else:
                self.head.weight.zero_()
            self.head.bias.fill_(head_bias)
        self.head.to(next(backbone.parameters()).device)
        if trainable == "mlp":
            found = False
            for name, p in self.backbone.named_parameters():
                is_mlp = ".mlp." in f".{name}"
                p.requires_grad_(is_mlp)
                found |= is_mlp
            if not found:
                raise ValueError("trainable='mlp' but the backbone has no '.mlp.' parameters")
        else:
            self.backbone.requires_grad_(trainable == "all")
        self.head.requires_grad_(True)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        trainable: Trainable = "mlp",
        dtype: torch.dtype = torch.float32,
        head_bias: float = 0.5,
        head_std: float = 0.0,
    ) -> ValueModel:
        """Build from a transformers causal-LM checkpoint directory; its LM head is discarded.

        Args:
            path: checkpoint directory (config.json + safetensors).
            trainable: ``"mlp"`` or ``"all"``.
            dtype: body dtype; float32 by default (master weights for small updates).
            head_bias, head_std: head initialisation (see class docstring).

        Raises: OSError from transformers if the directory is not a checkpoint; ValueError as the
        constructor.
        """
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return cls(lm.base_model, lm.config.hidden_size, trainable, head_bias, head_std).eval()

    @classmethod
    def from_policy(
        cls,
        model: PreTrainedModel,
        trainable: Trainable = "mlp",
        dtype: torch.dtype | None = None,
        head_bias: float = 0.5,
        head_std: float = 0.0,
    ) -> ValueModel:
        """Build from an in-memory causal LM by deep-copying its body (no tensor is shared).

        Args:
            model: a transformers ``PreTrainedModel`` with ``base_model`` (e.g. LlamaForCausalLM).
            trainable: ``"mlp"`` or ``"all"``.
            dtype: cast the copy to this dtype; None keeps the policy's dtype.
            head_bias, head_std: head initialisation (see class docstring).
        """
        body = copy.deepcopy(model.base_model)
        for p in body.parameters():
            p.grad = None
        if dtype is not None:
            body.to(dtype)
        return cls(body, model.config.hidden_size, trainable, head_bias, head_std).eval()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters an optimizer should update (``requires_grad=True``), head included."""
        return [p for p in self.parameters() if p.requires_grad]

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, shared_prefix: int | None = None
    ) -> torch.Tensor:
        """Values ``V(s_t)`` for every position.

        Args:
            input_ids: [B, T] long token ids.
            attention_mask: [B, T] 0/1 (left or right padding; positions count attended tokens).
            shared_prefix: the common prefix length the body runs once
                (``learner.algo.prefix.body_hidden``'s ``shared``; None: this batch's own).

        Returns:
            [B, T] float32; ``out[:, t]`` is computed from the hidden state at ``t - 1``;
            ``out[:, 0] = 0``. Values at padding positions are meaningless.
        """
        hidden = body_hidden(self.backbone, input_ids, attention_mask, shared=shared_prefix)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            v = self.head(hidden[:, :-1].float()).squeeze(-1)
        return torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)
