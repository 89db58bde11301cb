"""The gate's reference models in the learner: the base model, the parent version and the base's
probe answers, built once and kept for the learner's life (docs/guard.md, "The gate").

The gate (``learner.guard.gate.run_gate``) compares a candidate with the base and with its parent, the
version it was trained from. Loading a model costs seconds and the base's answers a generate
batch, so one ``GateReferences`` per learner keeps them: the base and its answers forever (they
depend only on the base, the tokenizer and the gate's config), the parent until the parent
changes. A parent published as a LoRA adapter is merged into full float32 weights
``W + (α/r)·B·A`` (``learner.models.lora.Adapter.merged_weights``) so that both references stay plain
transformers models.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from core.policy_store import ADAPTER_FILE, WEIGHTS_FILE, Layout, layout
from learner.config import LoraPolicy
from learner.guard.gate_config import GateConfig


class GateReferences:
    """The base model, one parent version's model and the base's probe answers.

    ``base_dir``: the prepared base model; ``path_of``: a version's published folder (a
    database read, the learner's); ``lora``: the policy's LoRA settings when versions are
    adapters, else None. Models are float32 and in eval mode.
    """

    def __init__(self, base_dir: Path, path_of: Callable[[int], str], lora: LoraPolicy | None) -> None:
        self.base_dir = Path(base_dir)
        self.path_of = path_of
        self.lora = lora
        self._models: dict | None = None
        self._answers: list[list[int]] | None = None

    def _model(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32).eval()

    def models(self, parent_version: int):
        """``(base, parent, tokenizer)``: the parent version's model is None when the parent is
        the base (version 0). Loads what is not loaded yet; raises what loading raises."""
        from transformers import AutoTokenizer

        if self._models is None:
            self._models = {
                "base": self._model(),
                "parent": self._model(),
                "at": 0,
                "tokenizer": AutoTokenizer.from_pretrained(self.base_dir),
            }
        m = self._models
        if parent_version == 0:
            return m["base"], None, m["tokenizer"]
        if m["at"] != parent_version:
            m["parent"].load_state_dict(self._weights(Path(self.path_of(parent_version))), strict=False)
            m["at"] = parent_version
        return m["base"], m["parent"], m["tokenizer"]

    def answers(self, config: GateConfig) -> list[list[int]]:
        """The base's answers to the probes (``learner.guard.gate.reference_answers``), computed once."""
        from learner.guard.gate import reference_answers

        if self._answers is None:
            base, _, tokenizer = self.models(0)
            self._answers = reference_answers(base, tokenizer, config)
        return self._answers

    def _weights(self, path: Path) -> dict[str, torch.Tensor]:
        """The full float32 weights published at ``path``: the file itself, or the base with the
        adapter merged in (built on a fresh base model)."""
        from safetensors.torch import load_file

        if layout(path) != Layout.ADAPTER:
            return {k: v.float() for k, v in load_file(path / WEIGHTS_FILE).items()}
        if self.lora is None:
            raise ValueError(f"{path} holds a LoRA adapter, and this learner's policy is not LoRA")
        from learner.models.lora import Adapter

        adapter = Adapter(self._model(), self.lora)
        adapter.load_state(load_file(path / ADAPTER_FILE))
        return adapter.merged_weights()
